"""The upstream A/B script (scripts/upstream_ab.py) on the CPU, so it cannot rot.

Upstream itself is not run here (the wheel is not part of the repository): the
script's ``--self-check`` path runs our package on both sides through the same two
subprocesses, DCP cross-loads included. The comparison is also checked to catch a
difference, and gpu_check's ``upstream`` section to skip without a wheel."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "upstream_ab.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_self_check_runs_both_sides_and_cross_loads_checkpoints(tmp_path):
    # The driver in-process (this process has torch loaded already); the two sides are
    # the script's own worker subprocesses, as on the GPU.
    ab = _load("upstream_ab", SCRIPT)
    ab.run_ab(None, tmp_path, "cpu", self_check=True, strategies="optim_grads_params", precisions="fp32", timeout=120)
    record = json.loads((tmp_path / "upstream_ab.json").read_text())
    assert record["passed"] is True, record
    assert {w["returncode"] for w in record["workers"].values()} == {0}
    (row,) = record["sections"]["fp32"]["rows"]
    assert row["max_abs_diff_weights"] == 0.0 and row["max_abs_diff_optim_state"] == 0.0
    assert row["vs_bare_adamw"] == {"upstream": 0.0, "ours": 0.0}
    assert record["sections"]["state_dict"]["rows"][0]["model_keys"] > 0
    rows = record["sections"]["checkpoint"]["rows"]
    assert sorted(r["case"] for r in rows) == sorted(
        f"{a}<-{b}/optim_grads_params" for a in ("ours", "upstream") for b in ("ours", "upstream"))
    assert all(r["vs_ours_uninterrupted"]["weights"] == 0.0 for r in rows)
    assert record["sections"]["bf16"]["passed"] is None  # not requested, and says so


def test_self_check_at_world_two_accumulates_like_one_process(tmp_path):
    # Two gloo ranks per side, each on its half of every batch, two microbatches
    # (no_sync on the first), ZeRO-1: ours must equal the one-process AdamW loop on the
    # global batch (the case where upstream 0.6.1 does not), and ours-vs-ours bit-equal.
    patterns = _load("upstream_ab_patterns", ROOT / "scripts" / "upstream_ab_patterns.py")
    record = patterns.run_multi(None, tmp_path, world=2, patterns="accum", self_check=True,
                                strategies="optim", precisions="fp32", timeout=120)
    assert record["passed"] is True, record
    (row,) = record["sections"]["fp32"]["rows"]
    assert row["case"] == "fp32/accum:optim" and row["max_abs_diff_weights"] == 0.0
    assert row["max_abs_diff_optim_state"] == 0.0 and row["max_abs_diff_losses"] == 0.0
    # Rank-split sums round differently from one process: within fp32 tolerance, not 0.
    assert row["ours_exact"] and row["vs_bare_adamw"]["ours"] <= 1e-6
    assert record["sections"]["state_dict"]["rows"][0]["passed"] is True


@pytest.mark.skipif(os.environ.get("MFSDP_AB_LONG") != "1", reason=(
    "8 processes (12 s on 2 cores); the checkpoint engine is covered elsewhere and this "
    "is the script's resume phase: MFSDP_AB_LONG=1 runs it"))
def test_self_check_at_world_two_resumes_each_sides_checkpoint(tmp_path):
    # Two ranks per side save at step 3 (DCP); each side then loads both sides'
    # checkpoints into a model from another seed and must continue the saver's run.
    patterns = _load("upstream_ab_patterns", ROOT / "scripts" / "upstream_ab_patterns.py")
    record = patterns.run_multi(None, tmp_path, world=2, patterns="plain", self_check=True,
                                strategies="optim_grads_params", precisions="fp32", timeout=120)
    section = record["sections"]["checkpoint"]
    assert section["passed"] is True, section
    assert sorted(r["case"] for r in section["rows"]) == sorted(
        f"{a}<-{b}/fp32/optim_grads_params" for a in ("ours", "upstream") for b in ("ours", "upstream"))
    for row in section["rows"]:
        assert row["saved_at_world"] == row["loaded_at_world"] == 2
        saver = row["vs_saver_uninterrupted"]
        assert saver["weights"] == saver["optim_state"] == saver["losses"] == 0.0 and not saver["keys_on_one_side"]


def _side(weight: torch.Tensor, step: float) -> dict:
    meta = {"module.w": dict(type="Tensor", shape=[2], dtype="torch.float32")}
    run = dict(losses=[1.0, 0.5], model={"module.w": weight}, model_meta=meta,
               optim={"state.0.step": torch.tensor(step)}, optim_meta={"state.0.step": dict(type="Tensor")})
    return dict(runs={"fp32/optim": run}, resume={})


def test_compare_reports_a_weight_or_step_difference():
    ab = _load("upstream_ab", SCRIPT)
    same = ab.compare({"upstream": _side(torch.ones(2), 5), "ours": _side(torch.ones(2), 5)})
    assert same["fp32"]["passed"] is True and same["fp32"]["rows"][0]["max_abs_diff_weights"] == 0.0
    moved = ab.compare({"upstream": _side(torch.ones(2), 5), "ours": _side(torch.tensor([1.0, 1.001]), 5)})
    assert moved["fp32"]["passed"] is False
    assert abs(moved["fp32"]["rows"][0]["max_abs_diff_weights"] - 0.001) < 1e-6
    stepped = ab.compare({"upstream": _side(torch.ones(2), 6), "ours": _side(torch.ones(2), 5)})
    assert stepped["fp32"]["passed"] is False and stepped["fp32"]["rows"][0]["max_abs_diff_optim_state"] == 1.0
    diverged = ab.compare({"upstream": _side(torch.ones(2), 5), "ours": _side(torch.tensor([1.0, float("nan")]), 5)})
    assert diverged["fp32"]["passed"] is False and diverged["fp32"]["rows"][0]["max_abs_diff_weights"] == float("inf")


def test_only_upstreams_priming_step_is_an_explained_difference():
    """Upstream 0.6.1's fully_shard_optimizer steps once on zero gradients; a row whose
    difference is exactly that (ours = the reference loop, upstream = the primed loop)
    passes with that verdict, any other difference still fails."""
    ab = _load("upstream_ab", SCRIPT)
    plain, primed = torch.ones(2), torch.full((2,), 0.99)

    def sides(upstream_weight, primed_losses=(1.0, 0.5)):
        ours = _side(plain, 5)  # its losses: 1.0, 0.5
        ours.update({"master/fp32": dict(model={"module.w": plain}, losses=[1.0, 0.5]),
                     "primed/fp32": dict(model={"module.w": primed}, losses=list(primed_losses))})
        return {"upstream": _side(upstream_weight, 5), "ours": ours}

    explained = ab.compare(sides(primed))["fp32"]
    assert explained["passed"] is True and explained["rows"][0]["verdict"].startswith("upstream's priming step")
    unexplained = ab.compare(sides(torch.full((2,), 0.98)))["fp32"]
    assert unexplained["passed"] is False and unexplained["rows"][0]["verdict"] == "differs"
    # Final weights that match the primed loop are not enough: every step's loss must too.
    other_path = ab.compare(sides(primed, primed_losses=(1.0, 0.6)))["fp32"]
    assert other_path["passed"] is False and other_path["rows"][0]["verdict"] == "differs"


def test_gpu_check_skips_the_upstream_section_without_a_wheel(tmp_path):
    gpu_check = _load("gpu_check_for_upstream_ab", ROOT / "scripts" / "gpu_check.py")
    result = gpu_check.check_upstream(torch.device("cpu"), tmp_path, None)
    assert result["passed"] is None and "--upstream-wheel" in result["skipped"]
