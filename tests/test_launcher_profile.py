"""The launcher's profiling flags (``observe/profiling.py``): the torch.profiler trace holds
exactly the iterations of Megatron-LM's window and the ranges recorded in them; only the ranks
of ``--profile-ranks`` write; ``--record-memory-history`` on the CPU writes each logged
iteration's host memory summary where the snapshot would go."""

from __future__ import annotations

import gzip
import json
import pickle
from argparse import Namespace

import torch

from megatron_fsdp.training.observe.profiling import RunProfiler


def _args(tmp_path, **overrides) -> Namespace:
    base = dict(profile=True, use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0],
                tensorboard_dir=str(tmp_path / "tb"), save=None, record_memory_history=False,
                memory_snapshot_path=str(tmp_path / "mem" / "snapshot.pickle"))
    return Namespace(**{**base, **overrides})


def _loop(profiler: RunProfiler, iterations: int, log_interval: int = 2) -> None:
    for done in range(iterations):
        profiler.before_iteration(done)
        with torch.profiler.record_function(f"megatron_fsdp::iteration:{done + 1}"):  # the log's numbering
            torch.ones(8).sum()
        profiler.after_iteration(done + 1, logged=(done + 1) % log_interval == 0)
    profiler.close()


def _trace_names(path) -> set[str]:
    with gzip.open(path) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_the_trace_holds_the_window_only(tmp_path):
    _loop(RunProfiler(_args(tmp_path), 0, torch.device("cpu")), 6)
    names = _trace_names(tmp_path / "torch_profile" / "rank-0.json.gz")
    iterations = sorted(n for n in names if n.startswith("megatron_fsdp::iteration:"))
    assert iterations == ["megatron_fsdp::iteration:2", "megatron_fsdp::iteration:3"]  # start .. end - 1
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]


def test_only_the_profiled_ranks_write(tmp_path):
    _loop(RunProfiler(_args(tmp_path), 1, torch.device("cpu")), 6)
    assert not (tmp_path / "torch_profile").exists()
    _loop(RunProfiler(_args(tmp_path, profile_ranks=[]), 1, torch.device("cpu")), 6)  # []: every rank
    assert (tmp_path / "torch_profile" / "rank-1.json.gz").is_file()


def test_cpu_memory_history_writes_host_summaries(tmp_path, caplog):
    args = _args(tmp_path, profile=False, record_memory_history=True)
    with caplog.at_level("WARNING"):
        profiler = RunProfiler(args, 0, torch.device("cpu"), memory_summary=lambda: {"rss": 123, "peak_temporary": 7})
    assert "the CPU allocator keeps no allocation history" in caplog.text
    _loop(profiler, 3)
    with open(tmp_path / "mem" / "snapshot_0.pickle", "rb") as f:
        summary = pickle.load(f)
    assert summary["device"] == "cpu" and summary["rss"] == 123 and summary["peak_temporary"] == 7
    assert "no allocation history" in summary["note"]
