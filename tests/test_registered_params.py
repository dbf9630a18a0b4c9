"""Between steps the wrapped module's registered parameters are the distributed
parameters (param_swap.py [Note: registered parameters]): whatever walks
``model.module`` trains, clips and reads exactly as single-process training on the
global batch (issues 13 and 14)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from models import Block, Net, SkipNet, loss_fn, make_batches
from test_patterns import STRATEGIES, TOL, Ctx, _loss, _optimizer, loop_plain

MAX_NORM = 0.05  # well below the gradients' norm: every step clips


def _scalar(t: torch.Tensor) -> float:
    """A reduction of a DTensor parameter is a DTensor (Partial until asked): its full value."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).item()


def _same_objects(a, b) -> bool:
    return [id(p) for p in a] == [id(p) for p in b]


# -- item 1: optimizer and clip_grad_norm_ on model.module.parameters() ---------------------------
def loop_clip(model, opt, step, x, y, ctx, norms):
    opt.zero_grad()
    _loss(model, ctx, x, y).backward()
    norms.append(torch.nn.utils.clip_grad_norm_(ctx.module(model).parameters(), MAX_NORM).item())
    opt.step()


def module_optimizer_worker(rank, world, *, strategy, clip, steps=3):
    torch.manual_seed(0)
    base = SkipNet()
    batches = make_batches("net", steps, batch=4 * world)
    reference = copy.deepcopy(base)
    ref_opt, ref_norms = _optimizer("adamw", reference.parameters()), []
    model = mf.fully_shard_model(base, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    same_before = _same_objects(model.module.parameters(), model.parameters())
    names_match = [n for n, _ in model.module.named_parameters()] == [n for n, _ in model.named_parameters()]
    opt, norms = mf.fully_shard_optimizer(_optimizer("adamw", model.module.parameters())), []
    for step, (x, y) in enumerate(batches):
        for m, o, ns, ctx in ((reference, ref_opt, ref_norms, Ctx(rank, world, True)),
                              (model, opt, norms, Ctx(rank, world, False))):
            if clip:
                loop_clip(m, o, step, x, y, ctx, ns)
            else:
                loop_plain(m, o, step, x, y, ctx)
    same_after = _same_objects(model.module.parameters(), model.parameters())
    full = mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    norm_diff = max([abs(a - b) for a, b in zip(norms, ref_norms)], default=0.0)
    return diff, norm_diff, same_before and same_after and names_match


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_and_clip_on_module_parameters(pool2, strategy, clip):
    """Issue 14 item 9: an optimizer and clip_grad_norm_ built on model.module.parameters()
    train (and clip) as single-process training; those are model.parameters()."""
    for diff, norm_diff, same in pool2.run(module_optimizer_worker, strategy=strategy, clip=clip):
        assert diff < TOL and norm_diff < TOL and same, (diff, norm_diff, same)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_clip_on_module_parameters_world4(pool4, strategy):
    for diff, norm_diff, same in pool4.run(module_optimizer_worker, strategy=strategy, clip=True):
        assert diff < TOL and norm_diff < TOL and same, (diff, norm_diff, same)


# -- item 2: reading the module's parameters between steps -----------------------------------------
def read_between_steps_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    model, opt = mf.fully_shard(Net(), lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    ema = {n: p.detach().clone() for n, p in model.module.named_parameters()}  # before any step
    for x, y in make_batches("net", 2, batch=4 * world):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        with torch.no_grad():
            for n, p in model.module.named_parameters():
                ema[n].mul_(0.5).add_(p, alpha=0.5)
    full = mf.get_full_state_dict(model)
    norms = max(abs(_scalar(model.module.get_parameter(n).norm()) - full[n].norm().item()) for n in full)
    sums = max(abs(_scalar(p.detach().clone().sum()) - full[n].sum().item()) for n, p in model.module.named_parameters())
    ema_ok = all(isinstance(v, DTensor) == isinstance(model.module.get_parameter(n), DTensor) for n, v in ema.items())
    try:
        model.module.inp.weight.numpy()
        numpy = "values"
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
        numpy = f"error: {exc}"
    return norms, sums, ema_ok, numpy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_parameters_readable_between_steps(pool2, strategy):
    """Issue 14: p.norm(), p.clone() and an EMA over model.module's parameters between
    steps read the main weights (ZeRO-3 used to crash on released storage); .numpy()
    gives the values or an error, never a crash."""
    for norms, sums, ema_ok, numpy in pool2.run(read_between_steps_worker, strategy=strategy):
        assert norms < TOL and sums < TOL and ema_ok and numpy, (norms, sums, ema_ok, numpy)


# -- registration round trips --------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 5, bias=False)
        self.block = Block(5)
        self.head = nn.Linear(5, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def registration_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = Tied()
    reference = copy.deepcopy(base)
    model = mf.fully_shard_model(base, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    tied = model.module.head.weight is model.module.emb.weight
    x = torch.randn(4, 5)
    with torch.no_grad():
        eval_out = model(x)  # an eval forward: no backward will come
    eval_diff = (eval_out - reference(x)).abs().max().item()
    after_eval = _same_objects(model.module.parameters(), model.parameters())
    model(x).sum()  # forward with grad, never backward
    after_no_backward = _same_objects(model.module.parameters(), model.parameters())
    state = model.module.state_dict()
    state_keys = list(state) == list(reference.state_dict())
    full = mf.get_full_state_dict(model)
    state_norms = max(abs(_scalar(state[n].norm()) - full[n].norm().item()) for n in full)
    module = model.unshard_module()
    plain = all(type(p) is nn.Parameter and not isinstance(p.data, DTensor) for p in module.parameters())
    values = max((module.get_parameter(n) - p).abs().max().item() for n, p in reference.named_parameters())
    return dict(tied=tied and module.head.weight is module.emb.weight, eval_diff=eval_diff, after_eval=after_eval,
                after_no_backward=after_no_backward, state_keys=state_keys, state_norms=state_norms,
                plain=plain, values=values)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_registration_round_trips(pool2, strategy):
    """Tied weights stay tied; an eval forward and a forward without backward leave
    the distributed parameters registered; model.module.state_dict() holds them;
    unshard_module() gives back plain full parameters."""
    for r in pool2.run(registration_worker, strategy=strategy):
        assert r["tied"] and r["after_eval"] and r["after_no_backward"] and r["state_keys"] and r["plain"], r
        assert r["eval_diff"] < TOL and r["state_norms"] < TOL and r["values"] < TOL, r
