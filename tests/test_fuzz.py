"""Configuration fuzzing: random combinations of the public arguments either train
2 steps matching a single-process reference or raise ValueError/NotImplementedError
with a message; never an internal error or a hang.

CI draws a few dozen seeded configurations; ``MFSDP_FUZZ_DRAWS=500 pytest
tests/test_fuzz.py`` runs a long campaign (``MFSDP_FUZZ_SEED`` picks another one).
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp as mf
from megatron_fsdp.distributed_index import build_hybrid_mesh
from models import Block, Net, backward_microbatches, loss_fn, make_batches, make_model

DRAWS = int(os.environ.get("MFSDP_FUZZ_DRAWS", "30"))
SEED = int(os.environ.get("MFSDP_FUZZ_SEED", "0"))
LR = 0.05


def draw_config(index: int) -> dict:
    rng = random.Random(SEED * 100_003 + index)
    pick = rng.choice
    compute = pick(["fp32", "fp32", "bf16"])
    cfg = dict(
        strategy=pick([0, 1, 2, 3, "no_shard", "optim", "optim_grads", "optim_grads_params"] + ["zero4"] * (rng.random() < 0.05)),
        outer=pick([0, 1, "no_shard", "optim"]),
        hybrid=rng.random() < 0.4,
        compute=compute,
        main_params=pick(["fp32", "fp32", "auto", "bf16"] + ["fp8"] * (rng.random() < 0.05)),
        main_grads=pick(["auto", "fp32", "bf16"]),
        grad_comm=pick(["auto", "fp32", "bf16"]),
        overlap_grad_reduce=rng.random() < 0.7,
        overlap_param_gather=rng.random() < 0.7,
        disable_bucketing=rng.random() < 0.2,
        units=pick(["none", "block", "block_path", "linear", "nested"] + ["bad_path"] * (rng.random() < 0.05)),
        meta_init=rng.random() < 0.3,
        no_shard_mark=pick(["none", "none", "module", "param"]),
        average_in_collective=rng.random() < 0.3,
        per_token=rng.random() < 0.2,
        fine_grained=rng.random() < 0.15,
        double_buffer=rng.random() < 0.3,
        microbatches=pick([1, 2]),
        suggested=pick([None, None, None, 300, 600, 10**9]),
    )
    # Adam normalises each update, so bf16 rounding of a near-zero gradient (whose
    # sign can flip when microbatches sum in bf16) moves a weight by up to 2 * lr:
    # no reference could match that. AdamW is drawn with fp32 gradients; SGD covers
    # the low-precision gradient paths.
    fp32_grads = compute == "fp32" and {cfg["main_grads"], cfg["grad_comm"]} <= {"auto", "fp32"}
    cfg["optimizer"] = pick(["sgd", "adamw"]) if fp32_grads else "sgd"
    return cfg


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}
UNITS = {
    "none": None,
    "block": [Block],
    "block_path": ["models.Block"],
    "linear": [nn.Linear],
    "nested": [Block, nn.Linear],
    "bad_path": ["no.such.Module"],
}


def _optimizer(name):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR)
    return lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def _reference(base, batches, cfg, world):
    """Single process on the global batch: ``master`` dtype weights updated by the
    optimizer, a ``compute`` dtype copy doing forward/backward."""
    compute_dtype = DTYPES[cfg["compute"]]
    master_dtype = DTYPES.get(cfg["main_params"]) or compute_dtype
    compute = copy.deepcopy(base).to(compute_dtype)
    master = copy.deepcopy(base).to(compute_dtype).to(master_dtype)
    opt = _optimizer(cfg["optimizer"])(master.parameters())
    scale = world if cfg["per_token"] else 1.0  # per-token: gradients sum over ranks
    for x, y in batches:
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.copy_(m)
        compute.zero_grad()
        (scale * loss_fn("net", compute(x.to(compute_dtype)), y.to(compute_dtype))).backward()
        for c, m in zip(compute.parameters(), master.parameters()):
            m.grad = c.grad.to(master_dtype)
        opt.step()
    return {n: p.detach().float() for n, p in master.named_parameters()}


def _tolerance(cfg) -> float:
    lowest = {cfg["compute"], cfg["main_params"], cfg["main_grads"], cfg["grad_comm"]} - {"auto"}
    if lowest == {"fp32"}:
        return 1e-5
    if "bf16" in {cfg["main_params"]} or (cfg["main_params"] == "auto" and cfg["compute"] == "bf16"):
        return 2e-2  # the update itself is rounded to bf16
    return 3e-3


def fuzz_worker(rank, world, *, cfg):
    torch.manual_seed(0)
    base = make_model("net")
    batches = make_batches("net", 2, batch=2 * world * cfg["microbatches"])
    try:
        if cfg["meta_init"]:
            torch.manual_seed(0)
            with torch.device("meta"):
                module = Net()
        else:
            module = copy.deepcopy(base)
        module = module.to(DTYPES[cfg["compute"]])
        if cfg["no_shard_mark"] == "module":
            mf.fsdp_no_shard(module.blocks[0])
        elif cfg["no_shard_mark"] == "param":
            mf.fsdp_no_shard(module.blocks[0].fc1.weight)
        mesh_kwargs = {}
        if cfg["hybrid"]:
            mesh_kwargs = dict(device_mesh=build_hybrid_mesh("cpu", 2), dp_shard_dim="dp_shard",
                               dp_outer_dim="dp_outer", tp_dim="tp", hybrid_fsdp_group=dist.group.WORLD)
        policy = mf.MixedPrecisionPolicy(
            main_params_dtype=cfg["main_params"], main_grads_dtype=cfg["main_grads"], grad_comm_dtype=cfg["grad_comm"]
        )
        model, opt = mf.fully_shard(
            module,
            _optimizer(cfg["optimizer"]),
            fsdp_unit_modules=UNITS[cfg["units"]],
            zero_dp_strategy=cfg["strategy"],
            outer_dp_sharding_strategy=cfg["outer"],
            init_model_with_meta_device=cfg["meta_init"],
            mixed_precision_policy=policy,
            overlap_grad_reduce=cfg["overlap_grad_reduce"],
            overlap_param_gather=cfg["overlap_param_gather"],
            disable_bucketing=cfg["disable_bucketing"],
            average_in_collective=cfg["average_in_collective"],
            calculate_per_token_loss=cfg["per_token"],
            enable_fine_grained_param_gather=cfg["fine_grained"],
            fsdp_double_buffer=cfg["double_buffer"],
            suggested_communication_unit_size=cfg["suggested"],
            **mesh_kwargs,
        )
    except (ValueError, NotImplementedError) as exc:
        assert str(exc), "an error without a message"
        return "rejected", f"{type(exc).__name__}: {exc}"
    if cfg["meta_init"]:  # the reference starts from the same (converted) weights
        base = base.to(DTYPES[cfg["compute"]])
    dtype = DTYPES[cfg["compute"]]
    for x, y in batches:
        opt.zero_grad()
        backward_microbatches(model, x, y, rank, world, cfg["microbatches"], dtype=dtype)
        opt.step()
    model.finish_param_sync()
    got = mf.get_full_state_dict(model)
    expected = _reference(base, batches, cfg, world)
    diff = max((got[k].float() - v).abs().max().item() for k, v in expected.items())
    return "trained", diff


@pytest.mark.parametrize("index", range(DRAWS))
def test_fuzz_configuration(pool4, index):
    cfg = draw_config(index)
    results = pool4.run(fuzz_worker, cfg=cfg)
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1, f"ranks disagree: {results} for {cfg}"
    kind, value = results[0]
    if kind == "trained":
        assert max(v for _, v in results) < _tolerance(cfg), (results, cfg)
    else:
        assert value.split(":")[0] in ("ValueError", "NotImplementedError"), (value, cfg)
