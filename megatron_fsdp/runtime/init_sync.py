"""The initial state every data-parallel rank starts from.

[Note: initial state from data-parallel rank 0] A script that does not seed, seeds
by rank, or asks for Megatron-LM's ``--data-parallel-random-init`` builds a
different model on every rank. PyTorch DDP broadcasts rank 0's parameters and
buffers when it is built, so training equals one process started from rank 0's
weights. Without that, a replicated layout trains one model per rank, and a
sharded one keeps each rank's slice of its own initialisation: a patchwork of
models that no single process ever held. So wrapping does what DDP does, for every
layout: before any buffer is filled (or, for a meta-device model, as each module
is materialised, before its values are stored), every parameter and buffer is
broadcast from the first rank of its data-parallel groups (the shard group, then
the outer group under HSDP; expert parameters over the expert data-parallel
groups, since other expert-parallel ranks hold other experts). The cost is one
broadcast of the model at wrap, next to thousands of steps of gathers and
reductions. Afterwards ``broadcast_params()`` (Megatron-LM's habit for
``--data-parallel-random-init``) finds the replicas already equal.

Buffers are broadcast again before each forward that follows a training forward
(DDP's ``broadcast_buffers``: BatchNorm statistics differ across ranks after each
step), over the same groups.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives
from ..comm.broadcast_tensors import broadcast_from_first
from ..comm.distributed_index import FSDPDistributedIndex
from ..param_marks import is_expert_param


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (each tensor-parallel rank holds its own)."""
    return getattr(t, "_local_tensor", t)


def _buffer_is_expert(owner: nn.Module) -> bool:
    """A buffer follows its module's parameters: expert groups when they all are
    expert parameters (a router's per-expert counters stay dense)."""
    params = list(owner.parameters())
    return bool(params) and all(is_expert_param(p) for p in params)


def _module_buffers(module: nn.Module) -> list[tuple[torch.Tensor, bool]]:
    return [(b, _buffer_is_expert(m)) for m in module.modules() for b in m.buffers(recurse=False)]


def _broadcast(tensors: Iterable[tuple[torch.Tensor, bool]], dist_index: FSDPDistributedIndex, label: str,
               timeout: Optional[datetime.timedelta], only_changed: bool = False) -> None:
    by_kind: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for t, is_expert in tensors:
        if t.device.type != "meta":
            by_kind[is_expert].append(_local(t))
    for is_expert, kind_tensors in by_kind.items():
        if kind_tensors:
            dp = dist_index.groups_for(is_expert)
            broadcast_from_first(kind_tensors, (dp.shard_group, dp.outer_group), label=label, timeout=timeout,
                                 only_changed=only_changed)


def _fingerprint(module: nn.Module, experts: bool) -> int:
    """The structure (names, shapes, dtypes) of the model's dense or expert parameters and
    buffers as 62 bits."""
    params = [(n, p) for n, p in module.named_parameters() if is_expert_param(p) == experts]
    buffers = [(f"{m}.{n}" if m else n, b) for m, owner in module.named_modules()
               for n, b in owner.named_buffers(recurse=False) if _buffer_is_expert(owner) == experts]
    items = [(n, tuple(t.shape), str(t.dtype)) for n, t in params + buffers]
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:8], "little") >> 2


def check_same_structure(module: nn.Module, dist_index: FSDPDistributedIndex,
                         timeout: Optional[datetime.timedelta] = None) -> None:
    """Refuse, on every rank, models whose structure differs across the data-parallel
    ranks: their flat broadcasts (and every later collective) would not line up. Expert
    parameters are compared over the expert data-parallel ranks only (the other
    expert-parallel ranks hold other experts)."""
    has_experts = any(is_expert_param(p) for p in module.parameters())
    for experts in (False, True) if has_experts else (False,):
        mine = _fingerprint(module, experts)
        dp = dist_index.groups_for(experts)
        for group in (dp.shard_group, dp.outer_group):
            if group is None or dist.get_world_size(group) == 1:
                continue
            bounds = torch.tensor([mine, -mine], dtype=torch.int64)
            collectives.control_all_reduce(bounds, group, op=dist.ReduceOp.MAX, label="model_structure",
                                           timeout=timeout)
            if bounds[0].item() != -bounds[1].item():
                raise ValueError(
                    f"the {'expert ' if experts else ''}data-parallel ranks built different models (parameter or "
                    "buffer names, shapes or dtypes differ), so their weights cannot be made equal nor their "
                    "gradients reduced; build the same model on every rank (rank-dependent code or configuration "
                    "before wrapping is the usual cause)"
                )


def sync_initial_state(module: nn.Module, dist_index: FSDPDistributedIndex,
                       timeout: Optional[datetime.timedelta] = None) -> None:
    """[Note: initial state from data-parallel rank 0] for the module's real
    parameters and buffers (meta ones are synced as they are materialised), after
    checking that every rank built the same model."""
    check_same_structure(module, dist_index, timeout)
    params = [(p, is_expert_param(p)) for p in module.parameters()]
    _broadcast(params + _module_buffers(module), dist_index, "initial_state", timeout)


def sync_module_buffers(module: nn.Module, dist_index: FSDPDistributedIndex,
                        timeout: Optional[datetime.timedelta] = None) -> None:
    """DDP's ``broadcast_buffers``: before a forward, every buffer from the first
    data-parallel rank; one equal already is left untouched ([Note: buffers saved for
    backward] in comm/broadcast_tensors.py)."""
    _broadcast(_module_buffers(module), dist_index, "module_buffers", timeout, only_changed=True)


def sync_materialized(params: list[nn.Parameter], buffers: list[tuple[nn.Module, torch.Tensor]],
                      dist_index: FSDPDistributedIndex) -> None:
    """The same for the tensors one meta-device module has just initialised."""
    tensors = [(p, is_expert_param(p)) for p in params] + [(b, _buffer_is_expert(m)) for m, b in buffers]
    _broadcast(tensors, dist_index, "initial_state", None)
