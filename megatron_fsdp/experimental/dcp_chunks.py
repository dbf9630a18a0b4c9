"""DCP chunk metadata for a flat shard: where a rank's slice of a parameter's flat
order lies in the global tensor, so that a checkpoint of live flat shards
reloads at another world size or placement (checkpoint.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..buffers.layout import Box, flat_range_boxes


def _piece_boxes(
    global_shape: torch.Size, flat_start: int, numel: int, piece_shape: Optional[torch.Size],
    piece_offsets: Optional[tuple[int, ...]],
) -> list[Box]:
    """Boxes of a flat range of the piece ``piece_shape`` at ``piece_offsets`` inside
    the global tensor (a tensor-parallel rank's piece; default: the whole tensor)."""
    if piece_shape is None:
        return flat_range_boxes(tuple(global_shape), flat_start, flat_start + numel)
    boxes = flat_range_boxes(tuple(piece_shape), flat_start, flat_start + numel)
    return [Box(tuple(o + p for o, p in zip(box.offsets, piece_offsets)), box.sizes, box.flat_start)
            for box in boxes]


def attach_dcp_chunks(
    local: torch.Tensor, global_shape: torch.Size, flat_start: int, *,
    piece_shape: Optional[torch.Size] = None, piece_offsets: Optional[tuple[int, ...]] = None,
) -> None:
    """Teach DCP where the flat ``local`` slice (starting at ``flat_start`` in the
    parameter's flat order, or in the flat order of its tensor-parallel piece of
    ``piece_shape`` at ``piece_offsets``) lies inside the global tensor.

    ``checkpoint.py`` checkpoints live flat shards this way. The main engine's state
    dicts hold standard DTensors instead, because these closures on the tensor make
    ``torch.save`` fail."""
    boxes = _piece_boxes(global_shape, flat_start, local.numel(), piece_shape, piece_offsets)
    by_offsets = {box.offsets: box for box in boxes}
    size = torch.Size(global_shape)

    def chunk(box) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))

    def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk(box), properties=properties, size=size),
            )
            for box in boxes
        ]

    def create_chunk_list() -> list[ChunkStorageMetadata]:
        return [chunk(box) for box in boxes]

    def get_tensor_shard(index: MetadataIndex) -> torch.Tensor:
        box = by_offsets[tuple(index.offset)]
        return local[box.flat_start : box.flat_start + box.numel].view(box.sizes)

    local.__create_write_items__ = create_write_items
    local.__create_chunk_list__ = create_chunk_list
    local.__get_tensor_shard__ = get_tensor_shard


def checkpointable(
    value: torch.Tensor, like: torch.Tensor, flat_start: int, *,
    piece_shape: Optional[torch.Size] = None, piece_offsets: Optional[tuple[int, ...]] = None,
) -> torch.Tensor:
    """A detached DTensor sharing ``value``'s storage, with DCP chunk metadata
    (see ``attach_dcp_chunks``)."""
    if not isinstance(value, DTensor):
        return value.detach()
    fresh = value.detach()
    attach_dcp_chunks(fresh._local_tensor, like.shape, flat_start, piece_shape=piece_shape,
                      piece_offsets=piece_offsets)
    return fresh
