"""Learning-rate schedule with Megatron-LM's shapes: linear warmup from
``--lr-warmup-init`` to ``--lr``, then constant / linear / cosine /
inverse-square-root decay to ``--min-lr`` at ``--lr-decay-iters``.

The schedule is a pure function of the number of optimizer steps taken so far, so
its checkpointed state is that one counter (plus the settings, to catch a resume
with a different schedule).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from .arguments import LRDecayStyle

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: LRDecayStyle
    warmup_init: float = 0.0
    num_steps: int = 0
    """Optimizer steps taken so far; the next iteration uses ``lr_at(num_steps)``."""

    def __post_init__(self) -> None:
        if self.decay_iters <= 0:
            raise ValueError(f"decay_iters={self.decay_iters} must be positive")
        if self.warmup_iters and self.warmup_iters >= self.decay_iters:
            raise ValueError(f"warmup_iters={self.warmup_iters} must be smaller than decay_iters={self.decay_iters}")

    @classmethod
    def from_args(cls, args) -> "LRSchedule":
        return cls(max_lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                   decay_iters=args.lr_decay_iters, style=args.lr_decay, warmup_init=args.lr_warmup_init)

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.max_lr - self.warmup_init) * step / self.warmup_iters
        if self.style is LRDecayStyle.CONSTANT:
            return self.max_lr
        if self.style is LRDecayStyle.INVERSE_SQUARE_ROOT:
            warmup = max(self.warmup_iters, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
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
        self.num_steps += 1

    def state_dict(self) -> dict:
        return dataclasses.asdict(self) | {"style": self.style.value}

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state, style=LRDecayStyle(state["style"]))
        for key in ("max_lr", "min_lr", "warmup_iters", "decay_iters", "style", "warmup_init"):
            if saved[key] != getattr(self, key):
                # Megatron-LM's default is to trust the command line over the checkpoint; say so.
                logger.warning(
                    "lr schedule: checkpoint has %s=%s, the command line %s; using the command line",
                    key, saved[key], getattr(self, key),
                )
        self.num_steps = int(saved["num_steps"])
