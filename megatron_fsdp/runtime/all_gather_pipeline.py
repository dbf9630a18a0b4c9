"""``AllGatherPipeline``: makes parameter groups' model weights whole before compute.

Two cases share one mechanism (a group's model-weight buffer has ``status`` EMPTY
when it needs a gather):

* ZeRO-3: the buffer holds a shard; gathering fills the temporary unsharded bucket,
  and ``reshard`` releases it again.
* ZeRO-1/2: the buffer is replicated, but after an optimizer step only this rank's
  shard is fresh; gathering refreshes the rest in place (``start_param_sync``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..comm import collectives
from ..enums import BucketStatus
from ..buffers.param_and_grad_buffer import ParameterGroup


class AllGatherPipeline:
    def __init__(self) -> None:
        self.timeout = None
        """The owning model's collective timeout (collectives: [Note: collective timeouts])."""
        # In-flight gathers: the handle plus the source tensor, which must outlive it.
        self._pending: dict[ParameterGroup, tuple[Optional[collectives.Handle], torch.Tensor]] = {}

    def unshard(self, groups: Iterable[ParameterGroup], *, async_op: bool) -> None:
        """Launch gathers for every group that needs one; already gathering or
        gathered groups are left alone."""
        for g in groups:
            buf = g.model_weights
            if buf.status is not BucketStatus.EMPTY:
                continue
            bucket = buf.allocate_bucket()
            # A replicated buffer gathers into itself, from its own shard.
            source = buf.data if buf.is_distributed else buf.shard
            work = collectives.all_gather(
                bucket, source, g.dp.shard_group, async_op=async_op, label=g.label, timeout=self.timeout
            )
            if async_op:
                buf.status = BucketStatus.COMMUNICATING
                self._pending[g] = (work, source)
            else:
                buf.status = BucketStatus.READY_TO_USE

    def wait(self, groups: Iterable[ParameterGroup]) -> None:
        for g in groups:
            entry = self._pending.pop(g, None)
            if entry is not None:
                work, _source = entry
                if work is not None:
                    work.wait()
                g.model_weights.status = BucketStatus.READY_TO_USE

    def unshard_and_wait(self, groups: list[ParameterGroup]) -> None:
        self.unshard(groups, async_op=False)
        self.wait(groups)

    def reshard(self, groups: Iterable[ParameterGroup]) -> None:
        """Release the unsharded bucket of sharded groups (no-op for replicated ones)."""
        for g in groups:
            if not g.model_weights.is_distributed:
                continue
            self.wait([g])
            g.model_weights.free_bucket()

    def mark_stale(self, groups: Iterable[ParameterGroup]) -> None:
        """Replicated buffers whose other ranks' shards changed (after a ZeRO-1/2 step)."""
        for g in groups:
            if not g.model_weights.is_distributed and g.model_weights.layout.world_size > 1:
                self.wait([g])
                g.model_weights.status = BucketStatus.EMPTY

    @torch.no_grad()
    def gather_outer(self, groups: Iterable[ParameterGroup]) -> None:
        """HFSDP after a step: rebuild each model-weight shard from the outer group's
        main-weight pieces (cast to the compute dtype on the way)."""
        for g in groups:
            piece = g.main_weights.data.to(g.model_weights.dtype)  # a copy: input must not alias output
            collectives.all_gather(
                g.model_weights.data, piece, g.dp.outer_group, async_op=False, label=f"outer:{g.label}",
                timeout=self.timeout,
            )

    def wait_all(self) -> None:
        self.wait(list(self._pending))
