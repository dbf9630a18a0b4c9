"""``optimizer.state_dict()`` in standard form (issues 13, 14): per-parameter state as
standard DTensors (whole rows split like torch.chunk, Replicate for no_shard) with
torch's key structure, no closures on any tensor; torch.save / torch.load resume
bit-exact; get_optimizer_state_dict(full_state_dict=True) equals a single-process
AdamW; DCP reshards across world sizes; a checkpoint in upstream's form loads;
load_checkpoint stages host copies and a failed load changes nothing."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves

import megatron_fsdp as mf
from conftest import get_pool
from megatron_fsdp.state.checkpoint import CheckpointReadError
from megatron_fsdp.state.model_state_dict import chunk_rows, clone_for_load, state_dicts_on
from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
from megatron_fsdp.utils import make_fsdp_dtensor
from models import Block, loss_fn, make_batches, make_model, make_optimizer, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
GLOBAL_BATCH = 8  # divisible by world sizes 1, 2 and 4
TOL = 1e-5
CLOSURE_ATTRS = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


def _shard(strategy):
    return mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                          zero_dp_strategy=strategy)




def _reference(steps):
    """Single-process model and AdamW after ``steps`` steps on the global batches."""
    model = make_model("net")
    opt = make_optimizer("adamw")(model.parameters())
    for x, y in make_batches("net", steps, GLOBAL_BATCH):
        opt.zero_grad()
        loss_fn("net", model(x), y).backward()
        opt.step()
    return model, opt


def _strip(key):
    return key[len("module."):] if key.startswith("module.") else key


def _full_state_diff(model, opt, ref_model, ref_opt) -> float:
    """Max difference between our full optimizer state (torch's DSD API) and the reference's."""
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    ref_state = {name: ref_opt.state[p] for name, p in ref_model.named_parameters()}
    if sorted(_strip(k) for k in full["state"]) != sorted(ref_state):
        return float("inf")
    diff = 0.0
    for key, state in full["state"].items():
        for name, value in state.items():
            diff = max(diff, (value.float() - ref_state[_strip(key)][name].float()).abs().max().item())
    return diff


# -- standard form ---------------------------------------------------------------------------
def form_worker(rank, world, *, strategy):
    model, opt = _shard(strategy)
    train_steps(model, opt, make_batches("net", 2, GLOBAL_BATCH), rank, world)
    ref_model, ref_opt = _reference(2)
    osd, ref = opt.state_dict(), ref_opt.state_dict()
    out = dict(ids=sorted(osd["state"]) == sorted(ref["state"]), groups=osd["param_groups"] == ref["param_groups"])
    rows_ok, placements, closures, diff = True, set(), False, 0.0
    for index, state in osd["state"].items():
        out.setdefault("keys", True)
        out["keys"] &= sorted(state) == sorted(ref["state"][index])
        out["step"] = not isinstance(state["step"], DTensor) and float(state["step"]) == float(ref["state"][index]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            placements.add(tuple(type(p).__name__ for p in value.placements))
            if isinstance(value.placements[-1], Shard):
                start, end = chunk_rows(value.shape[0], world, rank)
                rows_ok &= tuple(value.to_local().shape) == (end - start, *value.shape[1:])
            closures |= any(hasattr(value.to_local(), a) for a in CLOSURE_ATTRS)
            diff = max(diff, (value.full_tensor() - ref["state"][index][key]).abs().max().item())
    live_flat = all(v.to_local().dim() <= 1 for s in opt.state.values() for k, v in s.items() if k != "step")
    out.update(rows=rows_ok, closures=not closures, diff=diff < TOL,
               placements=placements == ({("Replicate",)} if strategy == "no_shard" else {("Shard",)}),
               live=live_flat or strategy == "no_shard")
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_is_standard_and_keyed_like_torch(pool2, strategy):
    for out in pool2.run(form_worker, strategy=strategy):
        assert all(out.values()), out


def full_state_worker(rank, world, *, strategy):
    model, opt = _shard(strategy)
    train_steps(model, opt, make_batches("net", 2, GLOBAL_BATCH), rank, world)
    return _full_state_diff(model, opt, *_reference(2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_get_optimizer_state_dict_full_equals_single_process(pool2, strategy):
    assert max(pool2.run(full_state_worker, strategy=strategy)) < TOL


# -- torch.save / torch.load -----------------------------------------------------------------
def pickle_resume_worker(rank, world, *, strategy):
    batches = make_batches("net", 4, GLOBAL_BATCH)
    model, opt = _shard(strategy)
    train_steps(model, opt, batches[:2], rank, world)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, blob)
    train_steps(model, opt, batches[2:], rank, world)  # the uninterrupted run
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2, opt2 = _shard(strategy)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    train_steps(model2, opt2, batches[2:], rank, world)
    mine, theirs = mf.get_full_state_dict(model), mf.get_full_state_dict(model2)
    states = [(opt.state[p][k], opt2.state[q][k]) for p, q in zip(model.parameters(), model2.parameters())
              for k in opt.state[p]]
    same_state = all(torch.equal(a.to_local() if isinstance(a, DTensor) else a,
                                 b.to_local() if isinstance(b, DTensor) else b) for a, b in states)
    return all(torch.equal(mine[k], theirs[k]) for k in mine) and same_state and len(states) > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_save_load_resumes_bit_exact(pool2, strategy):
    assert all(pool2.run(pickle_resume_worker, strategy=strategy))


# -- DCP: resharding across world sizes ------------------------------------------------------
def dcp_save_worker(rank, world, *, strategy, path):
    model, opt = _shard(strategy)
    train_steps(model, opt, make_batches("net", 2, GLOBAL_BATCH), rank, world)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    return True


def dcp_load_worker(rank, world, *, strategy, path):
    """Upstream's recipe: fresh model, fully_shard_optimizer, dcp.load, load_state_dict."""
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    opt = mf.fully_shard_optimizer(make_optimizer("adamw")(model.parameters()))
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(ckpt, checkpoint_id=path)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    state_diff = _full_state_diff(model, opt, *_reference(2))
    train_steps(model, opt, make_batches("net", 4, GLOBAL_BATCH)[2:], rank, world)
    ref_model, _ = _reference(4)
    full = mf.get_full_state_dict(model)
    return state_diff, max((full[n] - p.detach()).abs().max().item() for n, p in ref_model.named_parameters())


@pytest.mark.parametrize("source,target", [("optim_grads_params", "optim"), ("optim", "optim_grads_params"),
                                           ("no_shard", "optim_grads")])
def test_dcp_reshards_optimizer_state_from_2_to_4_and_1(pool2, pool4, tmp_path, source, target):
    path = str(tmp_path / "ckpt")
    pool2.run(dcp_save_worker, strategy=source, path=path)
    for pool in (pool4, get_pool(1)):
        for state_diff, weight_diff in pool.run(dcp_load_worker, strategy=target, path=path):
            assert state_diff < TOL and weight_diff < TOL


# -- a checkpoint written in upstream's form -------------------------------------------------
def _upstream_bounds(rows, world):
    """Row boundaries of an uneven split unlike torch.chunk's (upstream cuts its own)."""
    return [0] + [((r + 1) * rows) // (world + 1) for r in range(world - 1)] + [rows]


def upstream_save_worker(rank, world, *, path, ours):
    """Build upstream's checkpoint by hand: ``module.<name>`` keys with uneven
    make_fsdp_dtensor values, the optimizer keyed as torch's Optimizer.state_dict
    (integer ids, param_groups with params lists); also our own checkpoint."""
    ref_model, ref_opt = _reference(2)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    index = mf.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")

    def upstream(t):
        bounds = _upstream_bounds(t.shape[0], world)
        local = t.detach()[bounds[rank] : bounds[rank + 1]].reshape(-1).clone()
        return make_fsdp_dtensor(local, t, index, run_check=True, update_uneven_dtensor_chunk_meta=True)

    ref = ref_opt.state_dict()
    model_sd = {"module." + name: upstream(p) for name, p in ref_model.named_parameters()}
    osd = {"state": {i: {k: (v.clone() if k == "step" else upstream(v)) for k, v in s.items()}
                     for i, s in ref["state"].items()},
           "param_groups": copy.deepcopy(ref["param_groups"])}
    dcp.save({"model": model_sd, "optimizer": osd}, checkpoint_id=path)
    model, opt = _shard("optim_grads_params")
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=ours)
    # the same upstream-form state dicts loaded in memory (uneven DTensors: real extents)
    model.load_state_dict(model_sd)
    opt.load_state_dict(osd)
    return _full_state_diff(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize("target", ["optim_grads_params", "no_shard"])
def test_checkpoint_in_upstreams_form_loads(pool2, pool4, tmp_path, target):
    path, ours = str(tmp_path / "upstream"), str(tmp_path / "ours")
    assert max(pool2.run(upstream_save_worker, path=path, ours=ours)) < TOL
    keys = [set(dcp.FileSystemReader(p).read_metadata().state_dict_metadata) for p in (path, ours)]
    assert keys[0] == keys[1]  # the same flattened keys: optimizer.state.<id>.<key>, param_groups
    for pool in (pool2, pool4):
        for state_diff, weight_diff in pool.run(dcp_load_worker, strategy=target, path=path):
            assert state_diff < TOL and weight_diff < TOL


def ours_into_upstream_form_worker(rank, world, *, path):
    """The other way: our trained checkpoint read by upstream's recipe, i.e. dcp.load
    into upstream-form state dicts (``module.<name>`` keys, uneven make_fsdp_dtensor
    shards with their chunk metadata, torch's optimizer keys). Upstream's engine
    needs CUDA; its state-dict form does not."""
    model, opt = _shard("optim_grads_params")
    train_steps(model, opt, make_batches("net", 2, GLOBAL_BATCH), rank, world)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    ref_model, ref_opt = _reference(2)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    index = mf.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")

    def upstream_empty(t):
        bounds = _upstream_bounds(t.shape[0], world)
        local = torch.zeros_like(t.detach()[bounds[rank] : bounds[rank + 1]]).reshape(-1)
        return make_fsdp_dtensor(local, t, index, run_check=True, update_uneven_dtensor_chunk_meta=True)

    ref = ref_opt.state_dict()
    model_sd = {"module." + name: upstream_empty(p) for name, p in ref_model.named_parameters()}
    osd = {"state": {i: {k: (torch.zeros_like(v) if k == "step" else upstream_empty(v)) for k, v in s.items()}
                     for i, s in ref["state"].items()},
           "param_groups": copy.deepcopy(ref["param_groups"])}
    dcp.load({"model": model_sd, "optimizer": osd}, checkpoint_id=path)
    diff = max((uneven_dtensor_to_full_tensor(model_sd["module." + n]) - p.detach()).abs().max().item()
               for n, p in ref_model.named_parameters())
    for i, state in ref["state"].items():
        for key, value in state.items():
            got = osd["state"][i][key]
            got = got if key == "step" else uneven_dtensor_to_full_tensor(got)
            diff = max(diff, (got.float() - value.float()).abs().max().item())
    return diff


def test_our_checkpoint_loads_in_upstreams_form(pool2, tmp_path):
    for diff in pool2.run(ours_into_upstream_form_worker, path=str(tmp_path / "ours")):
        assert diff < TOL


# -- load_checkpoint stages host copies; a failed load changes nothing -----------------------
def staged_load_worker(rank, world, *, strategy, path):
    from test_patterns_checkpoint import _same, _snapshot

    import megatron_fsdp.state.checkpoint as checkpoint

    batches = make_batches("net", 3, GLOBAL_BATCH)
    model, opt = _shard(strategy)
    train_steps(model, opt, batches[:2], rank, world)
    mf.save_checkpoint(path, model, opt)
    train_steps(model, opt, batches[2:], rank, world)  # the live state moves on
    before = _snapshot(model, opt)
    live = {p.to_local().data_ptr() for p in model.parameters()}
    live |= {(v.to_local() if isinstance(v, DTensor) else v).data_ptr() for s in opt.state.values() for v in s.values()}
    staged, real_load = [], checkpoint.dcp.load

    def load_then_fail(state, checkpoint_id):
        real_load(state, checkpoint_id=checkpoint_id)  # fills whatever it was given
        for leaf in tree_leaves(state):
            if isinstance(leaf, torch.Tensor):
                local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
                staged.append(local.device.type == "cpu" and local.data_ptr() not in live)
        raise RuntimeError("simulated failure after the read")

    checkpoint.dcp.load = load_then_fail
    try:
        mf.load_checkpoint(path, model, opt)
        raised = False
    except CheckpointReadError:
        raised = True
    finally:
        checkpoint.dcp.load = real_load
    unchanged = _same(before, _snapshot(model, opt))
    mf.load_checkpoint(path, model, opt)
    # state_dicts_on builds the fresh pieces where it is told ("meta" here, to tell
    # them from host tensors); no_shard optimizer state is handed out live, as torch's
    with state_dicts_on("meta"):
        pieces = [v for v in model.state_dict().values() if isinstance(v, DTensor)]
        if strategy != "no_shard":
            pieces += [v for s in opt.state_dict()["state"].values() for k, v in s.items() if k != "step"]
    routed = bool(pieces) and all(v.to_local().device.type == "meta" for v in pieces)
    return raised, unchanged, bool(staged) and all(staged), routed, _full_state_diff(model, opt, *_reference(2))


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_load_checkpoint_stages_host_copies_and_fails_cleanly(pool2, tmp_path, strategy):
    for raised, unchanged, host, routed, diff in pool2.run(staged_load_worker, strategy=strategy,
                                                           path=str(tmp_path / "c")):
        assert raised and unchanged and host and routed and diff < TOL


def test_clone_for_load_is_a_host_copy():
    value = torch.arange(6.0).reshape(2, 3)
    clone = clone_for_load(value)
    assert clone.device.type == "cpu" and torch.equal(clone, value) and clone.data_ptr() != value.data_ptr()
    assert clone_for_load(3) == 3


# -- HSDP / HFSDP (optimizer state split across the outer group too) --------------------------
def hybrid_worker(rank, world, *, outer, path):
    import torch.distributed as dist

    from megatron_fsdp.comm.distributed_index import build_hybrid_mesh

    def shard():
        return mf.fully_shard(make_model("net"), make_optimizer("adamw"), device_mesh=build_hybrid_mesh("cpu", 2),
                              dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp",
                              hybrid_fsdp_group=dist.group.WORLD, fsdp_unit_modules=[Block],
                              zero_dp_strategy="optim_grads_params", outer_dp_sharding_strategy=outer)

    batches = make_batches("net", 4, GLOBAL_BATCH)
    model, opt = shard()
    train_steps(model, opt, batches[:2], rank, world)
    diff = _full_state_diff(model, opt, *_reference(2))
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    model2, opt2 = shard()
    model2.load_state_dict(model.state_dict())
    blob.seek(0)
    opt2.load_state_dict(torch.load(blob, weights_only=False))
    train_steps(model, opt, batches[2:], rank, world)
    train_steps(model2, opt2, batches[2:], rank, world)
    mine, theirs = mf.get_full_state_dict(model), mf.get_full_state_dict(model2)
    return diff, all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hybrid_state_dict_round_trips_and_reshards(pool4, pool2, tmp_path, outer):
    path = str(tmp_path / "ckpt")
    for diff, exact in pool4.run(hybrid_worker, outer=outer, path=path):
        assert diff < TOL and exact
    for state_diff, weight_diff in pool2.run(dcp_load_worker, strategy="optim_grads", path=path):
        assert state_diff < TOL and weight_diff < TOL
