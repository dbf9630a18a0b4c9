"""The GPU validation script and the one-sync NaN check, exercised on the CPU.

``scripts/gpu_check.py`` runs on a GPU when one is lent; CI has none, so its
sections run here on gloo to keep the script itself working. The NaN check's
promise (one host read per step, none per parameter) is counted through
``Tensor.__bool__``/``item``, the calls that synchronise on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_fsdp as mf
from models import Block, loss_fn, make_batches, make_model

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def test_gpu_check_sections_pass_on_cpu(tmp_path):
    sections = "checkpoint,fake_world,profile,habits"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--out", str(tmp_path), "--sections", sections],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in sections.split(","):
        assert record["sections"][name]["passed"] is True, (name, record["sections"][name])
    assert record["sections"]["checkpoint"]["rows"][-1]["losses_equal"]
    assert (tmp_path / "trace.json").stat().st_size > 0


def host_reads_worker(rank, world, *, strategy, check):
    """Count tensor-to-host reads during steady-state steps (each is a sync on CUDA)."""
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                 check_for_nan_in_grad=check)
    opt = mf.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    batches = make_batches("net", 4, batch=4 * world)
    counts = []
    for step, (x, y) in enumerate(batches):
        reads = [0]
        originals = (torch.Tensor.__bool__, torch.Tensor.item)

        def counted(fn):
            def wrapper(self, *a, **k):
                reads[0] += 1
                return fn(self, *a, **k)
            return wrapper

        if step >= 2:
            torch.Tensor.__bool__, torch.Tensor.item = counted(originals[0]), counted(originals[1])
        try:
            opt.zero_grad()
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        finally:
            torch.Tensor.__bool__, torch.Tensor.item = originals
        if step >= 2:
            counts.append(reads[0])
    model.finish_param_sync()
    return counts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_check_reads_the_device_once_per_step(pool2, strategy):
    for without, with_check in zip(pool2.run(host_reads_worker, strategy=strategy, check=False),
                                   pool2.run(host_reads_worker, strategy=strategy, check=True)):
        assert [b - a for a, b in zip(without, with_check)] == [1, 1]
