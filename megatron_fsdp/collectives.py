"""Stateless collective wrappers. Each takes its group and tensors explicitly and
returns a ``Work`` handle (or ``None`` when synchronous); the pipelines own the
handles. Every call is reported to the active ``CollectiveRecorder``s, which is how
tests assert collective counts and the benchmark counts bytes moved."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function


@dataclasses.dataclass
class CollectiveRecorder:
    """Counts calls and payload bytes per collective kind.

    Payload is the unsharded size: the gathered output of an all-gather, the input
    of a reduce-scatter, the tensor of an all-reduce or broadcast.
    """

    counts: Counter = dataclasses.field(default_factory=Counter)
    bytes: Counter = dataclasses.field(default_factory=Counter)
    labels: list = dataclasses.field(default_factory=list)

    def record(self, kind: str, tensor: torch.Tensor, label: str) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.labels.append((kind, label))

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.labels.clear()


_recorders: list[CollectiveRecorder] = []

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def record_collectives(recorder: Optional[CollectiveRecorder] = None) -> Iterator[CollectiveRecorder]:
    """``with record_collectives() as rec: ...`` counts the package's collectives."""
    recorder = recorder or CollectiveRecorder()
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


def _record(kind: str, tensor: torch.Tensor, label: str) -> None:
    for recorder in _recorders:
        recorder.record(kind, tensor, label)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool, label: str = ""
) -> Optional[dist.Work]:
    """Gather equal shards into ``output`` (flat, ``group.size() * shard.numel()``)."""
    _record("all_gather", output, label)
    with record_function(f"megatron_fsdp::all_gather:{label}"):
        return _all_gather_flat(output, shard, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType,
    async_op: bool,
    label: str = "",
) -> Optional[dist.Work]:
    """Reduce ``full`` across the group; this rank's shard lands in ``output``."""
    _record("reduce_scatter", full, label)
    with record_function(f"megatron_fsdp::reduce_scatter:{label}"):
        return _reduce_scatter_flat(output, full, op=op, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool, label: str = ""
) -> Optional[dist.Work]:
    _record("all_reduce", tensor, label)
    with record_function(f"megatron_fsdp::all_reduce:{label}"):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup, *, label: str = "") -> None:
    _record("broadcast", tensor, label)
    with record_function(f"megatron_fsdp::broadcast:{label}"):
        dist.broadcast(tensor, group=group, group_src=src_group_rank)
