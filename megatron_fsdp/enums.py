"""Enumerations shared by the whole package.

Strategies are parsed once at the boundary (``ShardingStrategy.parse``) and
compared as enums everywhere else. The state machines (``GroupReduceState``,
``MainGradState``, ``BackwardMode``) list their legal transitions next to their
members, and ``check_transition`` is the one place that enforces them.
"""

from __future__ import annotations

import enum


class ShardingStrategy(enum.IntEnum):
    """Which training state is sharded across the data-parallel shard group (ZeRO 0-3)."""

    NO_SHARD = 0
    """Nothing is sharded; gradients are all-reduced (DDP)."""
    OPTIM = 1
    """Optimizer state and main weights are sharded (ZeRO-1)."""
    OPTIM_GRADS = 2
    """Also the main gradients (ZeRO-2)."""
    OPTIM_GRADS_PARAMS = 3
    """Also the model weights, gathered per unit for compute (ZeRO-3)."""

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def shards_optimizer(self) -> bool:
        return self >= ShardingStrategy.OPTIM

    @property
    def shards_grads(self) -> bool:
        return self >= ShardingStrategy.OPTIM_GRADS

    @property
    def shards_params(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS

    @classmethod
    def parse(
        cls,
        value: "ShardingStrategy | int | str",
        *,
        arg_name: str = "zero_dp_strategy",
        allowed: tuple["ShardingStrategy", ...] | None = None,
    ) -> "ShardingStrategy":
        """Accept an enum member, ``0..3`` or a name such as ``"optim_grads"``."""
        allowed = allowed or tuple(cls)
        strategy = None
        if isinstance(value, cls):
            strategy = value
        elif isinstance(value, int) and not isinstance(value, bool):
            strategy = cls._value2member_map_.get(value)
        elif isinstance(value, str):
            text = value.strip().lower()
            strategy = cls.__members__.get(text.upper())
            if strategy is None and text.isdigit():
                strategy = cls._value2member_map_.get(int(text))
        if strategy is None or strategy not in allowed:
            valid = ", ".join(f"{s.value}/{s.label!r}" for s in allowed)
            raise ValueError(f"{arg_name}={value!r} is not a valid sharding strategy; use one of {valid}")
        return strategy


class BucketStatus(enum.Enum):
    """Lifecycle of a temporary (unsharded) bucket; lives on the buffer that owns it."""

    EMPTY = enum.auto()
    """No unsharded data: the storage is released or stale."""
    COMMUNICATING = enum.auto()
    """A collective writing into the bucket is in flight; wait before reading."""
    READY_TO_USE = enum.auto()
    """Holds valid unsharded data."""


class TrainingState(enum.Enum):
    """Where an FSDP unit is in the step. Activation recomputation re-runs a unit's
    forward inside its backward; while the unit is ``in_backward`` (PRE_BACKWARD or
    POST_BACKWARD) the forward hooks leave its (already gathered) weights alone."""

    IDLE = enum.auto()
    """Between steps, or after forward and before backward reached the unit."""
    FORWARD = enum.auto()
    """Inside the unit's forward."""
    PRE_BACKWARD = enum.auto()
    """Backward reached the unit's outputs; weights are gathered for its backward."""
    POST_BACKWARD = enum.auto()
    """The backward walk has passed the unit: all its gradients were produced and handed
    to the reduce pipeline, and its weights released (unless a graph still reads them).
    Set by ``HookRuntime._request_passed_units``; upstream Megatron-FSDP has the same
    member, and code written against upstream compares unit states with it."""

    @property
    def in_backward(self) -> bool:
        """The unit's backward has begun in the current backward pass."""
        return self in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


class StateTransitionError(RuntimeError):
    """An internal state machine was asked for a transition it does not allow: a bug in
    megatron_fsdp, not in the caller's code."""


def check_transition(old: enum.Enum, new: enum.Enum, legal: dict, *, owner: str) -> enum.Enum:
    """Return ``new`` if ``old -> new`` is in ``legal`` (old -> allowed successors);
    raise ``StateTransitionError`` naming ``owner`` and both states otherwise. A move to
    the current state is a transition like any other: allowed only where listed."""
    if new not in legal[old]:
        allowed = ", ".join(s.name for s in legal[old]) or "none"
        raise StateTransitionError(
            f"megatron_fsdp internal error: {owner}: {type(old).__name__} {old.name} -> {new.name} "
            f"is not a legal transition (from {old.name}: {allowed}); please report this with "
            "the model, the strategy and the training loop"
        )
    return new


class GroupReduceState(enum.Enum):
    """Where one parameter group's gradient reduction is in the current backward pass
    (grad_reduce_pipeline.py [Note: the reduction lifecycle]). Every rank walks the
    same states in the same order: they decide which collectives it issues."""

    IDLE = enum.auto()
    """Not asked for in this pass: gradients may still arrive."""
    REQUESTED = enum.auto()
    """May be reduced in this pass (complete, the walk passed its unit, or the pass
    ended); waits until every group before it in the fixed order was launched."""
    LAUNCHED = enum.auto()
    """Its reduction was issued; the end of the backward pass returns it to IDLE. A
    launch between passes (``start_all`` after a pass's end) stays LAUNCHED until the
    end of the next pass, which therefore does not reduce the group itself."""

    def check_transition(self, new: "GroupReduceState", *, owner: str) -> "GroupReduceState":
        return check_transition(self, new, _GROUP_REDUCE_NEXT, owner=owner)


_GROUP_REDUCE_NEXT = {
    GroupReduceState.IDLE: (GroupReduceState.REQUESTED, GroupReduceState.LAUNCHED),  # start_all launches unasked
    GroupReduceState.REQUESTED: (GroupReduceState.LAUNCHED, GroupReduceState.IDLE),  # not taking part: pass ends
    GroupReduceState.LAUNCHED: (GroupReduceState.IDLE,),
}


class MainGradState(enum.Enum):
    """What one parameter group's main-grad buffer holds, across backward passes
    (grad_reduce_pipeline.py [Note: reducing twice without zeroing])."""

    ACCUMULATING = enum.auto()
    """Gradients may be added on top as they are: ZeRO-0/1 this rank's unreduced sum,
    ZeRO-2/3 the sum of reduced shards (or zero after zeroing)."""
    REDUCED = enum.auto()
    """ZeRO-0/1 only: the shard-group reduction of the gradients; rebased before more
    gradients are accumulated on top."""
    OUTER_REDUCED = enum.auto()
    """HSDP/HFSDP: also reduced across the outer group (ZeRO-0/1 after REDUCED); rebased
    before the next reduction."""

    def check_transition(self, new: "MainGradState", *, owner: str) -> "MainGradState":
        return check_transition(self, new, _MAIN_GRAD_NEXT, owner=owner)


_MAIN_GRAD_NEXT = {
    MainGradState.ACCUMULATING: (MainGradState.REDUCED, MainGradState.OUTER_REDUCED),  # outer directly: ZeRO-2/3
    MainGradState.REDUCED: (MainGradState.OUTER_REDUCED, MainGradState.ACCUMULATING),
    MainGradState.OUTER_REDUCED: (MainGradState.ACCUMULATING,),
}


class BackwardMode(enum.Enum):
    """How the hook runtime treats the current backward pass, decided when it begins
    (hooks.py [Note: several forwards, one backward], [Note: higher-order gradients]).
    Every rank runs the same forwards and backwards, so every rank takes the same mode."""

    IDLE = enum.auto()
    """No backward pass is running; the last one (if any) built no graph."""
    GRAPH_RETAINED = enum.auto()
    """No backward pass is running; the last one had ``create_graph=True``, and the graph
    it built reads the gathered weights: they stay gathered for the next backward."""
    OVERLAPPED = enum.auto()
    """A backward whose walk releases each unit, and (ZeRO-3) starts its reductions, as
    it passes: the default."""
    SEVERAL_FORWARDS = enum.auto()
    """ZeRO-3: a backward serving several forwards of some unit: units are released
    when their gradients are complete, and every group is reduced at the end."""
    CREATE_GRAPH = enum.auto()
    """ZeRO-3: a backward with ``create_graph=True``: every unit stays gathered (the
    graph it builds reads them), reductions at the end."""
    AFTER_CREATE_GRAPH = enum.auto()
    """ZeRO-3: the backward after a CREATE_GRAPH one: as SEVERAL_FORWARDS, and the weights
    stay gathered until its end."""

    @property
    def in_backward(self) -> bool:
        return self not in (BackwardMode.IDLE, BackwardMode.GRAPH_RETAINED)

    @property
    def reduces_at_end(self) -> bool:
        """Units are not released or reduced as the walk passes them, but at the end."""
        return self in (BackwardMode.SEVERAL_FORWARDS, BackwardMode.CREATE_GRAPH, BackwardMode.AFTER_CREATE_GRAPH)

    @property
    def graph_reads_weights(self) -> bool:
        """A create_graph backward left (or is building) a graph that reads the gathered weights."""
        return self in (BackwardMode.GRAPH_RETAINED, BackwardMode.CREATE_GRAPH, BackwardMode.AFTER_CREATE_GRAPH)

    def check_transition(self, new: "BackwardMode", *, owner: str) -> "BackwardMode":
        return check_transition(self, new, _BACKWARD_NEXT, owner=owner)


_BACKWARD_NEXT = {
    BackwardMode.IDLE: (BackwardMode.OVERLAPPED, BackwardMode.SEVERAL_FORWARDS, BackwardMode.CREATE_GRAPH),
    BackwardMode.GRAPH_RETAINED: (BackwardMode.CREATE_GRAPH, BackwardMode.AFTER_CREATE_GRAPH),
    BackwardMode.OVERLAPPED: (BackwardMode.IDLE,),
    BackwardMode.SEVERAL_FORWARDS: (BackwardMode.IDLE,),
    BackwardMode.CREATE_GRAPH: (BackwardMode.GRAPH_RETAINED,),
    BackwardMode.AFTER_CREATE_GRAPH: (BackwardMode.IDLE,),
}
