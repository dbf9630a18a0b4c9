"""``check_for_nan_in_grad`` (and ``report_nan_in_param_grad``) without stalling the GPU.

Each gradient collective records, on the device, whether this rank's local
gradient of the group held NaN/Inf (``note``); nothing is read back then. Once per
optimization step (``raise_if_nonfinite``, after the last reduction) the flags of
every rank are combined in one all-reduce per process group and read with a single
host synchronisation. Only on the error path are names gathered (more syncs, but
training stops there anyway).

The check runs after the collectives, so every rank has joined every collective
and all ranks raise together; the optimizer has not stepped, so no weight changed.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ..comm import collectives


def _nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``flat``'s device. ``aminmax`` needs no temporary of the
    gradient's size (``isfinite(flat)`` would allocate one byte per element), and NaN
    propagates through both extremes while +-Inf shows in one of them."""
    low, high = torch.aminmax(flat)
    return torch.logical_not(torch.isfinite(low) & torch.isfinite(high))


class NonFiniteGradError(FloatingPointError, ValueError):
    """NaN/Inf in a gradient, raised on every rank before the optimizer step. A
    ``FloatingPointError`` (``check_for_nan_in_grad``'s error here) and a ``ValueError``
    (what upstream's ``report_nan_in_param_grad=True`` raises), so handlers written
    for either catch it."""


class NonFiniteGradTracker:
    def __init__(self) -> None:
        self._flags: dict = {}  # ParameterGroup -> 0-dim bool tensor, OR-ed over microbatches

    def note(self, group, flat: torch.Tensor) -> None:
        bad = _nonfinite(flat)
        previous = self._flags.get(group)
        self._flags[group] = bad if previous is None else previous | bad

    def raise_if_nonfinite(self, groups: Iterable) -> None:
        """Raise ``NonFiniteGradError`` on every rank when any rank noted NaN/Inf
        since the last call. ``groups`` gives the order, identical on every rank."""
        noted = [g for g in groups if g in self._flags]
        if not noted:
            return
        flags, self._flags = self._flags, {}
        by_pg: dict = {}
        for group in noted:
            by_pg.setdefault(group.dp.shard_group, []).append(group)
        combined = []
        for pg, members in by_pg.items():  # insertion order: the same on every rank
            local = torch.stack([flags[g] for g in members]).float()
            combined.append(local)
            # Through collectives (not dist.all_reduce): its waited works are freed before
            # exit ([Note: gloo works are freed before exit]).
            collectives.control_all_reduce(local, pg, op=dist.ReduceOp.MAX, label="nan_check")
        if not bool(torch.cat(combined).any()):  # the step's one host sync
            return
        raise NonFiniteGradError(_describe(by_pg, flags))


def _describe(by_pg: dict, flags: dict) -> str:
    """Which rank's local gradient went bad (its flags), and which parameters (the
    reduced gradients: NaN/Inf on any rank spreads into the sum the owner holds)."""
    culprits: dict[int, set] = {}
    bad_names: set = set()
    for pg, members in by_pg.items():
        mine = (dist.get_rank(), [g.label for g in members if bool(flags[g])], _nonfinite_names(members))
        reports: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(reports, mine, group=pg)
        for rank, labels, names in reports:
            culprits.setdefault(rank, set()).update(labels)
            bad_names.update(names)
    found = []
    for rank in sorted(r for r, labels in culprits.items() if labels):
        names = [n for g in _groups_labelled(by_pg, culprits[rank]) for n in g.names if n in bad_names]
        found.append(f"rank {rank}: {', '.join(names) or ', '.join(sorted(culprits[rank]))}")
    return (
        f"NaN or Inf in the local gradient ({'; '.join(found)}); check the loss and the inputs of the named rank "
        "(found by check_for_nan_in_grad / report_nan_in_param_grad after the gradient collectives, before the "
        "optimizer step: no weight changed)"
    )


def _groups_labelled(by_pg: dict, labels: set) -> list:
    return [g for members in by_pg.values() for g in members if g.label in labels]


def _nonfinite_names(groups) -> list[str]:
    names = []
    for group in groups:
        for index, name in enumerate(group.names):
            piece = group.main_grads.item_in_shard(index)
            if piece.numel() and bool(_nonfinite(piece)):
                names.append(name)
    return names
