"""Pure index math for flat, padded, sharded buffers. No process group, no tensors.

A bucket lays its items (parameters) end to end, then pads the total so that it
divides evenly by the group size. Rank ``r`` owns the contiguous range
``[r * shard_size, (r + 1) * shard_size)``. An item can therefore be split across
ranks unevenly, or be absent from a rank altogether::

    items:   |----- a -----|--- b ---|-- c --|pad|
    ranks:   |   r0    |   r1    |   r2    |  r3   |
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ShardOverlap:
    """The part of one item that falls inside one rank's shard."""

    item_start: int
    """Offset of the overlap inside the item (flattened)."""
    shard_start: int
    """Offset of the overlap inside the rank's shard."""
    numel: int


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each item of a flat bucket lives, and which part each rank owns."""

    item_numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if any(n < 0 for n in self.item_numels):
            raise ValueError(f"item sizes must be non-negative, got {self.item_numels}")

    @functools.cached_property
    def item_offsets(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.item_numels, initial=0))[:-1]

    @property
    def numel(self) -> int:
        """Elements holding data (no padding)."""
        return sum(self.item_numels)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size) if self.numel else 0

    def item_range(self, index: int) -> tuple[int, int]:
        start = self.item_offsets[index]
        return start, start + self.item_numels[index]

    def shard_range(self, rank: int) -> tuple[int, int]:
        self._check_rank(rank)
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def overlap(self, index: int, rank: int) -> Optional[ShardOverlap]:
        """The slice of item ``index`` owned by ``rank``; ``None`` when it owns none of it."""
        item_start, item_end = self.item_range(index)
        shard_start, shard_end = self.shard_range(rank)
        start, end = max(item_start, shard_start), min(item_end, shard_end)
        if start >= end:
            return None
        return ShardOverlap(item_start=start - item_start, shard_start=start - shard_start, numel=end - start)

    def owners(self, index: int) -> list[int]:
        """Ranks that own part of item ``index``."""
        return [r for r in range(self.world_size) if self.overlap(index, r) is not None]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the group of size {self.world_size}")
