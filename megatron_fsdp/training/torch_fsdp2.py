"""``--use-torch-fsdp2``: the model wrapped with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``), as Megatron-LM's ``TorchFullyShardedDataParallel``
wraps it (megatron/core/distributed/torch_fully_sharded_data_parallel.py).

Units, as Megatron-LM's: every transformer layer and the embedding are FSDP2 units of
their own (gathered just before their forward and backward, resharded after), and the
root takes the rest (final norm, output layer). Weights, gradients and optimizer state
are sharded over every rank (Shard(0) DTensors); ``--torch-fsdp2-no-reshard-after-forward``
keeps each layer's weights gathered from its forward until its backward (ZeRO-2-like).

[Note: FSDP2 mixed precision] With ``--bf16`` Megatron-LM casts the model to bf16
(``Float16Module``) before FSDP2 shards it, without a ``MixedPrecisionPolicy``: forward,
backward and the gradient reduce-scatter run in bf16, and its optimizer
(``Float16OptimizerWithFloat16Params``) steps fp32 copies of the bf16 shards. Here the
sharded weights *are* those fp32 main weights -- rounded to bf16 at the start, as
Megatron-LM's copies of its bf16 weights are -- and ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16)`` casts them at each all-gather: the same forward, backward and
reduction, with a plain AdamW on the fp32 shards. Buffers are cast to bf16 as
``Float16Module`` casts them; forward inputs are not cast (an fp32 input such as
megatron-core's rotary frequencies stays fp32, as in Megatron-LM). One difference:
micro batches' gradients add up in the fp32 shards here, in bf16 shards there.

[Note: FSDP2 micro batches] Megatron-LM's wrapper's ``no_sync`` does nothing: every
micro batch reduce-scatters its gradients, which add up sharded (memory stays
ZeRO-3's). This wrapper keeps that, so ``train_step``'s ``no_sync()`` around the early
micro batches changes nothing; each reduce-scatter averages over the data-parallel
ranks, as PyTorch DDP's all-reduce does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from megatron_fsdp.comm import device as device_mod
from megatron_fsdp.models.gpt import GPT

from .args.arg_types import Precision
from .sharded_view import ShardedModelView, parameter_marks, restore_marks

_COMPUTE_DTYPES = {Precision.FP32: None, Precision.BF16: torch.bfloat16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchFSDP2Config:
    """How ``wrap_torch_fsdp2`` shards the model (Megatron-LM's
    ``TorchFullyShardedDataParallelConfig`` and its precision flags)."""

    reshard_after_forward: bool = True
    """Free each unit's gathered weights after its forward and gather them again for its
    backward (ZeRO-3); False keeps them from forward to backward (more memory, one
    all-gather less per unit)."""
    compute_dtype: Optional[torch.dtype] = None
    """dtype of the gathered weights, of forward/backward and of the gradient reduction
    (see [Note: FSDP2 mixed precision]); None: the stored dtype (fp32)."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in (None, torch.bfloat16):
            raise ValueError(f"compute_dtype={self.compute_dtype} is not supported with FSDP2 here; use None (fp32) "
                             "or torch.bfloat16 (Megatron-LM does not support FSDP2 with fp16)")

    @classmethod
    def from_args(cls, args) -> "TorchFSDP2Config":
        if args.precision not in _COMPUTE_DTYPES:
            raise ValueError(f"--use-torch-fsdp2 with {args.precision.value} weights: only fp32 and --bf16 are "
                             "supported (validation refuses --fp16, as Megatron-LM)")
        return cls(reshard_after_forward=args.torch_fsdp2_reshard_after_forward,
                   compute_dtype=_COMPUTE_DTYPES[args.precision])

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        # Inputs are left as they come: Megatron-LM's model casts its own activations, and an
        # fp32 input it keeps on purpose (megatron-core's rotary frequencies) must stay fp32.
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.compute_dtype,
                                    cast_forward_inputs=False)


class TorchFullyShardedDataParallel(ShardedModelView):
    """The launcher's view of an FSDP2-sharded model, as Megatron-LM's wrapper of the same
    name: ``module`` is the model itself (``fully_shard`` made it an ``FSDPModule``); its
    ``no_sync`` holds nothing back ([Note: FSDP2 micro batches])."""


def wrap_torch_fsdp2(module: nn.Module, config: TorchFSDP2Config, device: torch.device,
                     *, recompute: bool = False) -> TorchFullyShardedDataParallel:
    """Shard ``module`` (on ``device``, fp32 or -- for --bf16 -- any dtype) over every rank.
    ``recompute``: activation recomputation is on; the backward prefetch then follows the
    units' order explicitly, as Megatron-LM sets it, since a recomputed forward would
    otherwise reorder FSDP2's implicit schedule."""
    if config.compute_dtype is not None:
        _round_to_compute_dtype(module, config.compute_dtype)
    marks = parameter_marks(module)
    mesh = init_device_mesh(device_mod.mesh_device_type(device), (dist.get_world_size(),), mesh_dim_names=("dp",))
    policy = config.mixed_precision_policy()
    previous: Optional[FSDPModule] = None
    for unit in shard_units(module):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=config.reshard_after_forward,
                    mp_policy=policy)
        if recompute:
            unit[0].set_modules_to_backward_prefetch([previous] if previous is not None else [])
        previous = unit[0]
    # The root (final norm, output layer) keeps FSDP2's default: not resharded after forward,
    # as its backward comes first.
    fully_shard(module, mesh=mesh, mp_policy=policy)
    restore_marks(module, marks)
    return TorchFullyShardedDataParallel(module)


def shard_units(module: nn.Module) -> list[list[nn.Module]]:
    """The FSDP2 units below the root, in forward order: Megatron-LM's
    ``sub_modules_to_wrap`` (the embedding, each transformer layer; with its local layer
    spec the output layer stays in the root). A list of several modules is one unit."""
    if isinstance(module, GPT):
        embedding = [module.wte] + ([module.wpe] if getattr(module, "wpe", None) is not None else [])
        return [embedding] + [[block] for block in module.blocks]
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    units = [[m] for m in module.modules() if isinstance(m, (LanguageModelEmbedding, TransformerLayer))]
    if not units:
        raise TypeError(f"--use-torch-fsdp2 does not know the layers of {type(module).__name__}: it shards the "
                        "embedded GPT and megatron-core's GPTModel")
    return units


@torch.no_grad()
def _round_to_compute_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Megatron-LM's start under --bf16 (see [Note: FSDP2 mixed precision]): weights and
    buffers cast to bf16, the weights then kept as their fp32 copies (the main weights)."""
    module.to(dtype)
    for param in module.parameters():
        param.data = param.data.float()  # the same Parameter object: marks and sharing survive
