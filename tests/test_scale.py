"""Scale by simulation: the plan (megatron_fsdp/tools/plan.py) against a fake-process-group
build of rank 0 of a W-rank job (megatron_fsdp/tools/simulate.py), at W = 8, 64, 1024.

Each fake-group build runs in a subprocess of its own: the fake group must not meet
the gloo worker pool. Large models (1B, 8B, 70B parameters) take minutes of CPU and
run only with ``MFSDP_SCALE_LARGE=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_lib.config import Family, ImplSpec  # noqa: E402
from bench_lib.theory import ElementSizes, ParamCounts, expected_memory, min_comm_bytes  # noqa: E402
from grids import grid  # noqa: E402
from megatron_fsdp.enums import ShardingStrategy  # noqa: E402
from megatron_fsdp.tools.plan import PlanRequest, make_plan  # noqa: E402

LARGE = os.environ.get("MFSDP_SCALE_LARGE") == "1"


def run_plan(*args: str, timeout: float = 600) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_fsdp.tools.plan_cli", "--json", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
    )
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    "world,dtype,steps",
    grid([(8, "fp32", "3"), (64, "bf16", "3"), (1024, "fp32", "3"), (1024, "bf16", "0")],
         [(8, "fp32", "3"), (1024, "bf16", "0")]),
    ids=["w8-fp32-steps", "w64-bf16-steps", "w1024-fp32-steps", "w1024-bf16-engine-plan"],
)
def test_fake_group_build_equals_plan(world, dtype, steps):
    """Persistent bytes per role and collectives (count and bytes) of a steady-state
    step, every strategy, equal the plan exactly."""
    records = run_plan("--model", "tiny", "--world", str(world), "--strategy", "all", "--dtype", dtype,
                       "--check", "--steps", steps)
    assert [r["strategy"] for r in records] == [s.label for s in ShardingStrategy]
    for r in records:
        assert r["mismatches"] == [], (r["strategy"], r["mismatches"])
        measured = r["measured"]
        assert measured["memory"]["model_weights"] == r["memory"]["model_weights"] > 0
        assert r["step"]["counts"], "a world > 1 step issues collectives"
        if steps != "0":
            assert measured["step_source"].startswith("step 3")


def test_bf16_gradient_communication_halves_reduce_bytes():
    """bf16 on the wire with fp32 main gradients (accumulation stays fp32)."""
    fp32 = {r["strategy"]: r for r in run_plan("--model", "tiny", "--world", "64", "--strategy", "all")}
    records = run_plan("--model", "tiny", "--world", "64", "--strategy", "all", "--grad-comm-dtype", "bf16",
                       "--check", "--steps", "3")
    for r in records:
        assert r["mismatches"] == [], r["mismatches"]
        kind = "all_reduce" if r["strategy"] == "no_shard" else "reduce_scatter"
        assert 2 * r["step"]["bytes"][kind] == fp32[r["strategy"]]["step"]["bytes"][kind]
        assert r["memory"]["main_grads"] == fp32[r["strategy"]]["memory"]["main_grads"]


def test_llama_shaped_model_equals_plan():
    """Untied output layer, RoPE (no position table), RMSNorm, SwiGLU, GQA."""
    records = run_plan("--model", "llama3-tiny", "--world", "1024", "--strategy", "all", "--check", "--steps", "3")
    assert len(records) == 4 and all(r["mismatches"] == [] for r in records), [r["mismatches"] for r in records]


def _theory_counts(plan) -> ParamCounts:
    units = [g for g in plan.groups if g.unit is not None]
    return ParamCounts(total=plan.params, root=sum(g.numel for g in plan.groups if g.unit is None),
                       last_block=units[-1].numel)


@pytest.mark.parametrize("strategy", list(ShardingStrategy), ids=lambda s: s.label)
@pytest.mark.parametrize("world", [8, 64, 1024])
def test_plan_agrees_with_bench_theory(strategy, world):
    """The plan's unpadded formula is the benchmark's ZeRO formula, and its padded
    bytes per step are the benchmark's minimum plus exactly the padding."""
    plan = make_plan(PlanRequest(model="tiny", world=world, strategy=strategy, dtype=torch.float32,
                                 main_params_dtype=torch.float32, main_grads_dtype=torch.float32))
    spec = ImplSpec(name="m", family=Family.MEGATRON_FSDP, zero_level=strategy.value, strategy=strategy.label)
    counts = _theory_counts(plan)
    formula = expected_memory(spec, counts, world, ElementSizes(weights=4))
    names = {"weights": "model_weights", "main_weights": "main_weights", "grads": "main_grads"}
    assert plan.formula == pytest.approx({names.get(k, k): v for k, v in formula.items()})
    padding = [g.padded - g.numel for g in plan.groups]
    padded_bytes = {}
    for g, pad in zip(plan.groups, padding):
        gathers = {0: 0, 1: 1, 2: 1, 3: 1 if g.unit in (None, plan.groups[-1].unit) else 2}[strategy.value]
        padded_bytes["all_gather"] = padded_bytes.get("all_gather", 0) + 4 * pad * gathers
        kind = "all_reduce" if strategy is ShardingStrategy.NO_SHARD else "reduce_scatter"
        padded_bytes[kind] = padded_bytes.get(kind, 0) + 4 * pad
    for kind, minimum in min_comm_bytes(spec, counts, 4).items():
        assert plan.step["bytes"][kind] == minimum + padded_bytes[kind], kind
    assert plan.padding_bytes >= 0


def test_zero3_memory_falls_with_world_and_traffic_does_not():
    """ZeRO-3 per-rank persistent bytes fall as 1/W (to within padding); the bytes a
    rank moves per step stay those of the whole model."""
    plans = {w: make_plan(PlanRequest(model="8b", world=w, strategy="optim_grads_params")) for w in (8, 64, 1024)}
    params = plans[8].params
    assert 7.5e9 < params < 8.5e9
    for w, plan in plans.items():
        per_param = 2 + 4 + 4 + 8  # bf16 weights, fp32 main weights, fp32 grads, AdamW state
        assert plan.total_memory == pytest.approx(per_param * params / w, rel=1e-4)
        assert plan.step["bytes"]["reduce_scatter"] == pytest.approx(4 * params, rel=1e-4)
    assert plans[8].step["bytes"] == pytest.approx(plans[1024].step["bytes"], rel=1e-4)


def test_scripts_plan_prints_the_table():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "plan.py"), "--model", "70b", "--world", "1024"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout
    assert "70b:" in out and "all_gather" in out and "reduce_scatter" in out and "main_grads" in out


LARGE_CASES = [("1b", 8), ("1b", 64), ("1b", 1024), ("8b", 64), ("8b", 1024), ("70b", 1024)]


@pytest.mark.skipif(not LARGE, reason="set MFSDP_SCALE_LARGE=1 (minutes of CPU, several GiB of host memory)")
@pytest.mark.parametrize("model,world", LARGE_CASES, ids=[f"{m}-w{w}" for m, w in LARGE_CASES])
def test_large_fake_group_build_equals_plan(model, world):
    (record,) = run_plan("--model", model, "--world", str(world), "--strategy", "optim_grads_params",
                         "--check", "--steps", "0", timeout=3600)
    assert record["mismatches"] == []
    # Construction holds one module's full weights at a time, never the model.
    assert record["measured"]["init_peak_param_bytes"] < 0.1 * 2 * record["params"]
