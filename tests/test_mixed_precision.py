"""Mixed precision: bf16/fp16 compute with fp32 main weights and gradients, the wire
dtype of gradient collectives, temporary communication buckets, NaN checks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from models import Block, loss_fn, make_batches, make_model

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LR = 0.1
MP_TOL = 1.5e-3


def emulate(model: nn.Module, batches, compute_dtype, *, master_dtype=torch.float32, comm_switch=None):
    """Single process: fp32 master weights, a low-precision compute copy, fp32 grads."""
    compute = copy.deepcopy(model).to(compute_dtype)
    master = [p.detach().to(master_dtype).clone() for p in compute.parameters()]
    for x, y in batches:
        with torch.no_grad():
            for p, m in zip(compute.parameters(), master):
                p.copy_(m)
        compute.zero_grad()
        loss_fn("net", compute(x.to(compute_dtype)), y.to(compute_dtype)).backward()
        with torch.no_grad():
            for p, m in zip(compute.parameters(), master):
                m.sub_(LR * p.grad.to(master_dtype))
    return {name: m for (name, _), m in zip(compute.named_parameters(), master)}


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _train(model, opt, batches, rank, world, dtype, context=None):
    for x, y in batches:
        with context() if context is not None else torch.enable_grad():
            opt.zero_grad()
            xs, ys = x.chunk(world)[rank].to(dtype), y.chunk(world)[rank].to(dtype)
            loss_fn("net", model(xs), ys).backward()
            opt.step()


def _max_diff(model, expected):
    full = mf.get_full_state_dict(model)
    return max((full[k].float() - v.float()).abs().max().item() for k, v in expected.items())


def mp_parity_worker(rank, world, *, strategy, compute, comm, steps=4):
    dtype = getattr(torch, compute)
    base = make_model("net")
    batches = make_batches("net", steps, batch=4 * world)
    expected = emulate(base, batches, dtype)
    policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=comm)
    model, opt = mf.fully_shard(
        copy.deepcopy(base).to(dtype), _sgd, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=policy,
    )
    _train(model, opt, batches, rank, world, dtype)
    sd = model.state_dict()
    main_dtypes = {(v.to_local() if isinstance(v, DTensor) else v).dtype for v in sd.values()}
    with model.compute_params_registered() as module:
        compute_dtypes = {p.dtype for p in module.parameters()}
    return _max_diff(model, expected), sorted(map(str, main_dtypes)), sorted(map(str, compute_dtypes))


@pytest.mark.parametrize("comm", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_compute_fp32_main(pool, strategy, comm):
    for diff, main_dtypes, compute_dtypes in pool.run(mp_parity_worker, strategy=strategy, compute="bfloat16", comm=comm):
        assert diff < MP_TOL
        assert main_dtypes == ["torch.float32"]  # state_dict exposes the main weights
        assert compute_dtypes == ["torch.bfloat16"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_compute_fp32_main(pool2, strategy):
    for diff, _, compute_dtypes in pool2.run(mp_parity_worker, strategy=strategy, compute="float16", comm="fp32"):
        assert diff < MP_TOL and compute_dtypes == ["torch.float16"]


def comm_switch_worker(rank, world, *, strategy):
    dtype = torch.bfloat16
    base = make_model("net")
    batches = make_batches("net", 4, batch=4 * world)
    expected = emulate(base, batches, dtype)
    fp32_comm = mf.MixedPrecisionPolicy(main_grads_dtype="fp32", grad_comm_dtype="fp32")
    bf16_comm = mf.MixedPrecisionPolicy(grad_comm_dtype="bf16")  # upstream's form: main dtypes left default
    model, opt = mf.fully_shard(
        copy.deepcopy(base).to(dtype), _sgd, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=fp32_comm,
    )
    with mf.record_collectives() as rec:
        _train(model, opt, batches[:2], rank, world, dtype)
        fp32_bytes = sum(rec.bytes[k] for k in ("reduce_scatter", "all_reduce"))
        rec.reset()
        _train(model, opt, batches[2:], rank, world, dtype,
               context=lambda: model.mixed_precision_context(mixed_precision_policy=bf16_comm))
        bf16_bytes = sum(rec.bytes[k] for k in ("reduce_scatter", "all_reduce"))
    restored = model.mp_policy.grad_comm_dtype
    # As upstream, the main dtypes stay those of construction.
    model.reset_mixed_precision_policy(mf.MixedPrecisionPolicy(main_grads_dtype="bf16"))
    kept = (model.mp_policy.main_params_dtype, model.mp_policy.main_grads_dtype)
    return _max_diff(model, expected), fp32_bytes, bf16_bytes, str(restored), kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_change_grad_comm_dtype_between_steps(pool2, strategy):
    for diff, fp32_bytes, bf16_bytes, restored, kept in pool2.run(comm_switch_worker, strategy=strategy):
        assert diff < MP_TOL
        assert bf16_bytes * 2 == fp32_bytes  # the wire dtype really changed
        assert restored == "torch.float32"  # the context restores the previous wire dtype
        assert kept == (torch.float32, torch.float32)


def bucket_worker(rank, world, *, strategy, comm):
    model, opt = mf.fully_shard(
        make_model("net").to(torch.bfloat16), _sgd, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=mf.MixedPrecisionPolicy(main_grads_dtype="fp32", grad_comm_dtype=comm),
    )
    acct = model.buffer_accounting
    x, y = make_batches("net", 1, batch=4 * world)[0]
    acct.reset_peak()
    loss_fn("net", model(x.to(torch.bfloat16)), y.to(torch.bfloat16)).backward()
    padded = sum(g.layout.padded_numel for g in model.param_and_grad_buffer.grad_groups)
    largest = max(g.layout.padded_numel for g in model.param_and_grad_buffer.grad_groups)
    return dict(
        temporary_after=acct.temporary,
        peak=acct.peak_temporary,
        main_grads=acct.persistent["main_grads"],
        padded=padded,
        largest=largest,
    )


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_comm_bucket_lives_only_for_the_collective(pool2, strategy):
    out = pool2.run(bucket_worker, strategy=strategy, comm="bf16")[0]
    assert out["temporary_after"] == 0  # released after the collective
    assert out["main_grads"] == 4 * out["padded"]  # one persistent fp32 buffer, no second one
    # Only bf16 wire copies (and, for ZeRO-1, their bf16 output shards) are ever
    # temporary; with overlap every group's collective may be in flight at once.
    shard_outputs = 2 * out["padded"] // 2 if strategy == "optim" else 0
    assert 0 < out["peak"] <= 2 * out["padded"] + shard_outputs


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_no_extra_memory_when_dtypes_equal(pool2, strategy):
    out = pool2.run(bucket_worker, strategy=strategy, comm="fp32")[0]
    assert out["temporary_after"] == 0 and out["peak"] == 0


def nan_worker(rank, world, *, strategy, mode):
    module = make_model("net")
    target = module.blocks[1].fc1.weight  # the compute parameter: the one autograd reaches
    model = mf.fully_shard_model(
        module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        check_for_nan_in_grad=mode == "check", report_nan_in_param_grad=mode == "report",
    )
    if rank == 1:
        target.register_hook(lambda g: g * float("nan"))
    x, y = make_batches("net", 1, batch=4 * world)[0]
    try:
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        model.finish_grad_sync()
    except FloatingPointError as exc:
        return "raised", str(exc), isinstance(exc, ValueError)
    return "not raised", model.last_nan_report, False


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["check", "report"])
def test_nan_in_grad_raises_on_every_rank(pool2, strategy, mode):
    """check_for_nan_in_grad and upstream's report_nan_in_param_grad=True (which raises a
    ValueError there; it used to only log here, and the step went on with NaN weights)."""
    for kind, message, is_value_error in pool2.run(nan_worker, strategy=strategy, mode=mode):
        assert kind == "raised" and is_value_error
        assert "rank 1: blocks.1.fc1.weight" in message


def main_as_model_weights_worker(rank, world, *, strategy):
    """main_params_dtype=None: the bf16 compute weights are the main weights."""
    base = make_model("net")
    batches = make_batches("net", 3, batch=4 * world)
    expected = emulate(base, batches, torch.bfloat16, master_dtype=torch.bfloat16)
    model, opt = mf.fully_shard(
        copy.deepcopy(base).to(torch.bfloat16), _sgd, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=mf.MixedPrecisionPolicy(main_params_dtype=None),
    )
    _train(model, opt, batches, rank, world, torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    return _max_diff(model, expected), sorted(map(str, dtypes)), model.buffer_accounting.persistent["main_weights"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_weights_as_main_weights(pool2, strategy):
    for diff, dtypes, main_bytes in pool2.run(main_as_model_weights_worker, strategy=strategy):
        assert dtypes == ["torch.bfloat16"] and main_bytes == 0
        assert diff < 1e-2  # a few bf16 ulps: the update itself is rounded to bf16


# -- pure validation ---------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fp8", "bf61", torch.int32, "fp128"])  # float64 is valid since issue 13 (upstream accepts any floating dtype)
def test_invalid_dtypes_are_clear_errors(value):
    with pytest.raises(ValueError, match="megatron_fsdp_grad_comm_dtype"):
        mf.DistributedDataParallelConfig(megatron_fsdp_grad_comm_dtype=value)
    with pytest.raises(ValueError, match="main_params_dtype"):
        mf.MixedPrecisionPolicy(main_params_dtype=value)


def test_config_maps_megatron_dtype_flags_to_the_policy():
    cfg = mf.DistributedDataParallelConfig(
        megatron_fsdp_main_params_dtype="fp32", megatron_fsdp_main_grads_dtype="bf16", megatron_fsdp_grad_comm_dtype="auto"
    )
    assert cfg.mixed_precision_policy() == mf.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    legacy = mf.DistributedDataParallelConfig(grad_reduce_in_fp32=True, preserve_fp32_weights=False)
    assert legacy.mixed_precision_policy() == mf.MixedPrecisionPolicy(main_params_dtype=None, main_grads_dtype=torch.float32)


def scale_cast_grads_worker(rank, world, *, strategy):
    """scale_gradients reaches the optimizer even when its gradients are dtype casts
    (bf16 main grads, fp32 main weights)."""
    model = mf.fully_shard_model(
        make_model("net").to(torch.bfloat16), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        mixed_precision_policy=mf.MixedPrecisionPolicy(main_params_dtype="fp32", main_grads_dtype="bf16"),
    )
    x, y = make_batches("net", 1, batch=4 * world)[0]
    loss_fn("net", model(x.chunk(world)[rank].to(torch.bfloat16)), y.chunk(world)[rank].to(torch.bfloat16)).backward()

    def local(p):
        return (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()

    before = [local(p) for p in model.parameters()]
    model.scale_gradients(0.5)
    return all(torch.equal(local(p), g * 0.5) for p, g in zip(model.parameters(), before))


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_scale_gradients_reaches_cast_gradients(pool2, strategy):
    assert all(pool2.run(scale_cast_grads_worker, strategy=strategy))
