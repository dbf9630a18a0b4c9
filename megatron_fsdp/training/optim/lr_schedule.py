"""Learning-rate schedule with Megatron-LM's shapes: linear warmup from
``--lr-warmup-init`` to ``--lr``, then constant / linear / cosine /
inverse-square-root decay to ``--min-lr`` at the end of the decay horizon.

As Megatron-LM's ``OptimizerParamScheduler``, the clock counts iterations, or
samples in sample-based training (``--train-samples``, ``--lr-*-samples``: each
step adds the global batch size), and it only moves on iterations whose update was
applied: a skipped (NaN / overflow) iteration leaves the learning rate where it was.
The schedule is a pure function of that clock, so its checkpointed state is one
counter (plus the settings, to catch a resume with a different schedule).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Optional

import torch

from ..args.arguments import LRDecayStyle

logger = logging.getLogger(__name__)

_CHECKPOINTED_SETTINGS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style")
"""The settings Megatron-LM's OptimizerParamScheduler saves and checks on resume (it
does not save the warmup's start LR or the clock's unit, so a difference there is
only warned about and the command line's stays)."""


class ScheduleResume(enum.Enum):
    """What a resume does when the checkpoint's schedule settings differ from the
    command line's, as Megatron-LM's ``OptimizerParamScheduler``."""

    REFUSE = "refuse"
    """Megatron-LM's default: a difference is an error (naming both flags below)."""
    CHECKPOINT = "checkpoint"
    """``--use-checkpoint-opt_param-scheduler``: the checkpoint's settings win."""
    COMMAND_LINE = "command_line"
    """``--override-opt_param-scheduler``: the command line's settings win."""

    @classmethod
    def from_args(cls, args) -> "ScheduleResume":
        if args.override_opt_param_scheduler:
            return cls.COMMAND_LINE
        return cls.CHECKPOINT if args.use_checkpoint_opt_param_scheduler else cls.REFUSE


@dataclasses.dataclass(kw_only=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: float
    """Clock units of linear warmup. Fractional with ``--lr-warmup-fraction`` (Megatron-LM
    keeps fraction x decay horizon unrounded)."""
    decay_steps: int
    style: LRDecayStyle
    warmup_init: float = 0.0
    increment: int = 1
    """Clock units per applied update: 1 (iterations) or the global batch size (samples)."""
    per_sample: bool = False
    """The clock counts samples: ``step(samples)`` adds the samples the iteration trained
    on, as Megatron-LM's scheduler is stepped by micro batches x micro batch x DP size
    (``increment`` unless ``--rampup-batch-size`` / ``--step-batch-size-schedule`` change
    the batch)."""
    num_steps: int = 0
    """Clock so far; the next iteration uses ``lr_at(num_steps)``."""

    def __post_init__(self) -> None:
        if self.decay_steps <= 0:
            raise ValueError(f"decay_steps={self.decay_steps} must be positive")
        if self.warmup_steps and self.warmup_steps >= self.decay_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be smaller than decay_steps={self.decay_steps}")

    @classmethod
    def from_args(cls, args) -> "LRSchedule":
        units = args.schedule
        return cls(max_lr=args.lr, min_lr=args.min_lr, warmup_steps=units.warmup_steps, decay_steps=units.decay_steps,
                   style=args.lr_decay, warmup_init=args.lr_warmup_init, increment=units.increment,
                   per_sample=units.unit == "samples")

    def lr_at(self, step: int, *, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The learning rate at clock ``step``; ``max_lr``/``min_lr``: a param group's own
        bounds (Megatron-LM's ``--decoupled-lr``), on the same warmup and decay."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.warmup_init + (max_lr - self.warmup_init) * step / self.warmup_steps
        if self.style is LRDecayStyle.CONSTANT:
            return max_lr
        # Past the decay horizon every decaying style sits at min_lr, inverse-square-root
        # included: Megatron-LM tests the horizon before that style's formula, so its
        # 1/sqrt(step) tail is cut off at --lr-decay-iters/--lr-decay-samples.
        if step > self.decay_steps:
            return min_lr
        if self.style is LRDecayStyle.INVERSE_SQUARE_ROOT:
            warmup = max(self.warmup_steps, 1)
            return max(min_lr, max_lr * warmup**0.5 / max(step, 1)**0.5)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        match self.style:
            case LRDecayStyle.LINEAR:
                coeff = 1.0 - ratio
            case LRDecayStyle.COSINE:
                coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
            case _:
                raise ValueError(f"lr decay style {self.style} has no formula; use one of {[s.value for s in LRDecayStyle]}")
        return min_lr + coeff * (max_lr - min_lr)

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.num_steps)

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        """Set the learning rate of the coming step on every param group (a group with
        its own ``max_lr``/``min_lr``, as Megatron-LM's decoupled embedding and output
        group, between those); returns the other groups' rate, the one Megatron-LM logs."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr_at(self.num_steps, max_lr=group.get("max_lr"), min_lr=group.get("min_lr"))
        return self.current_lr

    def step(self, samples: Optional[int] = None) -> None:
        """Advance after an applied update (never after a skipped iteration);
        ``samples``: what the iteration trained on, the step of a per-sample clock."""
        self.num_steps += samples if self.per_sample and samples is not None else self.increment

    def state_dict(self) -> dict:
        return dataclasses.asdict(self) | {"style": self.style.value}

    def load_state_dict(self, state: dict, *, resume: ScheduleResume = ScheduleResume.REFUSE) -> None:
        """Restore the clock. Settings that differ from the command line are handled
        as ``resume`` says, all checked before anything changes."""
        saved = dict(state, style=LRDecayStyle(state["style"]))
        differing = [key for key in _CHECKPOINTED_SETTINGS if saved[key] != getattr(self, key)]
        if differing and resume is ScheduleResume.REFUSE:
            listed = ", ".join(f"{key}: checkpoint {saved[key]}, command line {getattr(self, key)}" for key in differing)
            raise ValueError(
                f"the checkpoint's learning-rate schedule differs from the command line's ({listed}); Megatron-LM "
                "refuses this resume too. Fix: give the checkpoint's values, or pass --override-opt_param-scheduler "
                "(the command line's schedule wins) or --use-checkpoint-opt_param-scheduler (the checkpoint's wins)"
            )
        for key in differing:
            if resume is ScheduleResume.CHECKPOINT:
                logger.info("lr schedule: using the checkpoint's %s=%s instead of the command line's %s "
                            "(--use-checkpoint-opt_param-scheduler)", key, saved[key], getattr(self, key))
                setattr(self, key, saved[key])
            else:
                logger.info("lr schedule: using the command line's %s=%s instead of the checkpoint's %s "
                            "(--override-opt_param-scheduler)", key, getattr(self, key), saved[key])
        for key in ("warmup_init", "increment"):  # not in Megatron-LM's checkpoint: the command line's
            if saved[key] != getattr(self, key):
                logger.warning("lr schedule: checkpoint has %s=%s, the command line %s; using the command line",
                               key, saved[key], getattr(self, key))
        self.num_steps = int(saved["num_steps"])
