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
    shard_divisor: int = 1
    """Each shard's size is a multiple of this, so that a shard splits evenly again
    (HFSDP splits the dp-shard shard across the outer group)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if self.shard_divisor < 1:
            raise ValueError(f"shard_divisor={self.shard_divisor} must be >= 1")
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
        unit = self.world_size * self.shard_divisor
        return -(-self.numel // unit) * self.shard_divisor if self.numel else 0

    def split(self, parts: int) -> "BucketLayout":
        """The same items sharded ``parts`` times finer: rank ``r * parts + p`` owns
        piece ``p`` of this layout's shard ``r``."""
        if self.shard_divisor % parts:
            raise ValueError(f"shard_divisor={self.shard_divisor} does not split into {parts} parts")
        return BucketLayout(self.item_numels, self.world_size * parts, self.shard_divisor // parts)

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


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular block of an N-d tensor that is contiguous in its flat order."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int
    """Where the box starts inside the flat range it was cut from."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Split the row-major flat range ``[start, stop)`` of a tensor of ``shape``
    into rectangular boxes, in flat order.

    Checkpoint formats address shards by global offsets and sizes (rectangles),
    while our shards are flat ranges that may begin or end mid-row. A flat range
    is at most: a partial leading slice, a block of whole slices, a partial
    trailing slice — recursively, so at most ``2 * ndim - 1`` boxes.
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= _prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape}")
    boxes: list[Box] = []
    _split(shape, start, stop, (), 0, boxes)
    return boxes


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _split(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], base: int, out: list[Box]) -> None:
    """Boxes of ``[start, stop)`` inside the slice ``prefix`` (whose remaining dims are
    ``shape``); a box's size along every prefix dim is 1."""
    if start >= stop:
        return
    ones = (1,) * len(prefix)
    if not shape:  # a single element
        out.append(Box(prefix, ones, base))
        return
    inner = _prod(shape[1:])
    rest = len(shape) - 1
    first = start // inner
    if first == (stop - 1) // inner:  # inside one slice along this dim
        _split(shape[1:], start - first * inner, stop - first * inner, prefix + (first,), base, out)
        return
    whole_from = -(-start // inner)  # first slice that starts inside the range
    whole_to = stop // inner  # one past the last slice that ends inside the range
    if start % inner:
        _split(shape[1:], start % inner, inner, prefix + (first,), base, out)
    if whole_to > whole_from:
        offsets = prefix + (whole_from,) + (0,) * rest
        sizes = ones + (whole_to - whole_from,) + shape[1:]
        out.append(Box(offsets, sizes, base + whole_from * inner - start))
    if stop % inner:
        _split(shape[1:], 0, stop % inner, prefix + (whole_to,), base + whole_to * inner - start, out)
