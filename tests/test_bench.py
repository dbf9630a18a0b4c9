"""End-to-end run of scripts/bench.py on a miniature setting, plus its pure
arithmetic. Asserts on collective byte counts, memory accounting and that every
implementation trained the same model on the same data: never on timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

from bench_lib.config import BenchConfig, Family, ImplSpec, all_impls  # noqa: E402
from bench_lib.theory import ElementSizes, ParamCounts, expected_memory, min_comm_bytes  # noqa: E402

BYTES_TOLERANCE = 0.02
MEMORY_TOLERANCE = 0.02


# -- pure arithmetic -------------------------------------------------------------
COUNTS = ParamCounts(total=1000, root=100)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (ImplSpec(name="ddp", family=Family.DDP, zero_level=0), {"all_reduce": 4000}),
        (ImplSpec(name="z1", family=Family.MEGATRON_FSDP, zero_level=1, strategy="optim"),
         {"all_gather": 4000, "reduce_scatter": 4000}),
        (ImplSpec(name="z3", family=Family.MEGATRON_FSDP, zero_level=3, strategy="optim_grads_params"),
         {"all_gather": 4 * (2 * 900 + 100), "reduce_scatter": 4000}),
        (ImplSpec(name="f", family=Family.FSDP2, zero_level=3, reshard_after_forward=False),
         {"all_gather": 4000, "reduce_scatter": 4000}),
    ],
    ids=["ddp", "zero1", "zero3", "fsdp2_no_reshard"],
)
def test_min_comm_bytes(spec, expected):
    assert min_comm_bytes(spec, COUNTS, 4) == expected


def test_megatron_memory_formula_adds_main_weights_only_for_narrow_compute():
    spec = ImplSpec(name="z2", family=Family.MEGATRON_FSDP, zero_level=2, strategy="optim_grads")
    fp32 = expected_memory(spec, COUNTS, 4, ElementSizes(weights=4))
    assert fp32 == {"weights": 4000, "main_weights": 0.0, "grads": 1000, "optimizer_state": 2000}
    bf16 = expected_memory(spec, COUNTS, 4, ElementSizes(weights=2))
    assert bf16["main_weights"] == 1000 and bf16["weights"] == 2000


def test_config_names_the_bad_value():
    with pytest.raises(ValueError, match="gpt-huge"):
        BenchConfig(model="gpt-huge")
    with pytest.raises(ValueError, match="zero4"):
        BenchConfig(strategies=("zero4",))


# -- end to end --------------------------------------------------------------------
@pytest.fixture(scope="module")
def record(tmp_path_factory) -> tuple[dict, str]:
    out = str(tmp_path_factory.mktemp("bench"))
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench.py"), "--world", "2", "--model", "gpt-mini",
           "--steps", "2", "--warmup", "1", "--rounds", "1", "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    with open(os.path.join(out, "bench_gpt-mini_w2.json")) as f:
        return json.load(f), out


def test_every_implementation_reports_step_times(record):
    data, _ = record
    assert set(data["impls"]) == {spec.name for spec in all_impls()}
    for name, impl in data["impls"].items():
        stats = impl["step_time_s"]
        assert stats["n"] == 2 and len(stats["samples"]) == 2, name
        assert all(t > 0 for t in stats["samples"]), name
        assert impl["ratio_to_ddp"] is not None and impl["ratio_to_fsdp2"] is not None, name


@pytest.mark.parametrize("name", [spec.name for spec in all_impls()])
def test_bytes_per_collective_equal_the_minimum(record, name):
    comm = record[0]["impls"][name]["comm"]
    for kind, entry in comm["per_kind"].items():
        measured, minimum = entry["bytes_per_step"], entry["minimum"]
        if minimum == 0:
            assert measured == 0, f"{name}: {kind} moved {measured} bytes/step where none are needed"
        else:
            assert abs(measured - minimum) <= BYTES_TOLERANCE * minimum, (
                f"{name}: {kind} moved {measured} bytes/step, minimum {minimum}"
            )
    # The wrapper agrees with the independent counts where there is one.
    assert comm["cross_check"] in (True, None), f"{name}: {comm}"
    # Bookkeeping flags (gradient presence, weight edits) stay a rounding error.
    assert comm["control_bytes_per_step"] <= 1e-3 * comm["total_minimum"], f"{name}: {comm}"


@pytest.mark.parametrize("name", [spec.name for spec in all_impls()])
def test_memory_categories_match_the_formula(record, name):
    memory = record[0]["impls"][name]["memory"]
    for rank_memory in memory["per_rank"]:
        assert rank_memory["peak_rss"] > 0
        for key, expected in memory["expected"].items():
            measured = rank_memory[key]
            assert abs(measured - expected) <= MEMORY_TOLERANCE * max(expected, 1) + 64, (
                f"{name}: {key} holds {measured} bytes, formula {expected}"
            )
        if name.startswith("mfsdp_"):
            assert rank_memory["peak_temporary"] is not None


def test_every_implementation_trained_the_same_model(record):
    for name, impl in record[0]["impls"].items():
        # Same seed, data and precision: losses agree up to reduction order (fp32;
        # 0.0 on 2 cores for every implementation, the run being 3 steps short).
        assert impl["max_loss_diff_vs_ddp"] < 1e-5, f"{name}: {impl['losses_rank0']}"


def test_chart_is_written(record):
    _, out = record
    png = os.path.join(out, "bench_gpt-mini_w2.png")
    assert os.path.getsize(png) > 1000


def test_double_buffer_run_moves_the_same_bytes_and_trains_the_same(tmp_path):
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench.py"), "--world", "2", "--model", "gpt-mini",
           "--steps", "2", "--warmup", "1", "--rounds", "1", "--fsdp-double-buffer",
           "--impls", "ddp,mfsdp_optim_grads,mfsdp_optim_grads_params", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    assert "fsdp_double_buffer" in proc.stdout
    with open(tmp_path / "bench_gpt-mini_w2.json") as f:
        data = json.load(f)
    assert data["config"]["fsdp_double_buffer"] is True
    for name in ("mfsdp_optim_grads", "mfsdp_optim_grads_params"):
        impl = data["impls"][name]
        for kind, entry in impl["comm"]["per_kind"].items():
            assert abs(entry["bytes_per_step"] - entry["minimum"]) <= BYTES_TOLERANCE * max(entry["minimum"], 1), kind
        for rank_memory in impl["memory"]["per_rank"]:
            for key, expected in impl["memory"]["expected"].items():
                assert abs(rank_memory[key] - expected) <= MEMORY_TOLERANCE * max(expected, 1) + 64, (name, key)
        assert impl["max_loss_diff_vs_ddp"] < 1e-5, name


def test_tp_row_trains_like_fsdp2_2d_and_like_ddp(record):
    """The DP 2 x TP 2 row (``--tp 2``, the default): megatron_fsdp ZeRO-3 and FSDP2 2-D
    on one tensor-parallel GPT report step times and their ratio, and have equal losses
    at every step; those are the plain DDP run's on the same data (the TP plan computes
    the unparallelised model)."""
    row = record[0]["tp_row"]
    assert (row["dp"], row["tp"], row["world"]) == (2, 2, 4)
    for name, impl in row["impls"].items():
        assert impl["step_time_s"]["n"] == 2 and all(t > 0 for t in impl["step_time_s"]["samples"]), name
    assert row["ratio_to_fsdp2_2d"] > 0
    assert row["steps_compared"] == 4 and row["max_loss_diff"] < 1e-5, row
    # One round: a warm-up step and an untimed step come before DDP's measured ones.
    ddp = record[0]["impls"]["ddp"]["losses_rank0"]
    tp_losses = row["impls"]["mfsdp_zero3_2d"]["losses_rank0"]
    assert max(abs(a - b) for a, b in zip(tp_losses[2:], ddp, strict=True)) < 1e-5
