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

Two orders are kept: the order in which units *start* their forward (the forward
walk) and the order in which they *finish* it, whose reverse is the order their
backward starts (the backward walk): with nested units a parent starts before its
children but finishes after them. Both start from the module structure; after
the first training forward every rank's observed orders are gathered and merged
into one that respects each rank's (``merge_orders``), used by every rank from
then on.

[Note: the first forward in an unknown order] Until then the walk follows module
order, which is not always the order units run in (a model whose forward calls
its submodules in another order than it registered them). A rank whose forward
reaches a unit the walk placed earlier visits the units in between as skipped,
and may run one of them afterwards: on a rank that skips that unit (layer drop)
no gather would pair with the second one. So in that first forward a skipped
visit keeps the unit's weights gathered until the forward ends, on every rank
whether or not it runs the unit later, and a unit that runs after its visit
gathers (and prefetches) nothing.

``fsdp_double_buffer``'s slots assume module order and alternate units: a held unit
would keep the slot the next one needs on the ranks that skipped it only, so there
skipped units are released at once, as later. A first step whose ranks skip
different units of a model that runs them out of module order can then leave one
rank gathering alone until the collective timeout; with the same graph everywhere
the slots refuse such a model on every rank (SlotConflictError, naming the remedy).
"""

from __future__ import annotations

import heapq
from typing import Generic, Iterable, Optional, TypeVar

import torch.distributed as dist

U = TypeVar("U")


def merge_orders(sequences: list[list[int]], count: int) -> list[int]:
    """Unit indices ``0..count-1`` in an order that keeps every sequence's own order
    (each rank's observed one), ties broken by module order; an index nobody
    observed follows its predecessor in module order. Sequences that contradict
    each other (ranks that ran units in different orders) fall back to the first
    one's ``merge_order``."""
    seen = {i for sequence in sequences for i in sequence}
    after: dict[int, set[int]] = {i: set() for i in range(count)}
    for sequence in sequences:
        for a, b in zip(sequence, sequence[1:]):
            after[a].add(b)
    for i in range(1, count):
        if i not in seen:
            after[i - 1].add(i)
    waiting = {i: 0 for i in range(count)}
    for targets in after.values():
        for b in targets:
            waiting[b] += 1
    ready = [i for i in range(count) if waiting[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for b in after[i]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, b)
    return order if len(order) == count else merge_order(sequences[0] if sequences else [], count)


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
    def __init__(self, units: Iterable[U], finish_order: Optional[list[U]] = None) -> None:
        """``finish_order``: the units in the order their forwards finish (default:
        as they start, i.e. no nesting)."""
        self.order: list[U] = list(units)
        self.finish_order: list[U] = list(finish_order) if finish_order is not None else list(self.order)
        self.final = False
        self._observed: tuple[list[U], list[U]] = ([], [])

    def observe(self, unit: U, *, finished: bool = False) -> None:
        """A unit this rank really ran (``finished``: its forward ended), during the
        first training forward."""
        seen = self._observed[1 if finished else 0]
        if not self.final and unit not in seen:
            seen.append(unit)

    def agree(self, group: Optional[dist.ProcessGroup]) -> None:
        """Adopt the merge of every rank's observed orders (collective over ``group``; once)."""
        if self.final:
            return
        self.final = True
        start_index = {unit: i for i, unit in enumerate(self.order)}
        finish_index = {unit: i for i, unit in enumerate(self.finish_order)}
        mine = ([start_index[u] for u in self._observed[0]], [finish_index[u] for u in self._observed[1]])
        observed = [mine]
        if group is not None and dist.get_world_size(group) > 1:
            observed = [None] * dist.get_world_size(group)
            dist.all_gather_object(observed, mine, group=group)
        starts = merge_orders([o[0] for o in observed], len(self.order))
        finishes = merge_orders([o[1] for o in observed], len(self.finish_order))
        self.order = [self.order[i] for i in starts]
        self.finish_order = [self.finish_order[i] for i in finishes]
        self._observed = ([], [])

    def forward_walk(self) -> UnitWalk[U]:
        return UnitWalk(self.order)

    def backward_walk(self) -> UnitWalk[U]:
        return UnitWalk(self.finish_order[::-1])

    def neighbours(self, unit: U, step: int, depth: int) -> list[U]:
        """Up to ``depth`` units after ``unit`` in the forward walk (step=1) or in the
        backward walk (step=-1): the prefetch targets."""
        walk = self.order if step > 0 else self.finish_order[::-1]
        if unit not in walk:
            return []
        position = walk.index(unit)
        return walk[position + 1 : position + 1 + depth]


def finish_order(units: list[U], contains) -> list[U]:
    """Units (in start order) in the order their forwards finish, given
    ``contains(a, b)``: unit ``b`` runs inside unit ``a``."""
    out: list[U] = []
    stack: list[U] = []
    for unit in units:
        while stack and not contains(stack[-1], unit):
            out.append(stack.pop())
        stack.append(unit)
    out.extend(reversed(stack))
    return out
