"""Enumerations shared by the whole package.

Strategies are parsed once at the boundary (``ShardingStrategy.parse``) and
compared as enums everywhere else.
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
    forward inside its backward; the PRE_BACKWARD state tells the forward hooks to
    leave the (already gathered) weights alone."""

    IDLE = enum.auto()
    """Between steps, or after forward and before backward reached the unit."""
    FORWARD = enum.auto()
    """Inside the unit's forward."""
    PRE_BACKWARD = enum.auto()
    """Backward reached the unit's outputs; weights are gathered for its backward."""
    POST_BACKWARD = enum.auto()
    """All gradients of the unit were produced and handed to the reduce pipeline."""
