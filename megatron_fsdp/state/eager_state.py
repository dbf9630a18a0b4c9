"""Creating an optimizer's per-parameter state before its first step.

A checkpoint load needs the state to exist (DCP loads into the tensors it finds),
and ``fully_shard_optimizer`` creates it eagerly so the state's sharded layout is
known before training starts.
"""

from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create the optimizer's per-parameter state now, exactly as its first step
    would (Adam: zero moments, step 0), without taking a step: no parameter and no
    existing state entry changes. Returns the parameters that got new state.

    Uses the optimizer's own ``_init_group`` (the lazy initialiser torch optimizers
    share); optimizers without one, or whose state is created by the step itself
    (SGD's momentum buffer), keep their lazy state."""
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None:
        return []
    try:
        extra = len(inspect.signature(init_group).parameters) - 1  # after ``group``: output lists
    except (TypeError, ValueError):
        return []
    before = set(optimizer.state)
    borrowed = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = p.detach()  # only its presence is read: no allocation
                borrowed.append(p)
    try:
        for group in optimizer.param_groups:
            init_group(group, *([] for _ in range(extra)))
    except Exception as exc:  # an optimizer with another _init_group contract
        for p in list(optimizer.state):
            if p not in before:
                del optimizer.state[p]
        logger.info("megatron_fsdp: %s keeps lazily created state (%s)", type(optimizer).__name__, exc)
        return []
    finally:
        for p in borrowed:
            p.grad = None
    created = [p for p in optimizer.state if p not in before]
    for p in created:
        if not optimizer.state[p]:
            del optimizer.state[p]  # e.g. SGD touches state without filling it
    return [p for p in created if p in optimizer.state]
