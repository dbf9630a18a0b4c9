"""The one place that talks to ``torch.cuda``.

Every other module asks this one, so the same code path runs on CPU/gloo and on
CUDA/NCCL. Keep it small: device choice, synchronisation, and memory queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    return torch.cuda.device_count() if cuda_available() else 0


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """``device=None`` resolves here: the current CUDA device when CUDA is available
    and the process group runs on NCCL, else the CPU."""
    if cuda_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        if "nccl" in str(backend).lower():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def mesh_device_type(device: torch.device) -> str:
    """The DeviceMesh device type for tensors living on ``device``."""
    return "cuda" if device.type == "cuda" else "cpu"


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without a host sync: from pinned memory,
    non-blocking, on accelerators (a pageable copy makes the host wait for it)."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def current_stream(device: torch.device):
    """The stream work on ``device`` is queued to now (``None`` on the CPU, which has none)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def memory_allocated(device: torch.device) -> int:
    """Bytes held by the CUDA caching allocator; 0 on the CPU (use RSS there)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return 0


def max_memory_allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0


def reset_peak_memory_stats(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def empty_cache(device: torch.device) -> None:
    """Return cached blocks to the driver, so the next memory reading starts clean."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record_memory_history(device: torch.device, max_entries: int = 100_000) -> bool:
    """Start the CUDA caching allocator's allocation history (stack traces of every block)
    for ``dump_memory_snapshot``; False on the CPU, whose allocator keeps none."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True


def dump_memory_snapshot(device: torch.device, path: str) -> None:
    """Write the allocator history started by ``record_memory_history`` (pytorch.org/memory_viz)."""
    if device.type == "cuda":
        torch.cuda.memory._dump_snapshot(path)


def external_profiler_range(device: torch.device, start: bool) -> None:
    """Open or close the range an external CUDA profiler (Nsight Systems' ``--capture-range
    cudaProfilerApi``) records; nothing on the CPU."""
    if device.type == "cuda":
        call = torch.cuda.cudart().cudaProfilerStart if start else torch.cuda.cudart().cudaProfilerStop
        torch.cuda.check_error(call())


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


class HostSyncCounter:
    """Counts the host synchronisations CUDA performs inside a ``with`` block.

    CUDA's sync-debug mode warns once per synchronising call (``.item()``,
    ``bool(tensor)``, pageable copies, ``synchronize``); the warnings are caught
    and counted rather than shown. On the CPU nothing synchronises: the count is 0.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count = 0
        self.sites: list[str] = []
        self._caught = None
        self._catcher = None

    def __enter__(self) -> "HostSyncCounter":
        if self.device.type == "cuda":
            import warnings

            synchronize(self.device)
            # Switching the mode on reports a sync of its own the first time in a
            # process; that one belongs to no step, so it is swallowed here.
            with warnings.catch_warnings(record=True):
                torch.cuda.set_sync_debug_mode("warn")
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(*exc)
        syncs = [w for w in self._caught if "synchroniz" in str(w.message)]
        self.count = len(syncs)
        self.sites = sorted({f"{w.filename}:{w.lineno}" for w in syncs})


def rng_state(device: torch.device):
    """This process's RNG state of ``device`` (the CUDA generator), or None on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def set_rng_state(state, device: torch.device) -> None:
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)
