"""The real peak of a training step on CPU, from the C allocator, to check ``peak.py``.

[Note: measuring a CPU peak] ``tracemalloc`` sees only Python's allocator, and torch's
CPU tensors come from ``posix_memalign`` (glibc's ``malloc``), so it misses them; the
profiler's CPU memory events were unusable here, and RSS moves in pages and keeps what
glibc does not return. glibc's ``mallinfo2()`` reports the bytes in use right now: small
blocks in its arenas (``uordblks``) plus large blocks mapped on their own (``hblkhd``,
every tensor of 128 KiB or more). Sampling it after every aten operator (a dispatch mode)
and at the phase marks gives the step's peak to within what one operator allocates and
frees inside itself (a kernel's workspace), plus Python objects created meanwhile (a few
KiB). Bytes are reported above a baseline taken before the model is built, so the
measured peak covers weights, gradients, optimizer state, engine buffers and activations:
everything the plan predicts, by a route that shares nothing with it.

Not measurable on CPU: the CUDA caching allocator's reserve and fragmentation, NCCL's
communication buffers, CUDA streams' deferred frees (a buffer freed on one stream is
reused only after the other stream's work), and cuBLAS/cuDNN workspaces.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    path = ctypes.util.find_library("c") or "libc.so.6"
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "mallinfo2"):
        raise RuntimeError(f"{path} has no mallinfo2 (glibc 2.33 or newer is needed to measure a CPU peak); "
                           "run the measurement on a Linux with a recent glibc")
    lib.mallinfo2.restype = _MallInfo2
    return lib


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not yet had back."""
    info = _libc().mallinfo2()
    return info.uordblks + info.hblkhd


class MallocPeak(TorchDispatchMode):
    """The largest ``malloc_in_use()`` seen after any operator, above ``baseline``, per phase."""

    def __init__(self, baseline: int) -> None:
        super().__init__()
        self._info = _libc().mallinfo2
        self.baseline = baseline
        self.phase = "start"
        self.peaks: dict[str, int] = {}

    def sample(self) -> int:
        info = self._info()
        now = info.uordblks + info.hblkhd - self.baseline
        self.peaks[self.phase] = max(self.peaks.get(self.phase, now), now)
        return now

    def mark(self, phase: str) -> None:
        self.sample()
        self.phase = phase
        self.sample()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out

    @property
    def peak(self) -> int:
        return max(self.peaks.values())


def baseline_bytes() -> int:
    gc.collect()
    return malloc_in_use()


def peak_of_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                 baseline: int, finish: Optional[Callable[[], None]] = None) -> MallocPeak:
    """One step (zero_grad, forward, loss, backward, optimizer step) under ``MallocPeak``;
    ``finish`` runs after the step (the engine's ``finish_param_sync``)."""
    from .activation_trace import run_microbatch

    gc.collect()
    meter = MallocPeak(baseline)
    with meter:
        optimizer.zero_grad()
        run_microbatch(model, tokens, meter)
        meter.mark("optimizer")
        optimizer.step()
        if finish is not None:
            finish()
        meter.mark("end")
    return meter
