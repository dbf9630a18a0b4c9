"""This rank's pieces of our tensors as megatron-core ``ShardedTensor``s, and back.

[Note: uneven blocks as ShardedTensors] A sharded model's state dict hands each rank a
rectangular block of every tensor (``Shard(0)`` rows split as ``torch.chunk`` splits them,
so the last ranks' blocks may be shorter or empty). megatron-core 0.16 describes such
blocks directly: a ``ShardedTensor`` with ``axis_fragmentations=None`` is an uneven shard
(any offset and size), checked by DCP instead of megatron-core's regular-grid check. So
each block is written as it is, no flattening (0.16 refuses ``flattened_range``) and no
regrouping. The one exception is the fused QKV weight: megatron-core orders its rows per
key/value group, so a contiguous block of our rows is several runs of megatron-core's rows;
each run becomes one ``ShardedTensor`` (``row_pieces``). A layer's block sits at its layer
index (and expert index) of the stacked global tensor ([Note: megatron-core's stacked keys]).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..models import GPTConfig
from .torch_dist_keys import McoreTarget, qkv_source_rows

Rows = Union[slice, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LocalBlock:
    """This rank's rectangular block of one of our tensors."""

    data: torch.Tensor
    """The local tensor (the state dict's own storage: loads copy into it)."""
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    main: bool
    """This rank writes the block (False: an identical replica another rank writes)."""


def local_block(value: torch.Tensor, *, main_if_plain: bool, name: str) -> LocalBlock:
    """The block a state-dict value holds on this rank: a DTensor's local shard at its
    global offset (main on the first coordinate of every replicated mesh dimension), or a
    plain tensor whole (main where ``main_if_plain``)."""
    if not isinstance(value, DTensor):
        return LocalBlock(value.detach(), (0,) * value.dim(), tuple(value.shape), main_if_plain)
    for placement in value.placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise ValueError(f"{name}: placement {placement} has no block of the global tensor on this rank; "
                             "call full_tensor() or redistribute it to Shard/Replicate before saving")
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    coordinate = value.device_mesh.get_coordinate() or [0] * value.device_mesh.ndim
    main = all(c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))
    return LocalBlock(value.to_local().detach(), tuple(offset), tuple(value.shape), main)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One ``ShardedTensor``'s worth of a block: megatron-core's rows from ``first_row``
    on hold the block's local rows ``rows`` (all columns of the block)."""

    first_row: int
    rows: Rows


def row_pieces(target: McoreTarget, block: LocalBlock, cfg: GPTConfig) -> list[Piece]:
    """The block as runs of consecutive megatron-core rows (one run unless QKV)."""
    if block.data.dim() == 0:
        return [Piece(0, slice(None))]
    count = block.data.shape[0]
    if count == 0 or any(size == 0 for size in block.data.shape):
        return []
    start = block.offset[0]
    if not target.grouped_qkv:
        return [Piece(start, slice(0, count))]
    src = qkv_source_rows(block.global_shape[0], cfg)  # (rows,): megatron-core row j = our row src[j]
    mine = torch.nonzero((src >= start) & (src < start + count)).flatten()  # megatron-core rows held here
    breaks = torch.nonzero(mine[1:] != mine[:-1] + 1).flatten() + 1
    pieces = []
    for run in torch.tensor_split(mine, breaks):
        pieces.append(Piece(int(run[0]), src[run] - start))
    return pieces


def sharded_tensor(key: str, target: McoreTarget, block: LocalBlock, piece: Piece, data: Optional[torch.Tensor],
                   *, dtype: Optional[torch.dtype] = None):
    """The ``ShardedTensor`` for ``piece`` of ``block`` under ``key`` (``data``: the piece's
    values, or None to get an empty buffer of ``dtype`` to load into). Leading layer/expert
    axes are materialised as size-1 axes of the local tensor."""
    from megatron.core.dist_checkpointing import ShardedTensor

    local = block.data
    if local.dim() == 0:
        local_shape, offset = (), ()
    else:
        rows = piece.rows
        count = (rows.stop - rows.start) if isinstance(rows, slice) else rows.numel()
        local_shape = (count, *local.shape[1:])
        offset = (piece.first_row, *block.offset[1:])
    local_shape = (1,) * len(target.index) + tuple(local_shape)
    if data is None:
        data = torch.empty(local_shape, dtype=dtype or local.dtype, device=local.device)
    else:
        data = data.reshape(local_shape)
    return ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=local_shape,
                         global_shape=tuple(target.counts) + tuple(block.global_shape),
                         global_offset=tuple(target.index) + tuple(offset), axis_fragmentations=None,
                         replica_id=0 if block.main else 1)


def piece_values(block_data: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The block's values of ``piece`` (megatron-core's row order)."""
    if block_data.dim() == 0:
        return block_data
    return block_data[piece.rows]


def put_piece(block_data: torch.Tensor, piece: Piece, loaded: torch.Tensor) -> None:
    """Write a loaded piece back into the block, in place."""
    if block_data.dim() == 0:
        block_data.copy_(loaded.reshape(()))
        return
    block_data[piece.rows] = loaded.reshape(block_data[piece.rows].shape).to(block_data.dtype)


def plain_key_owners(keys: list[str]) -> dict[str, bool]:
    """For plain (non-DTensor) values: whether this rank is the lowest rank holding each key,
    the one that writes it (every rank holds a replica of a plain model's tensor)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: True for k in keys}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    rank = dist.get_rank()
    first = {}
    for holder, held in enumerate(everyone):
        for k in held:
            first.setdefault(k, holder)
    return {k: first[k] == rank for k in keys}
