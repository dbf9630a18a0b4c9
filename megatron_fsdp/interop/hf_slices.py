"""Where a state-dict value's local tensor lies in the whole tensor, and reading exactly that
box of a Hugging Face checkpoint through a ``NameMap``.

[Note: local boxes] A state-dict value is a plain tensor (the whole of it), or a DTensor
whose local tensor is a box of the global one: ``model.state_dict()`` of a model wrapped by
this package holds ``torch.chunk`` row blocks over the data-parallel mesh dimension (and
tensor-parallel pieces over ``tp``: model_state_dict.py, [Note: standard state-dict DTensors]),
which torch's ``compute_local_shape_and_global_offset`` places. Placements of other shapes
(``experimental.fully_shard``'s uneven ``Flat`` rows) are placed by the uneven-DTensor
helpers, a small ``all_gather_object`` of extents. The box is then read piece by piece:
rows of our tensor map to rows of a piece (columns of a transposed one), columns stay
columns; rows past the pieces (vocabulary padding) are zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..uneven_dtensor import gather_and_compute_chunk_metadata
from .hf_names import NameMap
from .safetensors_io import SafetensorsReader


@dataclasses.dataclass(frozen=True)
class Box:
    """The part of a tensor of ``global_shape`` one rank holds: ``offsets`` and ``sizes`` per dim."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, int]:
        return (self.offsets[0], self.offsets[0] + self.sizes[0]) if self.sizes else (0, 0)

    @property
    def columns(self) -> Optional[tuple[int, int]]:
        """The column range when the box does not span every column (``None``: all of them)."""
        if len(self.sizes) < 2 or self.sizes[1] == self.global_shape[1]:
            return None
        return self.offsets[1], self.offsets[1] + self.sizes[1]


def _standard(placements) -> bool:
    """Placements torch's own offset arithmetic handles: Replicate, Shard and the strided
    shard of a data-parallel split inside a tensor-parallel piece."""
    return all(type(p) in (Replicate, Shard, _StridedShard) for p in placements)


def local_box(value: torch.Tensor) -> Box:
    """This rank's box of a state-dict value (see [Note: local boxes]); collective for
    DTensors of non-standard placements only."""
    if not isinstance(value, DTensor):
        shape = tuple(value.shape)
        return Box(shape, (0,) * len(shape), shape)
    shape = tuple(value.shape)
    if _standard(value.placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
        return Box(shape, tuple(offsets), tuple(sizes))
    meta = gather_and_compute_chunk_metadata(value)
    return Box(shape, tuple(meta.offsets), tuple(meta.sizes))


def expected_hf_shape(piece_rows: int, transposed: bool, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a piece of ``piece_rows`` of our rows has in the checkpoint."""
    if transposed:
        if len(our_shape) != 2:
            raise ValueError(f"a transposed piece needs a 2-D tensor, ours has shape {our_shape}")
        return (our_shape[1], piece_rows)
    return (piece_rows,) + tuple(our_shape[1:])


def hf_name_in(reader: SafetensorsReader, name_map: NameMap, hf_name: str) -> Optional[str]:
    """The file's name for ``hf_name``: itself, or without the map's optional prefix; None if absent."""
    if hf_name in reader:
        return hf_name
    prefix = name_map.optional_prefix
    if prefix and hf_name.startswith(prefix) and hf_name[len(prefix):] in reader:
        return hf_name[len(prefix):]
    return None


def read_box(reader: SafetensorsReader, name_map: NameMap, name: str, box: Box,
             dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Our tensor ``name``'s ``box`` assembled from the checkpoint in ``dtype`` (only the rows
    and columns of the box are read); and how many padded (zero) rows it holds."""
    if not box.global_shape:  # a 0-d tensor
        return reader.read(hf_name_in(reader, name_map, name_map.entries[name][0].hf_name)).to(dtype), 0
    start, end = box.rows
    columns = box.columns
    parts, covered = [], 0
    for piece, first, last in name_map.spans(name, box.global_shape[0]):
        covered = last
        lo, hi = max(start, first), min(end, last)
        if lo >= hi:
            continue
        file_name = hf_name_in(reader, name_map, piece.hf_name)
        if piece.transposed:  # our rows are its columns, our columns its rows
            part = reader.read(file_name, columns, columns=(lo - first, hi - first)).t()
        else:
            part = reader.read(file_name, (lo - first, hi - first), columns=columns)
        parts.append(part.to(dtype))
    padded = max(0, end - max(start, covered))
    if padded:  # vocabulary padding: zeros
        parts.append(torch.zeros((padded,) + tuple(box.sizes[1:]), dtype=dtype))
    if not parts:  # this rank holds no rows of it
        return torch.empty(box.sizes, dtype=dtype), 0
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).contiguous(), padded
