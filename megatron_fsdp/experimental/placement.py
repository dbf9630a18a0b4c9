"""Placements of a DBuffer along each mesh axis.

A DBuffer reuses DTensor's ``Replicate`` and ``Partial``; ``Flat`` is its own: a
dim-0 shard whose local part is a contiguous range of the group's flat buffer
(whole rows of each tensor, see layout.py), not torch's canonical ``chunk``.

===========  ============  ========================================
from         to            DBuffer operation
===========  ============  ========================================
``Flat``     ``Replicate``  ``allgather``
``Partial``  ``Flat``       ``reduce_scatter``
``Partial``  ``Replicate``  ``allreduce``
``Replicate`` ``Flat``      ``scatter`` (local slice, no communication)
``Replicate`` ``Partial``   relabel (AVG only, no communication)
===========  ============  ========================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Flat", "changed_mesh_axis", "validate_placements", "specialize_placements"]


class Flat(Shard):
    """A dim-0 shard stored as one rank's range of a flat, row-aligned buffer.

    ``Flat()`` labels a DBuffer axis. On a tensor's DTensor it carries ``rows``: how
    many dim-0 rows each rank of the mesh axis holds, which is the layout's split and
    not torch.chunk's. DTensor's redistribution calls the methods below, so
    ``full_tensor()``, ``redistribute`` and ``distribute_tensor`` place the rows
    exactly. [Note: Flat equality] A Flat hashes unlike a plain ``Shard(0)`` and
    unlike a Flat with other rows, so no cache keyed by placements (DTensor's
    redistribution plans) serves one for the other; it compares equal to a plain
    ``Shard(0)`` only (see ``__eq__``). Ops whose outputs come back labelled plain
    ``Shard`` are relabelled or refused in dtensor.py.
    """

    def __init__(self, rows: Optional[Sequence[int]] = None, *, nested: Optional["NestedRows"] = None) -> None:
        super().__init__(0)
        self.rows: Optional[tuple[int, ...]] = None if rows is None else tuple(int(r) for r in rows)
        """Rows held by each rank of the mesh axis (``None``: a DBuffer axis)."""
        self.nested = nested
        """Set on each of several Flat axes of a DTensor (HFSDP optimizer placements).
        The flat layout splits the last such axis most coarsely, torch's nested
        ``Shard(0)`` the first, so DTensor cannot redistribute it (the methods below
        refuse); this rank's extent is still known, for sharding propagation."""

    def __eq__(self, other: object) -> bool:
        # Sharding strategies are written with plain Shard(0), and an in-place op
        # whose input placement no strategy equals is refused: so a plain Shard(0)
        # compares equal. Flats with other rows do not.
        if type(other) is Shard:
            return other.dim == 0
        return type(other) is Flat and other.rows == self.rows and other.nested == self.nested

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((Flat, self.rows, self.nested))

    def __reduce__(self):
        # The base class pickles as a plain Shard(0), which would lose the rows.
        return (_make_flat, (self.rows, self.nested))

    def __repr__(self) -> str:
        if self.nested:
            return f"Flat(nested={self.nested})"
        return "Flat()" if self.rows is None else f"Flat(rows={list(self.rows)})"

    def __str__(self) -> str:
        return repr(self)

    # -- what DTensor's redistribution calls (torch/distributed/tensor/placement_types.py) --
    def _checked_rows(self, num_chunks: int, dim_size: Optional[int] = None) -> tuple[int, ...]:
        if self.nested and self.nested.gatherable:
            raise NotImplementedError(
                "this DTensor is sharded by rows on several mesh axes (a tensor-parallel weight: data-parallel "
                "rows of each tensor-parallel piece), which no torch placement describes; FlatDTensor.redistribute "
                "and full_tensor() gather it, other DTensor redistributions cannot. Take p.full_tensor() first"
            )
        if self.nested:
            raise NotImplementedError(
                "this DTensor is sharded by rows on several mesh axes (e.g. HFSDP optimizer placements), "
                "in the flat layout's order, which is not torch's nested Shard(0) order; DTensor cannot "
                "redistribute it. Use megatron_fsdp.experimental.full_state_dict(model) for full weights"
            )
        if self.rows is None:
            raise RuntimeError(
                "Flat() without rows labels a DBuffer axis; DTensor cannot place its rows. "
                "Use DBuffer.redistribute, or DBuffer.get_dtensor for a per-tensor DTensor"
            )
        if len(self.rows) != num_chunks or (dim_size is not None and sum(self.rows) != dim_size):
            raise ValueError(
                f"{self!r} describes {len(self.rows)} ranks and {sum(self.rows)} rows, not {num_chunks} ranks "
                f"and {dim_size} rows; a Flat placement belongs to the DTensor it was made for"
            )
        return self.rows

    def _split_tensor(self, tensor, num_chunks, *, with_padding=True, contiguous=True):
        rows = self._checked_rows(num_chunks, tensor.size(0))
        width = max(rows)
        pieces, pads = [], []
        for piece in torch.split(tensor, list(rows), dim=0):
            if with_padding:
                pads.append(width - piece.size(0))
                piece = _pad_rows(piece, width)
            pieces.append(piece.contiguous() if contiguous else piece)
        return pieces, pads

    def _select_split_tensor(self, tensor, num_chunks, index, *, with_padding=True, contiguous=True, clone=True):
        pieces, _ = self._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=False)
        piece = pieces[index]
        return piece.clone() if clone else piece.contiguous() if contiguous else piece

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        return self._select_split_tensor(local_tensor, mesh.size(mesh_dim), shard_index, with_padding=False)

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        rows = self._checked_rows(mesh.size(mesh_dim), current_logical_shape[0])
        width = max(rows)
        gathered = funcol.all_gather_tensor(_pad_rows(local_tensor, width).contiguous(), 0, (mesh, mesh_dim))
        gathered = funcol.wait_tensor(gathered)
        return torch.cat([gathered.narrow(0, k * width, n) for k, n in enumerate(rows)])

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op, mesh_dim):
        # Partial -> Flat. An all-reduce of the whole tensor, then this rank's rows: this
        # is the user-facing DTensor path (training reduces through DBuffer.reduce_scatter).
        num_chunks = mesh.size(mesh_dim)
        self._checked_rows(num_chunks, tensor.size(0))
        op = "sum" if reduce_op == "avg" else reduce_op
        reduced = funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), op, (mesh, mesh_dim)))
        if reduce_op == "avg":
            reduced = reduced / num_chunks
        return self._replicate_to_shard(reduced, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))

    def _to_new_shard_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim):
        full = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        return Shard(new_shard_dim)._replicate_to_shard(full, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):  # type: ignore[override]
        if self.nested is not None:
            # This rank's rows, as torch composes nested shards: the first Flat axis
            # in mesh order places them in the tensor, the later ones keep them.
            return self.nested.local_rows, self.nested.offset if self.nested.outermost else 0
        rows = self._checked_rows(num_chunks, curr_local_size)
        return rows[rank], sum(rows[:rank])

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, rank)


@dataclasses.dataclass(frozen=True)
class NestedRows:
    """This rank's rows of a tensor sharded on several Flat axes."""

    total: int
    """Rows of the whole tensor."""
    local_rows: int
    """Rows this rank holds."""
    offset: int
    """Index of this rank's first row in the whole tensor."""
    outermost: bool
    """Whether this is the first Flat axis in mesh order."""
    gatherable: bool = False
    """Every rank's rows are its own, disjoint from those of the other ranks along
    each nested axis, so ``FlatDTensor.redistribute`` gathers them itself (dtensor.py
    [Note: gathering nested rows]). Set on the DTensors of tensor-parallel modules
    (tensor_parallel.py). The same gather would serve HFSDP's nested placements
    elsewhere; they keep refusing, as test_experimental_dtensor pins."""


def _make_flat(rows: Optional[tuple[int, ...]], nested: Optional[NestedRows]) -> Flat:
    return Flat(rows, nested=nested)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.size(0) == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.size(0), *tensor.shape[1:]))])


def validate_placements(placements: Iterable[Placement]) -> tuple[Placement, ...]:
    """Check that ``placements`` describe a contiguous local range: only Replicate,
    Partial and Flat, with every Flat axis after every other axis."""
    placements = tuple(placements)
    seen_flat = False
    for placement in placements:
        if not isinstance(placement, (Replicate, Partial, Flat)):
            raise TypeError(
                f"DBuffer placement {placement!r} is not supported; use Replicate(), Partial('avg'|'sum') or "
                "Flat() (fully_shard turns Shard(0) into Flat())"
            )
        if isinstance(placement, Flat):
            seen_flat = True
        elif seen_flat:
            raise ValueError(
                f"placements {placements!r}: Flat placements must be a suffix (Flat axes must come last), so "
                "that each rank's part is one contiguous range of the flat buffer; put the sharded axes at the "
                "end of the mesh"
            )
    return placements


def specialize_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The user's ``Shard(0)`` becomes ``Flat()``; any other dim is refused."""
    out = []
    for placement in placements:
        if isinstance(placement, Flat):
            placement = Flat()  # rows belong to one tensor's DTensor, not to a buffer
        elif isinstance(placement, Shard):
            if placement.dim != 0:
                raise NotImplementedError(
                    f"placement {placement!r}: only Shard(0) is supported (parameters are sharded by rows)"
                )
            placement = Flat()
        out.append(placement)
    return validate_placements(out)


def changed_mesh_axis(old: Iterable[Placement], new: Iterable[Placement]) -> int | None:
    """The single mesh axis on which ``old`` and ``new`` differ (``None``: identical)."""
    changed = None
    old, new = tuple(old), tuple(new)
    if len(old) != len(new):
        raise ValueError(f"placements {old!r} and {new!r} have different lengths")
    for axis, (a, b) in enumerate(zip(old, new)):
        if a == b and type(a) is type(b):
            continue
        if changed is not None:
            raise NotImplementedError(
                f"{old!r} -> {new!r} changes axes {changed} and {axis}; redistribute one axis at a time"
            )
        changed = axis
    return changed
