"""``--profile``, ``--use-pytorch-profiler`` and ``--record-memory-history``, with Megatron-LM's
meaning, on the ranks of ``--profile-ranks``.

[Note: the profiling window] As in Megatron-LM: with ``--use-pytorch-profiler`` a
``torch.profiler`` schedule, stepped before every iteration, waits ``start - 1`` steps, warms
up one and records ``end - start``: the iterations the log numbers ``start`` .. ``end - 1``
(the first iteration is number 1). The trace is written when the window closes, as
``<--tensorboard-dir>/../torch_profile/rank-<r>.json.gz`` (Chrome / Perfetto / TensorBoard),
here ``<--save or .>/torch_profile/`` without a TensorBoard directory. It holds the engine's
``megatron_fsdp::...`` ranges (all-gathers, reduce-scatters, unit forwards and backwards).
Without it, ``--profile`` opens and closes the range an external CUDA profiler records
(``nsys profile --capture-range=cudaProfilerApi``) from the iteration after ``start`` finished
to the one numbered ``end``; that needs CUDA (refused on the CPU at validation).

``--record-memory-history`` starts the CUDA allocator's history and writes
``<--memory-snapshot-path stem>_<rank><suffix>`` at every logged iteration (Megatron-LM's
rule; pytorch.org/memory_viz reads it). The CPU allocator keeps no history: on the CPU the
same files hold, instead, a pickled summary of this rank's host memory (resident set now and
at its peak) and of the engine's buffers (persistent bytes by role, temporary bytes now and
at their peak), and the log says so once.
"""

from __future__ import annotations

import logging
import os
import pickle
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_fsdp.comm import device as device_mod

logger = logging.getLogger(__name__)


def profiles_rank(args: Namespace, rank: int) -> bool:
    """Whether this rank profiles (an empty ``--profile-ranks`` means every rank)."""
    ranks = getattr(args, "profile_ranks", None)
    return not ranks or rank in ranks


def trace_dir(args: Namespace) -> Path:
    """Where ``--use-pytorch-profiler`` writes (Megatron-LM's place beside the TensorBoard logs)."""
    if getattr(args, "tensorboard_dir", None):
        return Path(args.tensorboard_dir).parent / "torch_profile"
    return Path(getattr(args, "save", None) or ".") / "torch_profile"


class RunProfiler:
    """The profiling flags' effects over the training loop; call ``before_iteration`` and
    ``after_iteration`` with the count of finished iterations (Megatron-LM's ``iteration``)."""

    def __init__(self, args: Namespace, rank: int, device: torch.device,
                 memory_summary: Optional[Callable[[], dict[str, Any]]] = None) -> None:
        self.args, self.rank, self.device = args, rank, device
        self.active = bool(args.profile) and profiles_rank(args, rank)
        self.memory = bool(getattr(args, "record_memory_history", False)) and profiles_rank(args, rank)
        self.memory_summary = memory_summary
        self.torch_profiler: Optional[torch.profiler.profile] = None
        if self.active and args.use_pytorch_profiler:
            self.torch_profiler = self._torch_profiler()
            self.torch_profiler.start()
        if self.memory and not device_mod.record_memory_history(device):
            logger.warning("--record-memory-history on %s: the CPU allocator keeps no allocation history; %s "
                           "gets this rank's host memory and engine buffer summary at each logged iteration "
                           "instead", device, self.args.memory_snapshot_path)

    def _torch_profiler(self) -> torch.profiler.profile:
        start, end = self.args.profile_step_start, self.args.profile_step_end
        out = trace_dir(self.args)
        rank = self.rank

        def write_trace(prof: torch.profiler.profile) -> None:
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"rank-{rank}.json.gz"))
            logger.info("torch.profiler trace of iterations [%d, %d) written to %s", start, end, out)

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                             active=end - start, repeat=1),
            on_trace_ready=write_trace,
            record_shapes=bool(getattr(self.args, "pytorch_profiler_collect_shapes", False)),
            with_stack=bool(getattr(self.args, "pytorch_profiler_collect_callstack", False)),
        )

    def before_iteration(self, iteration: int) -> None:
        """``iteration``: iterations finished before the one about to run."""
        if not self.active:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.args.profile_step_start:
            device_mod.external_profiler_range(self.device, start=True)

    def after_iteration(self, iteration: int, logged: bool) -> None:
        """``iteration``: iterations finished; ``logged``: this one printed its log line."""
        if self.memory and logged:
            self._dump_memory()
        if self.active and iteration == self.args.profile_step_end:
            self.close()

    def close(self) -> None:
        """End the window (idempotent; also at the end of training, for a window left open)."""
        if not self.active:
            return
        self.active = False
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
        else:
            device_mod.external_profiler_range(self.device, start=False)

    def _dump_memory(self) -> None:
        stem, suffix = os.path.splitext(self.args.memory_snapshot_path)
        path = f"{stem}_{self.rank}{suffix}"
        if self.device.type == "cuda":
            device_mod.dump_memory_snapshot(self.device, path)
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        summary = {"device": "cpu", "note": "the CPU allocator keeps no allocation history; host memory "
                                            "and the engine's buffer accounting instead"}
        summary.update(self.memory_summary() if self.memory_summary is not None else {})
        with open(path, "wb") as f:
            pickle.dump(summary, f)
