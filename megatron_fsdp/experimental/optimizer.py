"""``fully_shard_optimizer``: step hooks that let a stock optimizer step sharded
parameters whose gradient dtype differs from their (main-weight) dtype, and refresh
the compute weights after each step."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from .parameter_group import get_containing_parameter_group, sync_model_weights_from_main_weights

__all__ = ["fully_shard_optimizer"]


def _set_grad(parameter: nn.Parameter, grad: torch.Tensor) -> None:
    # grad_dtype can only change while no gradient of the old dtype is attached.
    parameter.grad = None
    parameter.grad_dtype = grad.dtype
    parameter.grad = grad


class _GradCaster:
    """Casts bf16/fp16 main gradients to the main-weight dtype for one step, then
    restores them (so accumulation buffers are untouched)."""

    def __init__(self, precision_aware: bool) -> None:
        self.precision_aware = precision_aware
        self.casted: list[tuple[nn.Parameter, torch.Tensor]] = []

    def pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        # args[0] is the optimizer itself; a closure comes next or as a keyword.
        if kwargs.get("closure") is not None or len(args) > 1:
            raise NotImplementedError("fully_shard_optimizer: optimizer.step(closure) is not supported; call step()")
        assert not self.casted, "a previous step did not finish"
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self.precision_aware or p.grad is None or get_containing_parameter_group(p) is None:
                    continue
                if p.grad.dtype != p.dtype:
                    self.casted.append((p, p.grad))
                    _set_grad(p, p.grad.to(p.dtype))

    def post(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        for p, grad in self.casted:
            _set_grad(p, grad)
        self.casted.clear()
        sync_model_weights_from_main_weights(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, precision_aware: bool = False) -> None:
    """Adapt ``optimizer`` in place (its class and param groups are untouched): step
    hooks registered on this optimizer only (nothing global) cast gradients where
    needed and refresh the compute weights after each step. An optimizer not adapted
    still leaves no stale weights: the next unshard notices the main weights' version
    counters moved (see ``FsdpParameterGroup._refresh_if_stale``).

    Args:
        precision_aware: the optimizer accepts gradients of another dtype than its
            parameters; skip the temporary cast.
    """
    caster = _GradCaster(precision_aware)
    optimizer.register_step_pre_hook(caster.pre)
    optimizer.register_step_post_hook(caster.post)
