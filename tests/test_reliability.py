"""Reliability: dead ranks fail loudly and in bounded time, checkpoints publish
atomically, runs are deterministic, misuse is caught, memory stays flat."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time

import pytest

import torch
import torch.distributed as dist
import torch.nn as nn

from grids import grid
import megatron_fsdp as mf
from megatron_fsdp.training.local_group import init_local_gloo
from dist_pool import _free_port
from models import Block, loss_fn, make_batches, make_model, make_optimizer

COLLECTIVE_TIMEOUT_S = 10.0  # documented default for these tests: collectives fail, never hang


# -- a rank dies ----------------------------------------------------------------------
def _die_on_rank1(rank):
    if rank == 1:
        os._exit(17)


def _first_report(main, *args):
    """Run ``main(rank, 2, port, *args, results)`` on two spawned ranks; the first
    (rank, kind, message, seconds) one of them reports, and the processes (joined)."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=main, args=(r, 2, port, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=120), procs
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def dead_rank_main(rank, world, port, phase, path, results):
    init_local_gloo(rank, world, port, timeout_s=60)
    cfg = mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )  # explicit: the config default is upstream's no_shard (issue 13)
    module = make_model("net")
    fc1_weight = module.blocks[1].fc1.weight  # the compute parameter (the one autograd reaches), before wrapping
    model = mf.MegatronFSDP(module, ddp_config=cfg, fsdp_unit_modules=[Block])
    opt = mf.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    x, y = make_batches("net", 1, batch=8)[0]
    # One good step and a good checkpoint first.
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    mf.save_checkpoint(os.path.join(path, "good"), model, opt)
    if phase == "forward":
        model.module.blocks[1].register_forward_pre_hook(lambda *a: _die_on_rank1(rank))
    elif phase == "backward":
        fc1_weight.register_hook(lambda g: _die_on_rank1(rank) or g)
    elif phase == "checkpoint":
        import torch.distributed.checkpoint as dcp

        real_save = dcp.save
        dcp.save = lambda *a, **k: (_die_on_rank1(rank), real_save(*a, **k))[1]
    start = time.monotonic()
    try:
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        mf.save_checkpoint(os.path.join(path, "next"), model, opt)
        results.put((rank, "finished", "", 0.0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, type(exc).__name__, str(exc), time.monotonic() - start))
    # os._exit skips the queue's feeder thread: flush it first or the result is lost.
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.parametrize("phase", ["forward", "backward", "checkpoint"])
def test_a_dead_rank_fails_the_others_with_a_named_collective(tmp_path, phase):
    (rank, kind, message, elapsed), procs = _first_report(dead_rank_main, phase, str(tmp_path))
    assert rank == 0 and procs[1].exitcode == 17
    assert elapsed < COLLECTIVE_TIMEOUT_S + 20  # bounded: never a hang
    if phase == "checkpoint":
        assert kind == "CheckpointWriteError" and "Nothing was published" in message
        assert not (tmp_path / "next").exists()  # the interrupted save was never published
        assert (tmp_path / "good" / ".metadata").exists()
    else:
        assert kind == "CollectiveError", message
        assert re.search(r"(all_gather|reduce_scatter|all_reduce) '[^']+' over 2 ranks failed on rank 0", message), message


# -- DDP's habit: only rank 0 asks for the state dict ----------------------------------
LONE_TIMEOUT_S = 3.0


def lone_state_dict_main(rank, world, port, reported, results):
    init_local_gloo(rank, world, port, timeout_s=60)
    cfg = mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", collective_timeout_s=LONE_TIMEOUT_S
    )
    model = mf.MegatronFSDP(make_model("net"), ddp_config=cfg, fsdp_unit_modules=[Block])
    start = time.monotonic()
    if rank == 0:
        try:
            model.state_dict()  # ZeRO-3: gathers rows from the other rank, which never joins
            results.put((rank, "returned", "", time.monotonic() - start))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, type(exc).__name__, str(exc), time.monotonic() - start))
        reported.set()
    else:
        reported.wait(timeout=60)  # busy elsewhere, as after `if rank == 0:`
    results.close()
    results.join_thread()
    os._exit(0)


def test_state_dict_on_one_rank_only_fails_naming_the_fix():
    reported = mp.get_context("spawn").Event()
    (rank, kind, message, elapsed), _ = _first_report(lone_state_dict_main, reported)
    assert (rank, kind) == (0, "CollectiveError"), message
    assert "must be called on every rank" in message and "save_checkpoint" in message
    assert elapsed < LONE_TIMEOUT_S + 10  # the model's collective timeout, not a hang


def resume_good_worker(rank, world, *, path):
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block])
    mf.load_checkpoint(path, model, opt)
    return len(opt.state) > 0


def test_the_checkpoint_before_a_crash_stays_loadable(tmp_path, pool2):
    test_a_dead_rank_fails_the_others_with_a_named_collective(tmp_path, "checkpoint")
    assert all(pool2.run(resume_good_worker, path=str(tmp_path / "good")))


# -- determinism ----------------------------------------------------------------------
def determinism_worker(rank, world, *, strategy):
    runs = []
    for _ in range(2):
        model, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                                    zero_dp_strategy=strategy)
        for x, y in make_batches("net", 3, batch=4 * world):
            opt.zero_grad()
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        runs.append(mf.get_full_state_dict(model))
    return all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0]), runs[0]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_same_seed_same_bits(pool2, strategy):
    first = pool2.run(determinism_worker, strategy=strategy)
    second = pool2.run(determinism_worker, strategy=strategy)
    assert all(same for same, _ in first)
    for (_, a), (_, b) in zip(first, second):  # and across separate runs
        assert all(torch.equal(a[k], b[k]) for k in a)


# -- misuse ---------------------------------------------------------------------------
def step_without_backward_worker(rank, world):
    """As plain PyTorch: after zero_grad() (gradients None) a step moves nothing."""
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block])
    x, y = make_batches("net", 1, batch=4 * world)[0]
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    before = mf.get_full_state_dict(model)
    state_before = {k: v.clone() for k, v in opt.state[next(iter(opt.state))].items()}
    opt.zero_grad()
    opt.step()  # no backward since the last step
    after = mf.get_full_state_dict(model)
    state_after = opt.state[next(iter(opt.state))]
    return (
        all(torch.equal(before[k], after[k]) for k in before),
        all(torch.equal(state_before[k], state_after[k]) for k in state_before),
    )


def test_step_without_backward_changes_nothing(pool2):
    for weights_same, state_same in pool2.run(step_without_backward_worker):
        assert weights_same and state_same


def nested_wrapper_worker(rank, world, *, case):
    inner = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block])
    try:
        if case == "wrapper":
            mf.fully_shard_model(inner)
        elif case == "submodule":
            mf.fully_shard_model(nn.Sequential(nn.Linear(3, 5), inner))
        elif case == "ddp":
            mf.fully_shard_model(nn.parallel.DistributedDataParallel(make_model("net")))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case", ["wrapper", "submodule", "ddp"])
def test_wrapping_inside_another_wrapper_is_an_error(pool2, case):
    message = pool2.run(nested_wrapper_worker, case=case)[0]
    assert "already a data-parallel wrapper" in message


# -- no leaks -------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def leak_worker(rank, world, *, strategy, steps):
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    acct = model.buffer_accounting
    batches = make_batches("net", 4, batch=4 * world)
    rss, persistent, temporary = [], [], []
    for step in range(steps):
        x, y = batches[step % 4]
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        model.finish_param_sync()
        persistent.append(acct.total_persistent)
        temporary.append(acct.temporary)
        rss.append(_rss_mb())
    return rss, persistent, temporary


# test_memory.py runs every strategy 50 steps; here the longest run on the fully sharded one.
@pytest.mark.parametrize("strategy", grid(["no_shard", "optim", "optim_grads", "optim_grads_params"],
                                          ("optim_grads_params",)))
def test_200_steps_stay_flat(pool2, strategy):
    for rss, persistent, temporary in pool2.run(leak_worker, strategy=strategy, steps=200):
        assert len(set(persistent)) == 1 and set(temporary) == {0}
        assert rss[-1] - rss[50] < 2.0, (rss[50], rss[-1])  # MB after warm-up

