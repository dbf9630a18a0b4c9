"""PyTorch's mixed-precision and recompute habits through megatron_fsdp, against
single-process training on the global batch: ``torch.amp.GradScaler`` (with an
overflow on one rank's piece only), ``torch.autocast`` and reentrant activation
checkpointing (megatron-core's ``tensor_parallel.checkpoint`` is reentrant)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megatron_fsdp as mf
from megatron_fsdp import experimental
from models import Block, Net, loss_fn, make_batches
from test_experimental import make_mesh, placements_for, shard_net
from test_patterns import STRATEGIES, TOL, Ctx

EXPERIMENTAL_NAMES = dict(no_shard="no_shard", optim="zero1", optim_grads="zero2", optim_grads_params="zero3")

OVERFLOW_STEP = 1
"""The step whose scaled gradient of one element overflows to inf."""


class RecomputeNet(Net):
    """Net with reentrant recompute of each block when asked, and a tap for the overflow."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, tap: bool = False):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True) if self.reentrant else block(h)
        if tap:  # also the last element of the last weight: a copy, as ZeRO-3 frees the whole
            # weight after forward (a view of it would read freed storage, under FSDP2 too)
            return self.out(h), self.out.weight.reshape(-1)[-1].clone()
        return self.out(h)


def _mean_loss(model, ctx: Ctx, x, y, *, autocast: bool = False, overflow: bool = False) -> torch.Tensor:
    """``overflow``: plus 1e35 times the last element of the last weight, whose
    gradient the GradScaler's scale (2**16) turns into inf."""
    losses = []
    for _, xr, yr in ctx.shares(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(xr, tap=overflow)
        if overflow:
            out, tapped = out
            losses.append(loss_fn("net", out, yr) + 1e35 * tapped)
        else:
            losses.append(loss_fn("net", out.float(), yr))
    return sum(losses) / len(losses)


def _scaler_step(model, opt, scaler, step, x, y, ctx) -> bool:
    """The GradScaler recipe with unscale_ + clipping. On OVERFLOW_STEP one element's
    scaled gradient is inf: after a reduce-scatter only the rank holding that element
    sees it. Returns whether this process's own gradients held a non-finite value."""
    opt.zero_grad()
    scaler.scale(_mean_loss(model, ctx, x, y, overflow=step == OVERFLOW_STEP)).backward()
    if isinstance(model, mf.MegatronFSDP) and not model.model_auto_sync:
        model.finish_grad_sync()  # upstream's recipe: the deferred sync, before reading gradients
    with torch.no_grad():
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    saw_inf = any(not bool(torch.isfinite(g).all()) for g in local if g is not None)
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    return saw_inf


def grad_scaler_worker(rank, world, *, strategy, api):
    torch.manual_seed(0)
    base = RecomputeNet()
    reference = copy.deepcopy(base)
    make_opt = lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)  # noqa: E731
    if api == "fully_shard":
        model, opt = mf.fully_shard(base, make_opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    elif api == "MegatronFSDP":  # upstream's class and defaults (sync deferred to the step), a plain optimizer
        cfg = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        model = mf.MegatronFSDP(base, ddp_config=cfg, fsdp_unit_modules=[Block])
        opt = make_opt(model.parameters())
    else:  # the per-module API: parameters are FlatDTensors
        name = EXPERIMENTAL_NAMES[strategy]
        shard_net(base, make_mesh(world, name), placements_for(name))
        model, opt = base, make_opt(base.parameters())
        experimental.fully_shard_optimizer(opt)
    ref_opt = make_opt(reference.parameters())
    ref_scaler, scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    overflow_seen = None
    for step, (x, y) in enumerate(make_batches("net", 4, batch=4 * world)):
        _scaler_step(reference, ref_opt, ref_scaler, step, x, y, Ctx(rank, world, True))
        saw = _scaler_step(model, opt, scaler, step, x, y, Ctx(rank, world, False))
        if step == OVERFLOW_STEP:
            overflow_seen = saw
    full = experimental.full_state_dict(model) if api == "experimental" else mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return diff, scaler.get_scale(), ref_scaler.get_scale(), overflow_seen


@pytest.mark.parametrize("api", ["fully_shard", "MegatronFSDP", "experimental"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_scaler_skips_the_step_on_every_rank(pool2, strategy, api):
    """GradScaler.unscale_ on sharded gradients reduces found_inf over the ranks: an
    overflow in one rank's piece skips the step (and backs the scale off) everywhere,
    as one process on the global batch does. It used to raise NotImplementedError."""
    results = pool2.run(grad_scaler_worker, strategy=strategy, api=api)
    for diff, scale, ref_scale, _ in results:
        assert diff < TOL and scale == ref_scale == 2.0**15, (diff, scale, ref_scale)
    saw = [r[3] for r in results]
    if strategy == "no_shard":
        assert all(saw)  # all-reduced: every rank holds the inf
    elif api != "MegatronFSDP":  # (there the sync ran before the check: see _scaler_step)
        assert sorted(saw) == [False, True]  # only the rank holding the element saw it


def habit_worker(rank, world, *, strategy, habit):
    torch.manual_seed(0)
    base = RecomputeNet(reentrant=habit == "reentrant_checkpoint")
    reference = copy.deepcopy(base)
    make_opt = lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)  # noqa: E731
    model, opt = mf.fully_shard(base, make_opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    ref_opt = make_opt(reference.parameters())
    for x, y in make_batches("net", 4, batch=4 * world):
        for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
            o.zero_grad()
            _mean_loss(m, ctx, x, y, autocast=habit == "autocast_bf16").backward()
            o.step()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("habit", ["reentrant_checkpoint", "autocast_bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recompute_and_autocast(pool2, strategy, habit):
    """Reentrant recompute re-runs each unit's forward inside backward (ZeRO-3 gathers
    it again); autocast computes in bf16 from fp32 weights. Per-sample compute is the
    same as the reference's, so the result is equal within fp32 reduction order."""
    assert max(pool2.run(habit_worker, strategy=strategy, habit=habit)) < TOL
