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
import logging
import math

import torch

from .arguments import LRDecayStyle

logger = logging.getLogger(__name__)

_CHECKPOINTED_SETTINGS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style")
"""What Megatron-LM's OptimizerParamScheduler takes back from a checkpoint under
--use-checkpoint-opt_param-scheduler (it does not save the warmup's start LR or the
clock's unit, so those stay the command line's)."""


@dataclasses.dataclass(kw_only=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: LRDecayStyle
    warmup_init: float = 0.0
    increment: int = 1
    """Clock units per applied update: 1 (iterations) or the global batch size (samples)."""
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
                   style=args.lr_decay, warmup_init=args.lr_warmup_init, increment=units.increment)

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.warmup_init + (self.max_lr - self.warmup_init) * step / self.warmup_steps
        if self.style is LRDecayStyle.CONSTANT:
            return self.max_lr
        if self.style is LRDecayStyle.INVERSE_SQUARE_ROOT:
            warmup = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        if step > self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        match self.style:
            case LRDecayStyle.LINEAR:
                coeff = 1.0 - ratio
            case LRDecayStyle.COSINE:
                coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
            case _:
                raise ValueError(f"lr decay style {self.style} has no formula; use one of {[s.value for s in LRDecayStyle]}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.num_steps)

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        """Set the learning rate of the coming step on every param group."""
        lr = self.current_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> None:
        """Advance after an applied update (never after a skipped iteration)."""
        self.num_steps += self.increment

    def state_dict(self) -> dict:
        return dataclasses.asdict(self) | {"style": self.style.value}

    def load_state_dict(self, state: dict, *, use_checkpoint_settings: bool = False) -> None:
        """Restore the clock. A setting that differs from the command line is warned
        about and the command line's is kept (what Megatron-LM does with
        ``--override-opt_param-scheduler``; without it Megatron-LM refuses the
        mismatch). ``use_checkpoint_settings`` (``--use-checkpoint-opt_param-scheduler``)
        adopts the checkpoint's peak and minimum LR, warmup, decay horizon and decay
        style instead -- the settings Megatron-LM's scheduler saves and takes back."""
        saved = dict(state, style=LRDecayStyle(state["style"]))
        for key in ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style", "warmup_init", "increment"):
            if saved[key] == getattr(self, key):
                continue
            if use_checkpoint_settings and key in _CHECKPOINTED_SETTINGS:
                logger.info("lr schedule: using the checkpoint's %s=%s instead of the command line's %s "
                            "(--use-checkpoint-opt_param-scheduler)", key, saved[key], getattr(self, key))
                setattr(self, key, saved[key])
            else:
                logger.warning("lr schedule: checkpoint has %s=%s, the command line %s; using the command line",
                               key, saved[key], getattr(self, key))
        self.num_steps = int(saved["num_steps"])
