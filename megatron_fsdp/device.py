"""The one place that talks to ``torch.cuda``.

Every other module asks this one, so the same code path runs on CPU/gloo and on
CUDA/NCCL. Keep it small: device choice, synchronisation, and memory queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cuda_available() -> bool:
    return torch.cuda.is_available()


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    """Bytes held by the CUDA caching allocator; 0 on the CPU (use RSS there)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return 0


def max_memory_allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0
