"""One rank per shard group: a whole world of one process, and HSDP/HFSDP with one
rank per shard group ([Note: one-rank reductions], [Note: zeroing by the first
reduction]). The gradients of ZeRO-2/3 go straight into the main-grad buffer there;
training must still equal one process on the global batch (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_fsdp as mf
from megatron_fsdp.comm import collectives
from conftest import get_pool
from models import Block, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference, train_steps
from test_patterns import LOOPS, STRATEGIES, pattern_worker
from test_topology import hybrid_parity_worker

TOL = 1e-5


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_patterns_on_one_rank(strategy, loop):
    """Every user loop of test_patterns (zero_grad forms, grads written before
    backward, closures, retained graphs, frozen and skipped blocks) in a world of one."""
    for diff, unused_grad_is_none, stray in get_pool(1).run(pattern_worker, strategy=strategy, loop=loop):
        assert diff < TOL, diff
        assert unused_grad_is_none and not stray


def microbatch_worker(rank, world, *, strategy, comm, nan_check):
    """Three microbatches (two under no_sync) per step: the first writes the main
    gradients, the next two add to them."""
    batches = make_batches("net", 4, batch=6 * world)
    reference = train_reference(make_model("net"), "net", batches, "adamw")
    policy = mf.MixedPrecisionPolicy(main_grads_dtype="fp32", grad_comm_dtype=comm)
    model, opt = mf.fully_shard(
        make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=policy, check_for_nan_in_grad=nan_check,
    )
    train_steps(model, opt, batches, rank, world, microbatches=3)
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("comm,nan_check", [("fp32", True), ("fp64", False)], ids=["fp32-nan-check", "fp64-wire"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_microbatches_on_one_rank(strategy, comm, nan_check):
    """An fp64 wire dtype takes the other path: a temporary bucket whose first
    result is copied over the stale main gradients, not added to them."""
    for diff in get_pool(1).run(microbatch_worker, strategy=strategy, comm=comm, nan_check=nan_check):
        assert diff < TOL, diff


@pytest.mark.parametrize(
    "strategy,outer",
    [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"), ("optim_grads", "no_shard")],
    ids=["hsdp-zero3", "hfsdp", "hsdp-zero2"],
)
def test_hybrid_with_one_rank_shard_groups(pool2, strategy, outer):
    """Two ranks as two replicas of a one-rank shard group: the shard level is the
    identity, the outer all-reduce (or HFSDP's reduce-scatter) does the averaging."""
    for diff, _, _ in pool2.run(hybrid_parity_worker, strategy=strategy, outer=outer, optimizer="adamw"):
        assert diff < TOL, diff


def in_place_worker(rank, world, *, strategy):
    """A steady step of ZeRO-2/3 in a world of one: no temporary bucket, no transport
    call for the reduce-scatter, and the main gradients equal one process's."""
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    batches = make_batches("net", 3, batch=4)
    train_steps(model, opt, batches[:2], rank, world)
    calls = []
    real = collectives._reduce_scatter_flat
    collectives._reduce_scatter_flat = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model.buffer_accounting.reset_peak()
        with collectives.record_collectives() as rec:
            opt.zero_grad()
            x, y = batches[2]
            loss_fn("net", model(x), y).backward()
    finally:
        collectives._reduce_scatter_flat = real
    with model.compute_params_registered() as module:
        reference = {n: p.detach().clone() for n, p in module.named_parameters()}
    probe = make_model("net")
    probe.load_state_dict(reference)
    loss_fn("net", probe(x), y).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # One rank: each gradient's local piece is the whole (flattened) gradient.
    diff = max((grads[n].to_local().reshape(-1) - p.grad.reshape(-1)).abs().max().item()
               for n, p in probe.named_parameters())
    return model.buffer_accounting.peak_temporary, len(calls), rec.counts["reduce_scatter"], diff


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_one_rank_reduction_runs_in_place(strategy):
    for peak, transport_calls, recorded, diff in get_pool(1).run(in_place_worker, strategy=strategy):
        assert peak == 0 and transport_calls == 0
        assert recorded > 0  # still counted as the collective it stands for
        assert diff < TOL, diff


def test_identity_reductions_need_one_rank_and_one_tensor():
    """The rule itself, on a fake group of one (the launch is skipped only when the
    output is the input and the operation leaves one value as it is)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("needs its own process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        x = torch.arange(8.0)
        assert collectives._is_identity(x, x, group, dist.ReduceOp.SUM)
        assert collectives._is_identity(x, x, group, dist.ReduceOp.AVG)
        assert not collectives._is_identity(x[:4], x, group, dist.ReduceOp.SUM)  # another size
        assert not collectives._is_identity(x.clone(), x, group, dist.ReduceOp.SUM)  # another tensor
        assert not collectives._is_identity(x, x, group, dist.ReduceOp.PREMUL_SUM)  # scales
    finally:
        dist.destroy_process_group()
