"""Checkpoints: DTensor state dicts through torch.distributed.checkpoint, resharding,
export/import of plain state dicts, and clear errors for mismatches."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import megatron_fsdp as mf
from megatron_fsdp.state.checkpoint import materialize_optimizer_state
from models import Block, make_batches, make_model, make_optimizer, max_param_diff, train_reference, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
GLOBAL_BATCH = 8  # divisible by world sizes 1, 2 and 4
TOL = 1e-5


def _shard(strategy, model_kwargs=None):
    return mf.fully_shard(
        make_model("net", **(model_kwargs or {})),
        make_optimizer("adamw"),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )




def _reference(steps):
    return train_reference(make_model("net"), "net", make_batches("net", steps, GLOBAL_BATCH), "adamw")


def save_worker(rank, world, *, strategy, path, steps=2):
    model, opt = _shard(strategy)
    train_steps(model, opt, make_batches("net", 4, GLOBAL_BATCH)[:steps], rank, world)
    mf.save_checkpoint(path, model, opt, extra_state={"iteration": steps, "rank": rank})
    return True


def resume_worker(rank, world, *, strategy, path, steps_done=2, total=4):
    model, opt = _shard(strategy)  # fresh model (same init seed is irrelevant: overwritten) and optimizer
    extra = mf.load_checkpoint(path, model, opt)
    train_steps(model, opt, make_batches("net", total, GLOBAL_BATCH)[steps_done:], rank, world)
    diff = max_param_diff(mf.get_full_state_dict(model), _reference(total))
    return diff, extra


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_equals_uninterrupted(pool2, tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    pool2.run(save_worker, strategy=strategy, path=path)
    assert not os.path.exists(path + ".tmp")
    results = pool2.run(resume_worker, strategy=strategy, path=path)
    for rank, (diff, extra) in enumerate(results):
        assert diff < TOL
        assert extra == {"iteration": 2, "rank": rank}


@pytest.mark.parametrize("target", ["optim_grads", "no_shard", "optim_grads_params"])
def test_reshard_from_4_ranks_zero3_to_2_ranks(pool4, pool2, tmp_path, target):
    path = str(tmp_path / "ckpt")
    pool4.run(save_worker, strategy="optim_grads_params", path=path)
    for diff, extra in pool2.run(resume_worker, strategy=target, path=path):
        assert diff < TOL
        assert extra["iteration"] == 2  # rank 0's extra state when the world size changed


def test_reshard_from_2_ranks_zero1_to_4_ranks_zero3(pool2, pool4, tmp_path):
    path = str(tmp_path / "ckpt")
    pool2.run(save_worker, strategy="optim", path=path)
    for diff, _ in pool4.run(resume_worker, strategy="optim_grads_params", path=path):
        assert diff < TOL


def fresh_optimizer_worker(rank, world, *, strategy, path):
    """An optimizer that never stepped: saved and loaded as such (its eager state: step 0)."""
    model, opt = _shard(strategy)
    mf.save_checkpoint(path, model, opt)
    model2, opt2 = _shard(strategy)
    mf.load_checkpoint(path, model2, opt2)
    no_state = all(float(st["step"]) == 0 for st in opt2.state.values())
    train_steps(model2, opt2, make_batches("net", 2, GLOBAL_BATCH), rank, world)
    return no_state, max_param_diff(mf.get_full_state_dict(model2), _reference(2))


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_fresh_optimizer_round_trip(pool2, tmp_path, strategy):
    for no_state, diff in pool2.run(fresh_optimizer_worker, strategy=strategy, path=str(tmp_path / "c")):
        assert no_state and diff < TOL


def upstream_dcp_flow_worker(rank, world, *, strategy, path):
    """The upstream README flow: dcp.save / dcp.load on the state dicts, then load_state_dict."""
    batches = make_batches("net", 4, GLOBAL_BATCH)
    model, opt = _shard(strategy)
    train_steps(model, opt, batches[:2], rank, world)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    model2, opt2 = _shard(strategy, model_kwargs=None)
    materialize_optimizer_state(opt2)  # a fresh optimizer has no state tensors to load into yet
    ckpt = {"model": model2.state_dict(), "optimizer": opt2.state_dict()}
    dcp.load(ckpt, checkpoint_id=path)
    model2.load_state_dict(ckpt["model"], strict=False)
    opt2.load_state_dict(ckpt["optimizer"])
    train_steps(model2, opt2, batches[2:], rank, world)
    return max_param_diff(mf.get_full_state_dict(model2), _reference(4))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_upstream_dcp_flow(pool2, tmp_path, strategy):
    assert max(pool2.run(upstream_dcp_flow_worker, strategy=strategy, path=str(tmp_path / "c"))) < TOL


def state_dict_keys_worker(rank, world, *, strategy):
    model, opt = _shard(strategy)
    train_steps(model, opt, make_batches("net", 1, GLOBAL_BATCH), rank, world)
    sd = model.state_dict()
    osd = opt.state_dict()
    kinds = {type(v).__name__ for v in sd.values()}
    state_kinds = {type(v).__name__ for s in osd["state"].values() for k, v in s.items() if k != "step"}
    keys = {k for s in osd["state"].values() for k in s}
    # keys carry upstream's module. prefix (issue 13)
    return list(sd) == ["module." + k for k in make_model("net").state_dict()], sorted(kinds), sorted(state_kinds), sorted(keys)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dicts_hold_dtensors_keyed_like_the_module(pool2, strategy):
    same_keys, kinds, state_kinds, keys = pool2.run(state_dict_keys_worker, strategy=strategy)[0]
    assert same_keys
    # no_shard: Replicate() DTensors, as upstream (issue 13)
    assert kinds == ["DTensor"] and state_kinds == ["DTensor"]
    assert keys == ["exp_avg", "exp_avg_sq", "step"]


def export_import_worker(rank, world, *, strategy, path):
    batches = make_batches("net", 3, GLOBAL_BATCH)
    model, opt = _shard(strategy)
    train_steps(model, opt, batches, rank, world)
    mf.save_full_state_dict(model, path)
    exported = torch.load(path)
    reference = _reference(3).state_dict()
    same_keys = list(exported) == list(reference)
    diff = max((exported[k] - reference[k]).abs().max().item() for k in reference)
    # import into a differently-initialised sharded model
    model2 = mf.fully_shard_model(make_model("net", seed=123), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    model2.load_state_dict(exported)
    reimported = mf.get_full_state_dict(model2)
    round_trip = all(torch.equal(reimported[k], exported[k]) for k in exported)
    # the compute weights follow: same forward output as the plain model
    plain = make_model("net")
    plain.load_state_dict(exported)
    x = torch.randn(3, 5)
    with torch.no_grad():
        same_forward = torch.allclose(model2(x), plain(x), atol=1e-6)
    return same_keys, diff, round_trip, same_forward


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_and_import_plain_state_dicts(pool2, tmp_path, strategy):
    for same_keys, diff, round_trip, same_forward in pool2.run(
        export_import_worker, strategy=strategy, path=str(tmp_path / "full.pt")
    ):
        assert same_keys and diff < TOL and round_trip and same_forward


def mismatch_worker(rank, world, *, path, case):
    model, opt = _shard("optim_grads_params")
    train_steps(model, opt, make_batches("net", 1, GLOBAL_BATCH), rank, world)  # the checkpoint holds optimizer state
    mf.save_checkpoint(path, model, opt)
    arch = {"shape": dict(d=9), "architecture": dict(depth=2), "corrupt": {}}[case]
    other, other_opt = _shard("optim_grads_params", model_kwargs=arch)
    before = mf.get_full_state_dict(other)
    state_before = len(other_opt.state)
    if case == "corrupt" and rank == 0:
        data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
        with open(os.path.join(path, data[0]), "r+b") as f:
            f.truncate(10)
    dist.barrier()
    try:
        mf.load_checkpoint(path, other, other_opt)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        message = f"{type(exc).__name__}: {exc}"
    after = mf.get_full_state_dict(other)
    untouched = all(torch.equal(before[k], after[k]) for k in before) and len(other_opt.state) == state_before
    return message, untouched


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("shape", r"StateDictMismatchError.*shape mismatch.*inp\.weight: checkpoint \(7, 5\) vs model \(9, 5\)"),
        ("architecture", r"StateDictMismatchError.*unexpected keys.*blocks\.2\.fc1\.weight"),
        ("corrupt", r"CheckpointReadError: the checkpoint .* is damaged: __\d+_\d+\.distcp .*unchanged"),
    ],
)
def test_mismatched_or_corrupt_checkpoint_is_a_clear_error(pool2, tmp_path, case, pattern):
    import re

    for message, untouched in pool2.run(mismatch_worker, path=str(tmp_path / "c"), case=case):
        assert re.search(pattern, message), message
        assert untouched


def state_dict_mismatch_worker(rank, world):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block])
    sd = make_model("net", d=9).state_dict()
    try:
        model.load_state_dict(sd)
    except mf.StateDictMismatchError as exc:
        return str(exc)
    return "no error"


def test_load_state_dict_names_keys_and_shapes(pool2):
    message = pool2.run(state_dict_mismatch_worker)[0]
    assert "nothing was loaded" in message and "inp.weight: checkpoint (9, 5) vs model (7, 5)" in message


def save_then_continue_worker(rank, world, *, strategy, path):
    """Saving must not disturb the live run (state_dict() hands out live dicts)."""
    batches = make_batches("net", 4, GLOBAL_BATCH)
    model, opt = _shard(strategy)
    train_steps(model, opt, batches[:2], rank, world)
    mf.save_checkpoint(path, model, opt)
    opt.state_dict()
    train_steps(model, opt, batches[2:], rank, world)
    return max_param_diff(mf.get_full_state_dict(model), _reference(4))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_saving_does_not_disturb_training(pool2, tmp_path, strategy):
    assert max(pool2.run(save_then_continue_worker, strategy=strategy, path=str(tmp_path / "c"))) < TOL
