"""Public API behaviour: what the wrapper exposes, collective counts, bad input."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from models import Block, backward_microbatches, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _train_step(model, opt, x, y, rank, world):
    opt.zero_grad()
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()


# -- collective counts -------------------------------------------------------------
def count_worker(rank, world, *, strategy, microbatches):
    model, opt = mf.fully_shard(
        make_model("net"), make_optimizer("sgd"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    batches = make_batches("net", 2, batch=4 * world * microbatches)
    _train_step(model, opt, *batches[0], rank, world)  # first step records the forward order
    x, y = batches[1]
    with mf.record_collectives() as rec:
        opt.zero_grad()
        backward_microbatches(model, x, y, rank, world, microbatches)
        opt.step()
        model.finish_param_sync()
    return dict(rec.counts)


# Net with Block units: two root groups (inp, out: one per top-level module) + 3 unit groups.
EXPECTED = {
    # ZeRO-3: forward gathers the 2 root groups + 3 units; backward re-gathers the
    # units except the last one, which stays gathered from its forward to its backward.
    ("optim_grads_params", 1): {"all_gather": 7, "reduce_scatter": 5},
    # Two microbatches (the first under no_sync): the root groups stay gathered
    # between them (hooks.py [Note: root groups across micro batches]): 7 + 5.
    ("optim_grads_params", 2): {"all_gather": 12, "reduce_scatter": 10},
    # ZeRO-2: reduce-scatter every microbatch, refresh weights once after the step.
    ("optim_grads", 1): {"all_gather": 5, "reduce_scatter": 5},
    ("optim_grads", 2): {"all_gather": 5, "reduce_scatter": 10},
    # ZeRO-1: one reduce-scatter per step, whatever the microbatch count.
    ("optim", 1): {"all_gather": 5, "reduce_scatter": 5},
    ("optim", 2): {"all_gather": 5, "reduce_scatter": 5},
    # ZeRO-0: the units merge into one communication unit, the root modules into
    # another (units.NO_SHARD_UNIT_SIZE), and each all-reduces once per step.
    ("no_shard", 1): {"all_reduce": 2},
    ("no_shard", 2): {"all_reduce": 2},
}


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collective_counts(pool2, strategy, microbatches):
    counts = pool2.run(count_worker, strategy=strategy, microbatches=microbatches)
    assert counts[0] == counts[1] == EXPECTED[(strategy, microbatches)]


# -- what the wrapper exposes ----------------------------------------------------------
def exposure_worker(rank, world, *, strategy):
    reference = make_model("net")
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    names = [n for n, _ in model.named_parameters()]
    kinds = {type(p).__name__ if not isinstance(p, DTensor) else "DTensor" for p in model.parameters()}
    inner_dtensors = any(isinstance(p, DTensor) for p in model.module.parameters())
    shapes_match = all(
        p.shape == reference.get_parameter(n).shape for n, p in model.named_parameters()
    )
    return dict(
        names_match=names == [n for n, _ in reference.named_parameters()],
        state_keys_match=list(model.state_dict()) == ["module." + k for k in reference.state_dict()],
        kinds=sorted(kinds),
        inner_dtensors=inner_dtensors,
        shapes_match=shapes_match,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_are_distributed_main_weights(pool2, strategy):
    out = pool2.run(exposure_worker, strategy=strategy)[0]
    assert out["names_match"] and out["state_keys_match"] and out["shapes_match"]
    assert out["kinds"] == ["DTensor"]  # no_shard: Replicate() DTensors, as upstream
    assert out["inner_dtensors"]  # between steps the module's parameters are the distributed ones


def fresh_optimizer_worker(rank, world, *, strategy):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    before = {n: mf.get_full_state_dict(model)[n].clone() for n, _ in model.named_parameters()}
    opt = mf.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
    after = mf.get_full_state_dict(model)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    steps = {float(st["step"]) for st in opt.state.values()}
    return dict(unchanged=unchanged, state=len(opt.state), params=len(list(model.parameters())), steps=steps)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fully_shard_optimizer_leaves_optimizer_fresh(pool2, strategy):
    """No weight moves and no step is counted; the state exists eagerly (zero
    moments, step 0) so that DCP can load into it (issue 14)."""
    out = pool2.run(fresh_optimizer_worker, strategy=strategy)
    assert all(o["unchanged"] and o["state"] == o["params"] and o["steps"] == {0.0} for o in out), out


def manual_sync_worker(rank, world, *, strategy):
    """Auto-sync off: the optimizer step finishes the gradient sync itself."""
    base = make_model("net")
    batches = make_batches("net", 3, batch=4 * world)
    reference = train_reference(base, "net", batches, "sgd")
    model, opt = mf.fully_shard(
        base, make_optimizer("sgd"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        sync_model_each_microbatch=False,
    )
    for x, y in batches:
        _train_step(model, opt, x, y, rank, world)
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_manual_sync(pool2, strategy):
    assert max(pool2.run(manual_sync_worker, strategy=strategy)) < 1e-5


def grad_methods_worker(rank, world, *, strategy):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()

    def local(p):
        return (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()

    grads = [local(p) for p in model.parameters()]
    model.scale_gradients(0.5)
    model.param_and_grad_buffer.attach_grads()
    halved = all(torch.allclose(local(p), g * 0.5) for p, g in zip(model.parameters(), grads))
    model.zero_grad_buffer()
    model.param_and_grad_buffer.attach_grads()
    zeroed = all(bool((local(p) == 0).all()) for p in model.parameters())
    nonzero_before = any(bool(g.abs().sum() > 0) for g in grads)
    return halved and zeroed and nonzero_before


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scale_and_zero_gradients(pool2, strategy):
    assert all(pool2.run(grad_methods_worker, strategy=strategy))


def broadcast_worker(rank, world, *, strategy):
    torch.manual_seed(rank)  # ranks start different
    model = mf.fully_shard_model(make_model("net", seed=rank), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    model.broadcast_params()
    full = mf.get_full_state_dict(model)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, full)
    same = all(torch.equal(gathered[0][k], gathered[r][k]) for r in range(world) for k in full)
    return same


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_broadcast_params(pool2, strategy):
    assert all(pool2.run(broadcast_worker, strategy=strategy))


def eval_worker(rank, world, *, strategy):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    reference = make_model("net").eval()
    x = torch.randn(6, 5)
    model.eval()
    with torch.no_grad():
        out = model(x)
    acct = model.buffer_accounting
    return dict(
        close=torch.allclose(out, reference(x), atol=1e-6),
        temporary=acct.temporary,
        peak=acct.peak_temporary,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eval_under_no_grad_frees_gathered_weights(pool2, strategy):
    for out in pool2.run(eval_worker, strategy=strategy):
        assert out["close"]
        assert out["temporary"] == 0
        if strategy == "optim_grads_params":
            assert out["peak"] > 0


# -- bad input ---------------------------------------------------------------------
def bad_input_worker(rank, world, *, case):
    try:
        if case == "strategy":
            mf.fully_shard_model(make_model("net"), zero_dp_strategy="zero4")
        elif case == "unit_path":
            mf.fully_shard_model(make_model("net"), fsdp_unit_modules=["not.a.module.Path"])
        elif case == "unit_type":
            mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[42])
        elif case == "no_params":
            mf.fully_shard_model(nn.ReLU())
        elif case == "device":
            with torch.device("meta"):
                m = make_model("net")
            mf.fully_shard_model(m, device="cpu")
        elif case == "outer":
            mf.fully_shard_model(make_model("net"), zero_dp_strategy=2, outer_dp_sharding_strategy="optim")
        elif case == "outer_value":
            mf.fully_shard_model(make_model("net"), outer_dp_sharding_strategy="optim_grads")
        elif case == "unit_absent":
            mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[nn.Conv2d])
        elif case == "optimizer":
            mf.fully_shard_optimizer(torch.optim.SGD(make_model("net").parameters(), lr=0.1))
        elif case == "lazy":
            mf.fully_shard_model(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1)))
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("strategy", r"zero_dp_strategy='zero4'.*no_shard.*optim_grads_params"),
        ("unit_path", r"not\.a\.module\.Path.*importable"),
        ("unit_type", r"42.*nn\.Module subclass"),
        ("no_params", r"ReLU has no parameters"),
        ("device", r"'inp\.weight' is on meta.*device=cpu"),
        ("outer", r"HFSDP.*optim_grads_params"),
        ("outer_value", r"outer_dp_sharding_strategy='optim_grads'.*no_shard.*optim"),
        ("unit_absent", r"Conv2d"),
        ("optimizer", r"does not belong to a MegatronFSDP model"),
        ("lazy", r"'0\.weight' is not initialised yet.*forward on a dummy batch before wrapping"),
    ],
)
def test_bad_input(pool2, case, pattern):
    import re

    msg = pool2.run(bad_input_worker, case=case)[0]
    assert re.search(pattern, msg), msg


def whole_model_unit_worker(rank, world):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_fsdp").addHandler(handler)
    logging.getLogger("megatron_fsdp").setLevel(logging.INFO)
    try:
        model = mf.fully_shard_model(make_model("net"), zero_dp_strategy=3)
    finally:
        logging.getLogger("megatron_fsdp").removeHandler(handler)
    return [r.getMessage() for r in records if "one FSDP unit" in r.getMessage()], len(model.units)


def test_no_units_treats_whole_model_as_one_unit(pool2):
    messages, units = pool2.run(whole_model_unit_worker)[0]
    assert len(messages) == 1 and units == 1


# -- buffer accounting ---------------------------------------------------------------
def accounting_worker(rank, world, *, strategy):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    padded = sum(g.layout.padded_numel for g in model.param_and_grad_buffer.groups)
    return dict(model.buffer_accounting.persistent), padded * 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_bytes_follow_zero_formula(pool2, strategy):
    persistent, full = pool2.run(accounting_worker, strategy=strategy)[0]
    shards = {"no_shard": (1, 1, 1), "optim": (1, 2, 1), "optim_grads": (1, 2, 2), "optim_grads_params": (2, 2, 2)}
    weights, _, grads = shards[strategy]
    # fp32 model: the model weights are the main weights, no second copy.
    assert persistent == {"model_weights": full // weights, "main_grads": full // grads}


def grad_norm_worker(rank, world, *, strategy):
    """Clipping over the optimizer's parameters (a common pattern) sees the global norm."""
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    reference = make_model("net")
    x, y = make_batches("net", 1, batch=4 * world)[0]
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    loss_fn("net", reference(x), y).backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1e9)
    return abs(norm.item() - expected.item())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_norm_over_optimizer_params_is_global(pool2, strategy):
    assert max(pool2.run(grad_norm_worker, strategy=strategy)) < 1e-5
