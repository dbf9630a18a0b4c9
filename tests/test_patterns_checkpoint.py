"""Damaged checkpoints (issue 14, item 13): a load that fails leaves the model and
the optimizer bit-identical, and names the damaged file."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import megatron_fsdp as mf
from megatron_fsdp.state.checkpoint import CheckpointReadError
from models import Block, loss_fn, make_batches, make_model, make_optimizer

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _shard(strategy):
    return mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                          zero_dp_strategy=strategy)


def _train(model, opt, steps, rank, world, seed=1):
    for x, y in make_batches("net", steps, batch=4 * world, seed=seed):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()


def _snapshot(model, opt):
    weights = {k: v.clone() for k, v in mf.get_full_state_dict(model).items()}
    state = {}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            v = v.to_local() if hasattr(v, "to_local") else v
            state[(i, k)] = v.clone() if isinstance(v, torch.Tensor) else v
    return weights, state


def _same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
            and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor)
                                               else sa[k] == sb[k] for k in sa))


def _damage(path, how):
    names = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    target = os.path.join(path, ".metadata" if how == "metadata" else names[-1])
    if how == "truncate":
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    elif how == "delete":
        os.remove(target)
    elif how in ("overwrite", "metadata"):
        with open(target, "r+b") as f:  # same size, different bytes
            f.seek(os.path.getsize(target) // 2)
            f.write(b"\xff" * 16)
    return os.path.basename(target)


def damaged_worker(rank, world, *, strategy, path, how, checksums=True):
    model, opt = _shard(strategy)
    _train(model, opt, 2, rank, world)
    mf.save_checkpoint(path, model, opt)
    other, other_opt = _shard(strategy)
    _train(other, other_opt, 1, rank, world, seed=7)  # state that must survive the failed load
    before = _snapshot(other, other_opt)
    name = None
    if rank == 0:
        if not checksums:
            os.remove(os.path.join(path, "checksums.json"))
        name = _damage(path, how)
    dist.barrier()
    try:
        mf.load_checkpoint(path, other, other_opt)
        message = "no error"
    except CheckpointReadError as exc:
        message = str(exc)
    return message, name, _same(before, _snapshot(other, other_opt))


@pytest.mark.parametrize("how", ["truncate", "delete", "overwrite", "metadata"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_damaged_checkpoint_changes_nothing_and_names_the_file(pool2, tmp_path, strategy, how):
    results = pool2.run(damaged_worker, strategy=strategy, path=str(tmp_path / "c"), how=how)
    name = results[0][1]
    for message, _, unchanged in results:
        assert unchanged, message
        assert name in message and "damaged" in message, message


@pytest.mark.parametrize("how", ["truncate", "metadata"])
def test_damage_without_checksums_is_still_a_read_error(pool2, tmp_path, how):
    """Checkpoints written before checksums: a truncated shard or a corrupt .metadata
    is a CheckpointReadError, and nothing changes."""
    for message, _, unchanged in pool2.run(damaged_worker, strategy="optim_grads_params", path=str(tmp_path / "c"),
                                            how=how, checksums=False):
        assert unchanged and message != "no error", message
