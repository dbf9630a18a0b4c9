"""FSDP units: which modules gather, release and reduce together.

A unit is one or more modules. ``fsdp_unit_modules`` names the classes whose
instances become units; ``enable_fine_grained_param_gather_hook`` splits them into
every module that owns parameters; ``suggested_communication_unit_size`` merges
consecutive small units into one *communication unit*: one bucket per dtype, so
one all-gather and one reduce-scatter where there were several, gathered and
released together (fewer, larger collectives for more temporary memory).

``no_shard`` never gathers: its units only decide how gradients are bucketed for
the all-reduce. Unless told otherwise they are merged up to Megatron DDP's bucket
size, which is what a DDP user gets (about two all-reduces for a small model
instead of one per layer).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch.nn as nn

NO_SHARD_UNIT_SIZE = 40_000_000
"""Elements per communication unit under no_shard when none is suggested: the
default gradient bucket of Megatron-core's DistributedDataParallel."""


@dataclasses.dataclass(frozen=True)
class UnitSpec:
    name: str
    modules: tuple[nn.Module, ...]


def plan_merge(numels: Sequence[int], limit: Optional[int]) -> list[list[int]]:
    """Pack consecutive items into runs of at most ``limit`` elements in total.

    An item larger than ``limit`` stays alone; ``limit=None`` packs nothing. Order is
    kept, so merged units are neighbours in the model (and in the forward)."""
    runs: list[list[int]] = []
    total = 0
    for index, numel in enumerate(numels):
        if runs and limit is not None and total + numel <= limit:
            runs[-1].append(index)
            total += numel
        else:
            runs.append([index])
            total = numel
    return runs


def split_into_parameter_owners(units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Fine-grained gathering: every module that owns parameters directly inside a
    unit becomes a unit of its own, so weights are gathered per module."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for unit_name, unit in units:
        for name, m in unit.named_modules():
            if id(m) not in seen and any(True for _ in m.parameters(recurse=False)):
                seen.add(id(m))
                out.append((f"{unit_name}.{name}" if name else unit_name, m))
    return out


def owned_numels(units: list[tuple[str, nn.Module]]) -> list[int]:
    """Elements each unit owns: its parameters minus those of units nested in it."""
    unit_ids = {id(m) for _, m in units}
    numels = []
    for _, unit in units:
        nested = {id(p) for m in unit.modules() if m is not unit and id(m) in unit_ids for p in m.parameters()}
        numels.append(sum(p.numel() for p in unit.parameters() if id(p) not in nested))
    return numels


def merge_units(units: list[tuple[str, nn.Module]], limit: Optional[int]) -> list[UnitSpec]:
    """Communication units of at most ``limit`` elements (one per unit when ``None``).
    Nested units are never merged with anything: their parents gather them apart."""
    nested = _nested_or_parent([(m,) for _, m in units])
    specs: list[UnitSpec] = []
    pending: list[tuple[str, nn.Module]] = []

    def flush() -> None:
        for run in plan_merge(owned_numels(pending), limit):
            members = [pending[i] for i in run]
            name = members[0][0] if len(members) == 1 else f"{members[0][0]}..{members[-1][0]}"
            specs.append(UnitSpec(name, tuple(m for _, m in members)))
        pending.clear()

    for index, unit in enumerate(units):
        if index in nested:
            flush()
            specs.append(UnitSpec(unit[0], (unit[1],)))
        else:
            pending.append(unit)
    flush()
    return specs


def _nested_or_parent(units: Sequence[Sequence[nn.Module]]) -> set[int]:
    """Indices of units (each one or more modules) that contain, or sit inside,
    another unit."""
    index_of = {id(m): i for i, members in enumerate(units) for m in members}
    marked: set[int] = set()
    for i, members in enumerate(units):
        for member in members:
            for m in member.modules():
                j = index_of.get(id(m))
                if j is not None and j != i:
                    marked.update((i, j))
    return marked


def slot_plan(specs: list[UnitSpec], slots: int) -> dict[int, int]:
    """``fsdp_double_buffer``: unit index -> weight slot. Units alternate between
    ``max(2, slots)`` slots in module order, so the unit computing and the ones
    prefetched after it never share one. Nested units (and their parents) are live
    at the same time as each other: they keep buckets of their own."""
    slots = max(2, slots)
    nested = _nested_or_parent([spec.modules for spec in specs])
    flat = [i for i in range(len(specs)) if i not in nested]
    return {unit: position % slots for position, unit in enumerate(flat)}
