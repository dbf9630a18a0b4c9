"""``UnitSchedule``: the one order in which every rank visits the FSDP units.

[Note: one unit sequence on every rank] Under ZeRO-3 each unit's weights are
all-gathered when its forward and its backward start, and the gradient
reductions interleave with those gathers on the same process group. If ranks ran
different graphs (layer drop, mixture-of-depths, a branch taken on one rank only),
their collectives would pair up wrongly: silently summed or gathered into the wrong
unit, or a crash when sizes differ. So every rank walks the units in one agreed
order, forward and then in reverse for backward: a unit this rank skips is still
*visited* when the walk passes it (gathered, prefetching as a real visit would,
and released), and a unit's gradients are reduced when the walk moves past it,
never in between. Whatever each rank's graph did, the sequence of collectives is
a function of the agreed order alone.

The order starts as module order; after the first training forward, rank 0's
observed order (units it did not run inserted after their module-order
predecessor) is broadcast and used by every rank from then on.
"""

from __future__ import annotations

from typing import Generic, Iterable, Optional, TypeVar

import torch.distributed as dist

U = TypeVar("U")


def merge_order(observed: list[int], count: int) -> list[int]:
    """Unit indices ``0..count-1`` in ``observed`` order; each index not observed
    goes right after the last placed index below it (module order where unknown)."""
    order = list(observed)
    for missing in (i for i in range(count) if i not in set(observed)):
        before = [pos for pos, i in enumerate(order) if i < missing]
        order.insert(before[-1] + 1 if before else 0, missing)
    return order


class UnitWalk(Generic[U]):
    """One pass (a forward or a backward) along a fixed order of units."""

    def __init__(self, order: list[U]) -> None:
        self.order = order
        self._position = {unit: i for i, unit in enumerate(order)}
        self.cursor = 0
        self.visited: set = set()

    def catch_up(self, unit: U) -> list[U]:
        """Units before ``unit`` in the order that this pass has not visited (to
        visit now, in order); marks them and ``unit`` visited. A unit outside the
        order, or visited again, needs no catching up."""
        position = self._position.get(unit)
        if position is None or unit in self.visited:
            return []
        skipped = [u for u in self.order[self.cursor : position] if u not in self.visited]
        self.visited.update(skipped)
        self.visited.add(unit)
        self.cursor = max(self.cursor, position + 1)
        return skipped

    def remaining(self) -> list[U]:
        """Units this pass never visited, in order (the end of the pass visits them)."""
        rest = [u for u in self.order if u not in self.visited]
        self.visited.update(rest)
        self.cursor = len(self.order)
        return rest


class UnitSchedule(Generic[U]):
    def __init__(self, units: Iterable[U]) -> None:
        self.order: list[U] = list(units)
        self.final = False
        self._observed: list[U] = []

    def observe(self, unit: U) -> None:
        """A unit this rank really ran, during the first training forward."""
        if not self.final and unit not in self._observed:
            self._observed.append(unit)

    def agree(self, group: Optional[dist.ProcessGroup]) -> None:
        """Adopt rank 0's observed order (collective over ``group``; once)."""
        if self.final:
            return
        self.final = True
        index = {unit: i for i, unit in enumerate(self.order)}
        message = [[index[u] for u in self._observed]]
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(message, group=group, group_src=0)
        self.order = [self.order[i] for i in merge_order(message[0], len(self.order))]
        self._observed = []

    def forward_walk(self) -> UnitWalk[U]:
        return UnitWalk(self.order)

    def backward_walk(self) -> UnitWalk[U]:
        return UnitWalk(self.order[::-1])

    def neighbours(self, unit: U, step: int, depth: int) -> list[U]:
        """Up to ``depth`` units after (step=1) or before (step=-1) ``unit``: the prefetch targets."""
        if unit not in self.order:
            return []
        position = self.order.index(unit)
        out = []
        for distance in range(1, depth + 1):
            target = position + step * distance
            if not 0 <= target < len(self.order):
                break
            out.append(self.order[target])
        return out
