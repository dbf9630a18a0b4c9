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

from collections.abc import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Flat", "changed_mesh_axis", "validate_placements", "specialize_placements"]


class Flat(Shard):
    """A dim-0 shard stored as one rank's range of a flat, row-aligned buffer."""

    def __init__(self) -> None:
        super().__init__(0)

    def __repr__(self) -> str:
        return "Flat()"


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
                f"placements {placements!r}: Flat axes must come last, so that each rank's part is one "
                "contiguous range of the flat buffer; put the sharded axes at the end of the mesh"
            )
    return placements


def specialize_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The user's ``Shard(0)`` becomes ``Flat()``; any other dim is refused."""
    out = []
    for placement in placements:
        if isinstance(placement, Shard) and not isinstance(placement, Flat):
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
