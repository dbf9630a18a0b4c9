"""Row-aligned global layout of the tensors in one DBuffer. Pure index math.

A sharded parameter is exposed as a DTensor whose local part must be whole rows
(dim-0 slices), so the flat layout of megatron_fsdp.buffers.layout.BucketLayout (which
splits items anywhere) is not enough here. Each tensor starts at a multiple of its
row size (``shape[1:].numel()``) and the total is padded to a multiple of
``lcm(row sizes) * shards``; every shard boundary is then a multiple of every row
size, so it falls between rows of every tensor::

    rows of 6 and 4, lcm 12, 2 shards:  |A0 A0 A1 A1 ...|B0 B1 B2 ... pad|
                                          shard 0 (24)    shard 1 (24)

The overlap of a tensor with a rank's range reuses ``layout.ShardOverlap``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Optional

import torch

from ..buffers.layout import ShardOverlap

__all__ = ["GlobalLayout", "non_leading_numel"]


def non_leading_numel(shape: torch.Size) -> int:
    """Elements per dim-0 row."""
    if len(shape) == 0:
        raise ValueError(
            "a 0-d tensor cannot be sharded by rows; give the parameter shape (1,) "
            "or keep it out of fully_shard"
        )
    return math.prod(shape[1:])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class GlobalLayout:
    """Where each tensor starts in the global flat buffer, and its padded size."""

    tensor_shapes: tuple[torch.Size, ...]
    tensor_to_offset: tuple[int, ...]
    size: int

    @classmethod
    def build(cls, shapes: Iterable[Sequence[int]], dp_size: int) -> "GlobalLayout":
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size} must be >= 1")
        tensor_shapes = tuple(torch.Size(s) for s in shapes)
        chunk, offsets, end = 1, [], 0
        for shape in tensor_shapes:
            row = non_leading_numel(shape)
            if row == 0:
                raise ValueError(f"tensor shape {tuple(shape)} has zero-sized trailing dims; it cannot be sharded")
            chunk = math.lcm(chunk, row)
            start = _round_up(end, row)
            offsets.append(start)
            end = start + shape.numel()
        return cls(tensor_shapes, tuple(offsets), _round_up(end, chunk * dp_size))

    def __post_init__(self) -> None:
        if len(self.tensor_shapes) != len(self.tensor_to_offset):
            raise ValueError("one offset per tensor shape is required")
        previous_end = 0
        for shape, start in sorted(zip(self.tensor_shapes, self.tensor_to_offset), key=lambda x: x[1]):
            if start < previous_end or start % non_leading_numel(shape):
                raise ValueError(f"tensor of shape {tuple(shape)} at offset {start} overlaps or splits a row")
            previous_end = start + shape.numel()
        if previous_end > self.size:
            raise ValueError(f"layout size {self.size} is smaller than its tensors ({previous_end})")

    def local_range(self, axis_sizes: Sequence[int], axis_ranks: Sequence[int], flat_axes: Sequence[bool]) -> tuple[int, int]:
        """(offset, numel) of one rank's part: Flat axes split the buffer, the last
        Flat axis most coarsely (the innermost mesh axis holds neighbouring ranges)."""
        offset, numel = 0, self.size
        for size, rank, flat in reversed(tuple(zip(axis_sizes, axis_ranks, flat_axes))):
            if not flat:
                continue
            if numel % size:
                raise ValueError(f"a range of {numel} elements does not split into {size} equal parts")
            numel //= size
            offset += rank * numel
        return offset, numel

    def rows_per_rank(
        self, index: int, axis_sizes: Sequence[int], axis_ranks: Sequence[int], flat_axes: Sequence[bool], axis: int
    ) -> tuple[int, ...]:
        """Dim-0 rows of tensor ``index`` held by each rank along mesh ``axis``, the
        other axes at ``axis_ranks`` (what a per-tensor ``Flat`` placement records)."""
        row = non_leading_numel(self.tensor_shapes[index])
        rows = []
        for rank in range(axis_sizes[axis]):
            ranks = list(axis_ranks)
            ranks[axis] = rank
            part = self.overlap(index, *self.local_range(axis_sizes, ranks, flat_axes))
            rows.append(0 if part is None else part.numel // row)
        return tuple(rows)

    def overlap(self, index: int, offset: int, numel: int) -> Optional[ShardOverlap]:
        """The part of tensor ``index`` inside the global range ``[offset, offset + numel)``."""
        t_start = self.tensor_to_offset[index]
        t_end = t_start + self.tensor_shapes[index].numel()
        start, end = max(t_start, offset), min(t_end, offset + numel)
        if start >= end:
            return None
        return ShardOverlap(item_start=start - t_start, shard_start=start - offset, numel=end - start)
