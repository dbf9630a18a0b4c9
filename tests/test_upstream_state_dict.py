"""Upstream-compatible state dicts: standard DTensors whose ``full_tensor()`` and
``get_model_state_dict(full_state_dict=True)`` give the single-process weights,
``module.``-prefixed keys (both forms load), ``Replicate()`` for no_shard,
``torch.save``-able values, tied-weight aliases, and DCP resharding."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

import megatron_fsdp as mf
from megatron_fsdp.state.model_state_dict import chunk_rows
from models import Block, loss_fn, make_batches, make_model, make_optimizer, train_reference

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
GLOBAL_BATCH = 8
TOL = 1e-5


def _trained(kind, strategy, rank, world, steps=2):
    model, opt = mf.fully_shard(
        make_model(kind), make_optimizer("adamw"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    for x, y in make_batches(kind, steps, GLOBAL_BATCH):
        opt.zero_grad()
        loss_fn(kind, model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return model, opt


def _reference(kind, steps=2):
    return train_reference(make_model(kind), kind, make_batches(kind, steps, GLOBAL_BATCH), "adamw")


def _strip(key):
    return key[len("module."):] if key.startswith("module.") else key


def full_tensor_worker(rank, world, *, kind, strategy):
    model, _ = _trained(kind, strategy, rank, world)
    reference = _reference(kind).state_dict()
    sd = model.state_dict()
    keys_ok = sorted(sd) == sorted("module." + k for k in reference)
    diffs, kinds = {}, set()
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        kinds.add(tuple(type(p).__name__ for p in value.placements))
        full = value.full_tensor()
        ref = reference[_strip(key)]
        assert full.shape == ref.shape, (key, full.shape, ref.shape)
        diffs[key] = (full - ref).abs().max().item()
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    dsd_diff = max((full_sd[k] - reference[_strip(k)]).abs().max().item() for k in full_sd)
    return keys_ok, max(diffs.values()), sorted(kinds), dsd_diff, sorted(full_sd) == sorted(sd)


@pytest.mark.parametrize("kind", ["net", "tied"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_tensor_equals_single_process(pool, kind, strategy):
    for keys_ok, diff, kinds, dsd_diff, dsd_keys in pool.run(full_tensor_worker, kind=kind, strategy=strategy):
        assert keys_ok  # module.<name>, tied aliases included, as upstream
        assert diff < TOL
        assert dsd_diff < TOL and dsd_keys
        if strategy == "no_shard":
            assert kinds == [("Replicate",)]
        else:
            assert ("Shard",) in kinds  # rows split like torch.chunk


def local_layout_worker(rank, world, *, strategy):
    model, _ = _trained("net", strategy, rank, world, steps=1)
    out = {}
    for key, value in model.state_dict().items():
        if value.dim() and isinstance(value.placements[-1], Shard):
            start, end = chunk_rows(value.shape[0], world, rank)
            out[key] = tuple(value.to_local().shape) == (end - start, *value.shape[1:])
    return out


def test_local_shards_are_whole_row_chunks(pool4):
    for result in pool4.run(local_layout_worker, strategy="optim_grads_params"):
        assert result and all(result.values())


def torch_save_worker(rank, world, *, strategy):
    model, _ = _trained("tied", strategy, rank, world)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # no closures on the tensors
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh, _ = _trained("tied", strategy, rank, world, steps=0)
    fresh.load_state_dict(loaded)
    mine, theirs = mf.get_full_state_dict(model), mf.get_full_state_dict(fresh)
    return all(torch.equal(mine[k], theirs[k]) for k in mine), "head.weight" in mine


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_save_round_trip(pool2, strategy):
    for equal, alias in pool2.run(torch_save_worker, strategy=strategy):
        assert equal and alias


def key_forms_worker(rank, world, *, strategy):
    reference = _reference("net")
    results = []
    for prefixed in (False, True):
        model, _ = _trained("net", strategy, rank, world, steps=0)
        sd = {("module." + k if prefixed else k): v for k, v in reference.state_dict().items()}
        model.load_state_dict(sd)
        full = mf.get_full_state_dict(model)
        results.append(max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    # the DTensor form through torch's own loader: set_model_state_dict distributes
    # the full tensors with our state dict's placements
    model, _ = _trained("net", strategy, rank, world, steps=0)
    full_in = {"module." + k: v for k, v in reference.state_dict().items()}
    set_model_state_dict(model, full_in, options=StateDictOptions(full_state_dict=True))
    full = mf.get_full_state_dict(model)
    results.append(max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    return results


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_accepts_both_key_forms(pool2, strategy):
    for diffs in pool2.run(key_forms_worker, strategy=strategy):
        assert diffs == [0.0, 0.0, 0.0]


def key_twice_worker(rank, world):
    model, _ = _trained("net", "optim_grads_params", rank, world, steps=0)
    reference = _reference("net").state_dict()
    both = {**{"module." + k: v for k, v in reference.items()}, **{k: v + 1 for k, v in reference.items()}}
    before = mf.get_full_state_dict(model)
    try:
        model.load_state_dict(both)
    except mf.StateDictMismatchError as exc:
        unchanged = all(torch.equal(before[k], v) for k, v in mf.get_full_state_dict(model).items())
        return str(exc), unchanged
    return "loaded", False


def test_a_key_given_twice_with_different_values_is_refused(pool2):
    """``module.<name>`` and ``<name>`` with different values: which to load is
    ambiguous, so nothing is loaded (the unprefixed one used to win silently)."""
    for message, unchanged in pool2.run(key_twice_worker):
        assert "name the same tensor with different values" in message and unchanged, message


def dcp_save_worker(rank, world, *, strategy, path):
    model, _ = _trained("net", strategy, rank, world)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return True


def dcp_load_worker(rank, world, *, strategy, path):
    model, _ = _trained("net", strategy, rank, world, steps=0)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    full = mf.get_full_state_dict(model)
    reference = _reference("net").state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("source,target", [("optim_grads_params", "optim"), ("no_shard", "optim_grads_params")])
def test_dcp_reshards_model_state(pool2, pool4, tmp_path, source, target):
    path = str(tmp_path / "ckpt")
    pool2.run(dcp_save_worker, strategy=source, path=path)
    for diff in pool4.run(dcp_load_worker, strategy=target, path=path):
        assert diff < TOL


def replicate_params_worker(rank, world):
    model, _ = _trained("net", "no_shard", rank, world, steps=1)
    kinds = set()
    for p in model.parameters():
        kinds.add(type(p).__name__ if not isinstance(p, DTensor) else tuple(type(q).__name__ for q in p.placements))
        if p.grad is not None:
            kinds.add(("grad",) + (tuple(type(q).__name__ for q in p.grad.placements) if isinstance(p.grad, DTensor) else ("plain",)))
    return sorted(kinds, key=str)


def test_no_shard_parameters_are_replicate_dtensors(pool2):
    for kinds in pool2.run(replicate_params_worker):
        assert kinds == [("Replicate",), ("grad", "Replicate")]


# -- torch.distributed.checkpoint.state_dict: the FSDP2/DDP recipe ------------------------------
def _continue(model, opt, rank, world, batches):
    for x, y in batches:
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()


def torch_state_dict_api_worker(rank, world, *, strategy, full, directory):
    """get_state_dict(model, optimizer) after 2 steps, into a fresh model (sharded
    through dcp.save/dcp.load, or full on every rank), 2 more steps: equal to 4
    uninterrupted steps. [Note: two names under DCP's state_dict API]"""
    batches = make_batches("net", 4, GLOBAL_BATCH)
    whole, whole_opt = _trained("net", strategy, rank, world, steps=4)
    model, opt = _trained("net", strategy, rank, world, steps=2)
    options = StateDictOptions(full_state_dict=full)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    if not full:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    torch.manual_seed(7)
    fresh, fresh_opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                                      zero_dp_strategy=strategy)
    with torch.no_grad():  # make sure the load, not the seed, gives the weights
        for p in fresh.parameters():
            p.add_(1.0)
    fresh.install_optimized_model_weights()
    if not full:
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=directory)
        model_sd, optim_sd = loaded["model"], loaded["optim"]
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    _continue(fresh, fresh_opt, rank, world, batches[2:])
    a, b = mf.get_full_state_dict(fresh), mf.get_full_state_dict(whole)
    return max((a[k] - b[k]).abs().max().item() for k in b), sorted(optim_sd["state"])[:1]


@pytest.mark.parametrize("full", [False, True], ids=["sharded_dcp", "full"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_state_dict_api_resumes_exactly(pool2, tmp_path, strategy, full):
    """torch's set_state_dict takes our own checkpoint, sharded or full (a refusal would
    read 'Missing optimizer state for parameter module.inp.weight')."""
    for diff, first_key in pool2.run(torch_state_dict_api_worker, strategy=strategy, full=full,
                                     directory=str(tmp_path / "ckpt")):
        assert diff < TOL and first_key == ["blocks.0.fc1.bias"], (diff, first_key)



class NormFirst(torch.nn.Module):
    """A LayerNorm walked before the first matrix: its 1-D weights are where torch's
    chunk-row copy could land silently ([Note: broadcast_from_rank0])."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(2)
        self.a = torch.nn.Linear(2, 6)
        self.b = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.norm(x))))


def _full_values(state):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}


def broadcast_from_rank0_worker(rank, world, *, strategy):
    """Model: loaded exactly under no_shard, refused before any write under the
    sharded strategies. Optimizer: its state dict is standard DTensors, so
    set_optimizer_state_dict(broadcast_from_rank0=True) resumes exactly."""
    torch.manual_seed(0)
    source = NormFirst()
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn_like(p))
    full = {k: v.clone() for k, v in source.state_dict().items()}
    model, _ = mf.fully_shard(NormFirst(), make_optimizer("adamw"), zero_dp_strategy=strategy)
    before = _full_values(mf.get_full_state_dict(model))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:
        set_model_state_dict(model, dict(full) if rank == 0 else {}, options=options)
        message = "no error"
    except NotImplementedError as exc:
        message = str(exc)
    after = _full_values(mf.get_full_state_dict(model))
    loaded = max((after[k] - full[k]).abs().max().item() for k in full)
    unchanged = all(torch.equal(after[k], before[k]) for k in full)

    batches = make_batches("net", 4, GLOBAL_BATCH)
    whole, whole_opt = _trained("net", strategy, rank, world, steps=4)
    trained, trained_opt = _trained("net", strategy, rank, world, steps=2)
    model_sd, optim_sd = get_state_dict(trained, trained_opt, options=StateDictOptions(full_state_dict=True))
    fresh, fresh_opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                                      zero_dp_strategy=strategy)
    set_model_state_dict(fresh, model_sd, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(fresh, fresh_opt, optim_sd if rank == 0 else {}, options=options)
    _continue(fresh, fresh_opt, rank, world, batches[2:])
    a, b = _full_values(mf.get_full_state_dict(fresh)), _full_values(mf.get_full_state_dict(whole))
    return message, loaded, unchanged, max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_broadcast_from_rank0(pool2, strategy):
    """broadcast_from_rank0 loads every strategy's pieces: torch.chunk rows written into
    the LayerNorm's flat pieces would give wrong weights and then a size mismatch."""
    for message, loaded, unchanged, resumed in pool2.run(broadcast_from_rank0_worker, strategy=strategy):
        if strategy == "no_shard":
            assert message == "no error" and loaded == 0.0, (message, loaded)
        else:
            assert "broadcast_from_rank0" in message and "full_state_dict=True" in message, message
            assert unchanged
        assert resumed < TOL, resumed


class _WithExtraState(torch.nn.Linear):
    """A module with extra state (TransformerEngine keeps its FP8 metadata so)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counter = 0

    def get_extra_state(self):
        return {"counter": self.counter}

    def set_extra_state(self, state):
        self.counter = state["counter"]


def extra_state_worker(rank, world, *, strategy, preproc, path):
    """[Note: extra state] upstream's rule for ``<name>._extra_state``, then a DCP save
    and load (through DSD too) that carries it."""
    def build():
        torch.manual_seed(0)
        module = torch.nn.Sequential(_WithExtraState(4, 5), torch.nn.Linear(5, 3))
        return module, mf.fully_shard_model(module, fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy=strategy,
                                            preproc_state_dict_for_dcp_ckpt=preproc)

    module, model = build()
    module[0].counter = 7
    keys = sorted(k for k in model.state_dict() if k.endswith("_extra_state"))
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    module2, model2 = build()
    state = {"model": model2.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model2.load_state_dict(state["model"])
    via_dcp = module2[0].counter
    module3, model3 = build()
    set_model_state_dict(model3, get_model_state_dict(model))  # DSD's own walk
    return keys, via_dcp, module3[0].counter


@pytest.mark.parametrize("strategy, preproc", [("no_shard", True), ("optim_grads_params", False),
                                               ("optim_grads_params", True)])
def test_extra_state_follows_upstream(pool2, tmp_path, strategy, preproc):
    # Upstream's fully_shard drops *_extra_state only with preproc_state_dict_for_dcp_ckpt
    # under a sharded strategy; we used to drop it always (and refuse it on load).
    kept = not preproc or strategy == "no_shard"
    for keys, via_dcp, via_dsd in pool2.run(extra_state_worker, strategy=strategy, preproc=preproc,
                                            path=str(tmp_path / "ckpt")):
        assert keys == (["module.0._extra_state"] if kept else [])
        assert (via_dcp, via_dsd) == ((7, 7) if kept else (0, 0))


def extra_state_load_worker(rank, world):
    torch.manual_seed(0)
    module = torch.nn.Sequential(_WithExtraState(4, 5), torch.nn.Linear(5, 3))
    plain = {"module." + k: v for k, v in module.state_dict().items()}
    plain["module.0._extra_state"] = {"counter": 3}
    model = mf.fully_shard_model(module, fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy="optim_grads_params")
    result = model.load_state_dict(plain, strict=True)  # dropped on save, still set on load
    return module[0].counter, list(result.missing_keys), list(result.unexpected_keys)


def test_extra_state_in_a_checkpoint_is_loaded(pool2):
    assert pool2.run(extra_state_load_worker) == [(3, [], [])] * 2
