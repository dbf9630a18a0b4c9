"""Builds the same model, optimizer and step for each implementation under test.

Every implementation starts from ``GPT(cfg)`` built under the same seed, trains
with ``AdamW(lr)`` on the same tokens, and in fp32 unless ``--dtype bf16``:

=========  ===========================  ==================================  ===================
           compute / gathered weights   gradients on the wire               optimizer weights
=========  ===========================  ==================================  ===================
DDP        fp32 params, bf16 autocast   bf16 (``bf16_compress_hook``)       fp32 params
FSDP2      bf16 (``param_dtype``)       bf16 (``reduce_dtype``)             fp32 sharded params
mfsdp      bf16 model weights           bf16 (main grads in param dtype)    fp32 main weights
mfsdp_exp  bf16 model weights           bf16 (main grads in param dtype)    fp32 main weights
=========  ===========================  ==================================  ===================

``mfsdp_exp`` is ``megatron_fsdp.experimental.fully_shard`` applied per
transformer block and then to the root, all ``Shard(0)`` (ZeRO-3), with
``fully_shard_optimizer``.

DDP uses ``gradient_as_bucket_view=True`` (its memory-lean setting: gradients
live in the all-reduce buckets instead of beside them) and a counting
communication hook (see counting.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.models.gpt import gpt_loss

from .config import Family, ImplSpec
from .counting import CollectiveCounter
from .theory import ElementSizes, ParamCounts

DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


def local_bytes(tensor: Optional[torch.Tensor]) -> int:
    """Bytes of this rank's part of ``tensor`` (the local shard of a DTensor)."""
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def param_counts(model: GPT) -> ParamCounts:
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for block in model.blocks for p in block.parameters())
    last = sum(p.numel() for p in model.blocks[-1].parameters())
    return ParamCounts(total=total, root=total - blocks, last_block=last)


@dataclasses.dataclass(eq=False, kw_only=True)
class Trainer:
    """One implementation, ready to step."""

    spec: ImplSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counts: ParamCounts
    sizes: ElementSizes
    """Per-element bytes of each state category, for the memory formula."""
    comm_elem: int
    """Bytes per element of gathered weights and reduced gradients on the wire."""
    autocast_dtype: Optional[torch.dtype] = None
    drain: Callable[[], None] = lambda: None
    """Waits for communication a step left in flight (megatron_fsdp's ZeRO-1/2 weight refresh)."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        autocast = (
            torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        )
        with autocast:
            loss = gpt_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    @property
    def accounting(self):
        """megatron_fsdp's buffer accounting, ``None`` for the others."""
        return getattr(self.model, "buffer_accounting", None)

    def memory(self) -> dict[str, Optional[int]]:
        """Persistent bytes on this rank by category, measured the same way for all."""
        accounting = self.accounting
        if accounting is not None:
            persistent = accounting.persistent
            return {
                "weights": persistent.get("model_weights", 0),
                "main_weights": persistent.get("main_weights", 0),
                "grads": persistent.get("main_grads", 0),
                "optimizer_state": optimizer_state_bytes(self.optimizer),
                "peak_temporary": accounting.peak_temporary,
            }
        params = list(self.model.parameters())
        return {
            "weights": sum(local_bytes(p) for p in params),
            "main_weights": 0,
            "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "peak_temporary": None,  # no Python-visible accounting of gathered weights
        }


def build_trainer(spec: ImplSpec, gpt_config: GPTConfig, *, dtype: str, seed: int, lr: float,
                  counter: CollectiveCounter, double_buffer: bool = False) -> Trainer:
    torch.manual_seed(seed)
    module = GPT(gpt_config)
    counts = param_counts(module)
    compute_dtype = DTYPE_OF[dtype]
    comm_elem = torch.empty((), dtype=compute_dtype).element_size()

    def make_optimizer(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    match spec.family:
        case Family.DDP:
            return _build_ddp(spec, module, counts, compute_dtype, comm_elem, make_optimizer, counter)
        case Family.FSDP2:
            return _build_fsdp2(spec, module, counts, compute_dtype, comm_elem, make_optimizer)
        case Family.MEGATRON_FSDP:
            return _build_megatron(spec, module, counts, compute_dtype, comm_elem, make_optimizer, double_buffer)
        case Family.EXPERIMENTAL:
            return _build_experimental(spec, module, counts, compute_dtype, comm_elem, make_optimizer)
    raise ValueError(f"implementation family {spec.family!r} has no builder; add one to impls.py")


def _build_ddp(spec, module, counts, compute_dtype, comm_elem, make_optimizer, counter) -> Trainer:
    model = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)
    low_precision = compute_dtype != torch.float32
    base_hook = default_hooks.bf16_compress_hook if low_precision else default_hooks.allreduce_hook
    model.register_comm_hook(dist.group.WORLD, counter.ddp_hook(base_hook))
    return Trainer(
        spec=spec,
        model=model,
        optimizer=make_optimizer(model.parameters()),
        counts=counts,
        sizes=ElementSizes(weights=4),
        comm_elem=comm_elem,
        autocast_dtype=compute_dtype if low_precision else None,
    )


def _build_fsdp2(spec, module, counts, compute_dtype, comm_elem, make_optimizer) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
    for block in module.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=spec.reshard_after_forward, mp_policy=policy)
    # The root keeps FSDP2's default, which holds its parameters from forward to
    # backward whatever the blocks do (see theory.py).
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return Trainer(
        spec=spec,
        model=module,
        optimizer=make_optimizer(module.parameters()),
        counts=counts,
        sizes=ElementSizes(weights=4),
        comm_elem=comm_elem,
    )


def _build_megatron(spec, module, counts, compute_dtype, comm_elem, make_optimizer, double_buffer) -> Trainer:
    module = module.to(compute_dtype)
    model, optimizer = mf.fully_shard(
        module,
        make_optimizer,
        fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=spec.strategy,
        device=torch.device("cpu"),
        fsdp_double_buffer=double_buffer,
    )
    return Trainer(
        spec=spec,
        model=model,
        optimizer=optimizer,
        counts=counts,
        sizes=ElementSizes(weights=comm_elem, grads=comm_elem),
        comm_elem=comm_elem,
        drain=model.finish_param_sync,
    )


def _build_experimental(spec, module, counts, compute_dtype, comm_elem, make_optimizer) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from megatron_fsdp import experimental as mx

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    zero3 = mx.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
    module = module.to(compute_dtype)
    with mx.fully_shard_context(torch.device("cpu")) as context:
        for block in module.blocks:
            mx.fully_shard(block, mesh=mesh, placements=zero3)
        mx.fully_shard(module, mesh=mesh, placements=zero3)
    optimizer = make_optimizer(module.parameters())
    mx.fully_shard_optimizer(optimizer)
    # Trainer.memory reads the same accounting categories as the main engine's.
    module.buffer_accounting = context.accounting
    return Trainer(
        spec=spec,
        model=module,
        optimizer=optimizer,
        counts=counts,
        sizes=ElementSizes(weights=comm_elem, grads=comm_elem),
        comm_elem=comm_elem,
    )
