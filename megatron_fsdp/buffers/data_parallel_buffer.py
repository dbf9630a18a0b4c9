"""``DataParallelBuffer``: one flat tensor for one parameter group and one role
(model weights, main weights or main gradients), sharded or replicated across the
group's data-parallel ranks. It knows every item's place (``BucketLayout``) and,
when sharded, owns the temporary unsharded bucket its items are gathered into."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .allocator import StorageResizeAllocator
from ..enums import BucketStatus
from .layout import BucketLayout


class DataParallelBuffer:
    def __init__(
        self,
        layout: BucketLayout,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        rank: int,
        is_distributed: bool,
        allocator: StorageResizeAllocator,
        category: str,
        bucket: Optional[torch.Tensor] = None,
    ) -> None:
        """``bucket``: where a sharded buffer's items are gathered (a slot of a
        ``BufferPool``); by default a tensor of its own, allocated per use."""
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.group = group
        self.rank = rank
        self.is_distributed = is_distributed
        self.allocator = allocator
        numel = layout.shard_numel if is_distributed else layout.padded_numel
        # Zeroed so that padding never carries garbage into a reduction.
        self.data = torch.zeros(numel, dtype=dtype, device=device)
        allocator.accounting.add_persistent(category, numel * self.data.element_size())
        # The unsharded bucket: the persistent data itself when replicated; else a
        # tensor object that survives release/allocate so that views into it do.
        if not is_distributed:
            self._bucket = self.data
        else:
            self._bucket = bucket if bucket is not None else allocator.empty_unallocated(layout.padded_numel, dtype, device)
        self.status = BucketStatus.EMPTY if is_distributed else BucketStatus.READY_TO_USE

    # -- views ---------------------------------------------------------------
    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard (a view into ``data``)."""
        if self.is_distributed:
            return self.data
        start, end = self.layout.shard_range(self.rank)
        return self.data[start:end]

    @property
    def bucket(self) -> torch.Tensor:
        """The unsharded flat bucket (unallocated while a sharded buffer is resharded)."""
        return self._bucket

    def item_in_bucket(self, index: int) -> torch.Tensor:
        start, end = self.layout.item_range(index)
        return self._bucket[start:end]

    def global_view(self, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the unsharded bucket, read from the
        data this rank holds (the range must lie inside it)."""
        base = self.rank * self.layout.shard_numel if self.is_distributed else 0
        local = start - base
        assert 0 <= local and local + numel <= self.data.numel(), "range outside this rank's data"
        return self.data[local : local + numel]

    def item_in_shard(self, index: int) -> torch.Tensor:
        """The part of item ``index`` this rank owns, flat (may be empty)."""
        overlap = self.layout.overlap(index, self.rank)
        if overlap is None:
            return self.shard[:0]
        return self.shard[overlap.shard_start : overlap.shard_start + overlap.numel]

    # -- filling -------------------------------------------------------------
    @torch.no_grad()
    def copy_item_from(self, index: int, full_value: torch.Tensor) -> None:
        """Store a whole (unsharded) item value: all of it if replicated, else this rank's part."""
        flat = full_value.reshape(-1)
        if not self.is_distributed:
            self.item_in_bucket(index).copy_(flat)
            return
        overlap = self.layout.overlap(index, self.rank)
        if overlap is not None:
            self.item_in_shard(index).copy_(flat[overlap.item_start : overlap.item_start + overlap.numel])

    # -- temporary bucket ----------------------------------------------------
    def allocate_bucket(self) -> torch.Tensor:
        if self.is_distributed:
            self.allocator.allocate(self._bucket)
        return self._bucket

    def free_bucket(self) -> None:
        if self.is_distributed:
            self.allocator.release(self._bucket)
            self.status = BucketStatus.EMPTY

    def __repr__(self) -> str:
        kind = "sharded" if self.is_distributed else "replicated"
        return f"DataParallelBuffer({kind}, {self.dtype}, numel={self.layout.numel}, status={self.status.name})"
