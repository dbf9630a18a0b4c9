"""Gradient hooks on parameters, registered as DDP and FSDP2 users do: a tensor hook
(``p.register_hook``) before or after wrapping runs on this rank's local gradient
before the reduction, as under DDP ([Note: gradient hooks on distributed parameters]);
a post-accumulate-grad hook on a sharded parameter runs with its reduced gradient in
the experimental (FSDP2-style) API, and is refused by the main engine."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import megatron_fsdp as mf
from megatron_fsdp import experimental
from models import Block, Net, loss_fn
from test_experimental import make_mesh, placements_for, shard_net
from test_patterns import STRATEGIES, TOL

EXPERIMENTAL = ["no_shard", "zero1", "zero2", "zero3"]


def _clip_hooks(params) -> list:
    """Per-element clipping on every parameter (not linear: clipping each rank's local
    gradient, as DDP does, differs from clipping the averaged one) and a mask on the
    first (it never moves)."""
    handles = [p.register_hook(lambda g: g.clamp(-0.01, 0.01)) for p in params]
    handles.append(params[0].register_hook(lambda g: g * 0))
    return handles


def grad_hooks_worker(rank, world, *, strategy, when):
    """Hooks registered as a DDP user would: before wrapping, or on model.parameters()
    after it (and removed again before the last step)."""
    torch.manual_seed(0)
    base = Net()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if when == "before_wrapping":
        _clip_hooks(list(base.parameters()))
    model, opt = mf.fully_shard(base, lambda p: torch.optim.SGD(p, lr=0.1), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    handles = _clip_hooks(list(ddp.parameters()))
    if when == "after_wrapping":
        handles += _clip_hooks(list(model.parameters()))
    g = torch.Generator().manual_seed(rank)  # every rank its own data
    for step in range(3):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        if when == "after_wrapping" and step == 2:
            for handle in handles:
                handle.remove()
        for m, o in ((ddp, ddp_opt), (model, opt)):
            o.zero_grad()
            loss_fn("net", m(x), y).backward()
            o.step()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ddp.module.named_parameters())


@pytest.mark.parametrize("when", ["before_wrapping", "after_wrapping"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_hooks_like_ddp(pool2, strategy, when):
    """[Note: gradient hooks on distributed parameters] A hook on model.parameters()
    runs on this rank's local gradient before the reduction, as under DDP. Registered
    after wrapping, it used to never run (0.09 off after 3 SGD steps)."""
    assert max(pool2.run(grad_hooks_worker, strategy=strategy, when=when)) < TOL


def post_accumulate_worker(rank, world):
    model, _ = mf.fully_shard(Net(), lambda p: torch.optim.SGD(p, lr=0.1), fsdp_unit_modules=[Block])
    next(iter(model.parameters())).register_post_accumulate_grad_hook(lambda p: None)
    try:
        model(torch.randn(2, 5))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_post_accumulate_hook_on_distributed_parameter_is_refused(pool2):
    for message in pool2.run(post_accumulate_worker):
        assert "post-accumulate-grad hook" in message and "p.register_hook" in message, message


def experimental_hooks_worker(rank, world, *, strategy):
    """The same hooks on the experimental API's sharded parameters (FSDP2 itself never
    runs them), plus a post-accumulate-grad hook that records each reduced gradient."""
    torch.manual_seed(0)
    base = Net(d=8)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    shard_net(base, make_mesh(world, strategy), placements_for(strategy))
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    experimental.fully_shard_optimizer(opt)
    _clip_hooks(list(ddp.parameters()))
    _clip_hooks(list(base.parameters()))
    seen: dict = {}
    calls = []
    for p in base.parameters():
        p.register_post_accumulate_grad_hook(lambda p: (seen.__setitem__(p, p.grad.to_local().clone()), calls.append(1)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        for m, o in ((ddp, ddp_opt), (base, opt)):
            o.zero_grad()
            loss_fn("net", m(x), y).backward()
            o.step()
    full = experimental.full_state_dict(base)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ddp.module.named_parameters())
    params = list(base.parameters())
    hooks_saw_reduced = len(calls) == 3 * len(params) and all(torch.equal(seen[p], p.grad.to_local()) for p in params)
    return diff, hooks_saw_reduced


@pytest.mark.parametrize("strategy", EXPERIMENTAL)
def test_experimental_gradient_hooks(pool2, strategy):
    for diff, hooks_saw_reduced in pool2.run(experimental_hooks_worker, strategy=strategy):
        assert diff < TOL and hooks_saw_reduced, (diff, hooks_saw_reduced)
