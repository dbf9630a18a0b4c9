"""The launcher's profiling flags (``observe/profiling.py``): the torch.profiler trace holds
exactly the iterations of Megatron-LM's window and the ranges recorded in them; only the ranks
of ``--profile-ranks`` write; ``--record-memory-history`` on the CPU writes each logged
iteration's host memory summary where the snapshot would go."""

from __future__ import annotations

import gzip
import json
import pickle
from argparse import Namespace

import pytest
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


# -- through the launcher -------------------------------------------------------------------
LAUNCH = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
          "--micro-batch-size 1 --global-batch-size 4 --train-iters 6 --lr 3e-3 --log-interval 2 --plot-path none "
          "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --use-megatron-fsdp "
          "--data-parallel-sharding-strategy optim_grads_params --profile --use-pytorch-profiler "
          "--profile-step-start 2 --profile-step-end 4 --profile-ranks 0 1 ")


def launcher_profile_worker(rank, world, *, out):
    from launcher_inprocess import run_launcher

    run_launcher(LAUNCH + f"--tensorboard-dir {out}/tb --record-memory-history "
                 f"--memory-snapshot-path {out}/mem/snapshot.pickle", world)
    return sorted(_trace_names(f"{out}/torch_profile/rank-{rank}.json.gz"))


def test_the_launcher_writes_the_window_with_the_engines_ranges(pool2, tmp_path):
    for rank, names in enumerate(pool2.run(launcher_profile_worker, out=str(tmp_path))):
        steps = [n for n in names if n.startswith("ProfilerStep#")]
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps  # iterations 2 and 3 only
        engine = {n.split(":")[2] if n.count(":") > 2 else n for n in names if n.startswith("megatron_fsdp::")}
        assert any(n.startswith("megatron_fsdp::all_gather") for n in names), sorted(engine)[:20]
        assert any(n.startswith("megatron_fsdp::reduce_scatter") for n in names), sorted(engine)[:20]
        with open(tmp_path / "mem" / f"snapshot_{rank}.pickle", "rb") as f:
            assert pickle.load(f)["device"] == "cpu"  # logged iterations: host summaries on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the external profiler's range is CUDA's")
def test_profile_without_the_pytorch_profiler_needs_cuda():
    import shlex

    from megatron_fsdp.training.args.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="needs CUDA; add --use-pytorch-profiler"):
        parse_args(shlex.split(LAUNCH.replace("--use-pytorch-profiler ", "")), world_size=2)
