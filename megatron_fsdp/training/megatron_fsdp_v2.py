"""``--use-megatron-fsdp --megatron-fsdp-version 2``: the model sharded by the per-module API
(``megatron_fsdp.experimental.fully_shard``), as Megatron-LM's ``FullyShardedDataParallelV2``
(megatron/core/distributed/fsdp/mcore_fsdp_adapter.py) shards it.

Units, as Megatron-LM's: each transformer layer (the embedded GPT's ``TransformerBlock``,
megatron-core's ``TransformerLayer`` with ``--use-mcore-models``) is an FSDP module of its own, sharded bottom-up, and
the root takes the rest (embeddings, final norm, output layer). Every placement is
``Shard(0)`` over the data-parallel ranks: weights, gradients and optimizer state (ZeRO-3,
the only strategy v2 has). The optimizer is the plain torch optimizer over the sharded
main weights (DTensors), adapted by ``fully_shard_optimizer``; there is no distributed
optimizer (Megatron-LM refuses ``--use-distributed-optimizer`` with v2).

[Note: v2 mixed precision] Megatron-LM builds v2's ``MixedPrecisionPolicy`` from
``--megatron-fsdp-main-params-dtype``, ``--megatron-fsdp-main-grads-dtype`` and
``--megatron-fsdp-grad-comm-dtype``, on a model already cast to its compute dtype
(``Float16Module`` for ``--bf16``). The same here: the module is cast before sharding, and the
policy is the one ``ddp_config_from_args`` builds for v1, so v1 and v2 of one command line keep
fp32 main weights and reduce in the same dtypes.

[Note: v2 micro batches] v2 reduce-scatters every micro batch's gradients during its backward
and adds them up sharded (Megatron-LM's ``start_grad_sync`` / ``finish_grad_sync`` do nothing).
``no_sync`` still marks the early micro batches (``experimental.microbatch``), which changes
nothing for ``Shard(0)`` gradients and keeps the contract of every other path's wrapper.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from megatron_fsdp.comm import device as device_mod
from megatron_fsdp import experimental
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

from .sharded_view import ShardedModelView, parameter_marks, restore_marks

__all__ = ["MegatronFSDPV2", "adapt_optimizer", "mcore_layer_types", "wrap_megatron_fsdp_v2"]

# Weights, gradients and optimizer state sharded on dim 0 over the one data-parallel axis.
_ZERO3 = experimental.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])


class MegatronFSDPV2(ShardedModelView):
    """The launcher's view of a v2-sharded model: ``module`` is the model itself (``fully_shard``
    made it and its layers ``FsdpModule``s)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """An early micro batch of the step: see [Note: v2 micro batches]."""
        with experimental.microbatch(self.module, is_last=False):
            yield


def wrap_megatron_fsdp_v2(module: nn.Module, unit_types: Sequence[type], policy: MixedPrecisionPolicy,
                          device: torch.device, compute_dtype: Optional[torch.dtype] = None) -> MegatronFSDPV2:
    """Shard ``module`` over every rank: each submodule of ``unit_types`` first (deepest first,
    as Megatron-LM walks ``reversed(module.modules())``), then the root. ``compute_dtype``: the
    cast before sharding ([Note: v2 mixed precision]); None keeps the module's dtype."""
    if compute_dtype is not None:
        module = module.to(compute_dtype)
    marks = parameter_marks(module)
    mesh = init_device_mesh(device_mod.mesh_device_type(device), (dist.get_world_size(),), mesh_dim_names=("dp",))
    units = [m for m in reversed(list(module.modules())) if m is not module and isinstance(m, tuple(unit_types))]
    if not units:
        raise TypeError(f"--megatron-fsdp-version 2 found no layer of {[t.__name__ for t in unit_types]} in "
                        f"{type(module).__name__}; it shards the embedded GPT and megatron-core's GPTModel")
    with experimental.fully_shard_context(device):
        for unit in units:
            experimental.fully_shard(unit, mesh=mesh, placements=_ZERO3, mixed_precision_policy=policy)
        experimental.fully_shard(module, mesh=mesh, placements=_ZERO3, mixed_precision_policy=policy)
    restore_marks(module, marks)
    return MegatronFSDPV2(module)


def mcore_layer_types() -> list[type]:
    """megatron-core's layer classes v2 shards as units (Megatron-LM's default
    ``fsdp_unit_modules``: its transformer layers; the MoE layer is a ``TransformerLayer`` too)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [TransformerLayer]


def adapt_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The plain optimizer over the sharded main weights, with the per-module API's step hooks
    (gradient casts, compute weights refreshed after each step); returns it."""
    experimental.fully_shard_optimizer(optimizer)
    return optimizer
