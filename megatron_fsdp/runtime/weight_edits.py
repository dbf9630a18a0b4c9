"""In-place edits of ``model.parameters()`` between steps (weight clipping, an EMA
copied back, a re-initialisation): how they reach the compute weights.

The distributed parameters the user edits are views of the main weights (or of this
rank's shard of replicated model weights), not of what the forward computes with. So
after each step the wrapper takes a snapshot of what it installed, and the first
forward after it (or a state-dict read: ``MegatronFSDP.settle_weights_for_reading``)
brings in whatever changed. Compute weights that are this rank's own cast of its main
weights are simply cast again; the others are compared bit for bit with the snapshot,
with one host read of the flags per step, and ZeRO-1/2 agree over the group on which
groups changed (a clamp may change nothing on one rank's shard) before re-gathering them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..comm import collectives
from ..enums import BucketStatus, ShardingStrategy

if TYPE_CHECKING:
    from .all_gather_pipeline import AllGatherPipeline
    from ..comm.distributed_index import FSDPDistributedIndex
    from ..buffers.param_and_grad_buffer import ParamAndGradBuffer


class EditKind(enum.Enum):
    """How in-place edits of a group's distributed parameters reach its compute weights."""

    MAIN = enum.auto()
    """The compute weights are a local cast of separate main weights."""
    SHARD = enum.auto()
    """The user's shard of replicated weights (ZeRO-1/2) must reach the other ranks."""
    PIECE = enum.auto()
    """HFSDP: the model-weight shard is gathered from the outer group's main-weight pieces."""


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """0-dim: some element of ``a`` and ``b`` (same dtype) differs bit for bit. A value
    compare would call a NaN weight edited at every step (NaN != NaN) and re-gather it."""
    width = _SAME_WIDTH_INT[a.element_size()]
    return (a.view(width) != b.view(width)).any()


def edit_kind(group) -> Optional[EditKind]:
    """How in-place edits of the group's distributed parameters are seen (``None``:
    the compute weights are what the user edits)."""
    if group.hfsdp and group.strategy.shards_optimizer:
        return EditKind.PIECE
    if group.main_weights is not None:
        return EditKind.MAIN
    if group.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS) and group.layout.world_size > 1:
        return EditKind.SHARD
    return None


class WeightEdits:
    """One model's edit detection: ``snapshot()`` after the weights are installed,
    ``refresh()`` before they are next used."""

    def __init__(self, buffer: "ParamAndGradBuffer", all_gather: "AllGatherPipeline",
                 dist_index: "FSDPDistributedIndex", grad_reduce: Any) -> None:
        self.buffer = buffer
        self.all_gather = all_gather
        self.dist_index = dist_index
        self.grad_reduce = grad_reduce
        """Its ``timeout`` bounds the flag all-reduces (read at use: it is set after construction)."""
        self.armed = False
        """Weights were installed since the last refresh: edits may be waiting."""
        self._shard_snapshots: dict = {}

    @torch.no_grad()
    def snapshot(self) -> None:
        """After the weights were installed: what the next refresh compares against."""
        self.armed = True
        for group in self.buffer.groups:
            if edit_kind(group) is EditKind.SHARD:
                snapshot = self._shard_snapshots.get(group)
                if snapshot is None:
                    self._shard_snapshots[group] = group.model_weights.shard.clone()
                else:
                    snapshot.copy_(group.model_weights.shard)

    def _edited(self, group, kind: EditKind) -> torch.Tensor:
        """0-dim: the group's weights changed since installed (on the device: one
        host sync for all groups, not one per group)."""
        if kind is EditKind.PIECE:
            model, main = group.model_weights, group.main_weights
            numel = main.data.numel()
            mine = model.data[group.dp.outer_rank * numel : (group.dp.outer_rank + 1) * numel]
            return bits_differ(mine, main.data.to(mine.dtype))
        if kind is EditKind.MAIN:
            mine, source = group.cast_pair()
            return bits_differ(mine, source.to(mine.dtype))
        return bits_differ(group.model_weights.shard, self._shard_snapshots[group])

    @torch.no_grad()
    def refresh(self, *, keep_armed: bool = False) -> None:
        """Bring edits made since the last snapshot into the compute weights (module
        docstring). ``keep_armed``: a read between steps; the next forward checks
        again, as more edits may follow the read. Collective."""
        if not self.armed:
            return
        self.armed = keep_armed
        kinds = {g: kind for g in self.buffer.groups if (kind := edit_kind(g)) is not None}
        recast = [g for g, kind in kinds.items() if kind is EditKind.MAIN
                  and g.strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM_GRADS_PARAMS)]
        if recast:
            # Compute weights that are this rank's own cast of its main weights (no
            # gather follows): casting again equals "compare, copy where edited", costs
            # less than the compare, and needs no host read of a flag.
            self.all_gather.wait(recast)
            for group in recast:
                group.recast()
        groups = [g for g in kinds if g not in recast]
        if not groups:
            return
        flags = torch.stack([self._edited(g, kinds[g]) for g in groups]).float()
        # Decisions that lead to collectives must be the same on every rank.
        dp = self.dist_index.groups_for(False)
        timeout = self.grad_reduce.timeout
        if any(g.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS) and g.layout.world_size > 1
               for g in groups):
            collectives.control_all_reduce(flags, dp.shard_group, op=dist.ReduceOp.MAX, label="weight_edits",
                                           timeout=timeout)
        if any(kinds[g] is EditKind.PIECE for g in groups):
            for pg in (dp.shard_group, dp.outer_group):
                if pg is not None and dist.get_world_size(pg) > 1:
                    collectives.control_all_reduce(flags, pg, op=dist.ReduceOp.MAX, label="weight_edits",
                                                   timeout=timeout)
        edited = [g for g, flag in zip(groups, flags.tolist()) if flag]
        if not edited:
            return
        self.all_gather.wait(edited)
        pieces = [g for g in edited if kinds[g] is EditKind.PIECE]
        if pieces:
            self.all_gather.gather_outer(pieces)
        for group in edited:
            if kinds[group] is EditKind.MAIN:
                group.recast()
        stale = [g for g in edited if g.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS)]
        self.all_gather.mark_stale(stale)
        self.all_gather.unshard([g for g in stale if g.model_weights.status is BucketStatus.EMPTY], async_op=False)
        self.snapshot()
        self.armed = keep_armed


__all__ = ["EditKind", "WeightEdits", "bits_differ", "edit_kind"]
