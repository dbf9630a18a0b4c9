"""Each side's ``megatron_fsdp`` in the upstream A/B: its import, the CPU shim, the wheel.

A side imports the package from its own root only; the shim lets upstream run on a
CPU-only torch; the upstream wheel is unpacked for its side's ``sys.path``."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIDES = ("upstream", "ours")


class _NoStream:
    """Stands in for a CUDA stream or event on a CPU-only torch: work is already in order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):  # wait_stream, record_event, wait, synchronize, ...
        return lambda *args, **kwargs: _NoStream()

    def query(self) -> bool:
        return True


def cpu_shim() -> list[str]:
    """Let upstream run on a CPU-only torch: the ``torch.cuda`` calls it makes at wrap
    time and per step become no-ops or report device 0. Upstream's own code is not
    touched; these are the names patched, recorded in the JSON."""
    import contextlib

    import torch

    patches = dict(current_device=lambda: 0, Stream=_NoStream, Event=_NoStream,
                   current_stream=lambda *a, **k: _NoStream(), stream=lambda *a, **k: contextlib.nullcontext(),
                   synchronize=lambda *a, **k: None, empty_cache=lambda: None)
    for name, value in patches.items():
        setattr(torch.cuda, name, value)
    torch.Tensor.cuda = lambda self, *a, **k: self  # a boundary check moves a small tensor to "cuda"
    return sorted(f"torch.cuda.{name}" for name in patches) + ["torch.Tensor.cuda"] + _premul_sum_on_gloo()


class _PremulSum:
    """What ``_make_nccl_premul_sum(factor)`` returns under the shim: the factor, to
    be applied before a SUM (gloo has no PREMUL_SUM)."""

    def __init__(self, factor) -> None:
        self.factor = factor


def _premul_sum_on_gloo() -> list[str]:
    """NCCL's pre-multiplied sum as SUM of scaled data, leaving what NCCL leaves: an
    all-reduce's tensor is its output too (scaled in place); a reduce-scatter's input
    is not, so a scaled copy is sent. Upstream's 'optim' strategy reduce-scatters a
    whole gradient buffer into its own shard and keeps the rest of the buffer, and
    scaling that rest in place would change what a later microbatch adds to."""
    import torch.distributed as dist

    def unfused(collective, tensor_arg: str, position: int, in_place: bool):
        def call(*args, **kwargs):
            op = kwargs.get("op")
            if isinstance(op, _PremulSum):
                tensor = kwargs[tensor_arg] if tensor_arg in kwargs else args[position]
                if in_place:
                    tensor.mul_(op.factor)
                elif tensor_arg in kwargs:
                    kwargs[tensor_arg] = tensor * op.factor
                else:
                    args = (*args[:position], tensor * op.factor, *args[position + 1:])
                kwargs["op"] = dist.ReduceOp.SUM
            return collective(*args, **kwargs)

        return call

    dist._make_nccl_premul_sum = _PremulSum
    dist.all_reduce = unfused(dist.all_reduce, "tensor", 0, in_place=True)
    dist.reduce_scatter_tensor = unfused(dist.reduce_scatter_tensor, "input", 1, in_place=False)
    return ["torch.distributed._make_nccl_premul_sum", "torch.distributed.all_reduce",
            "torch.distributed.reduce_scatter_tensor"]


def import_side(side: str, pkg_root: Path, fallback: str | None = None):
    """Import ``megatron_fsdp`` from ``pkg_root`` only, with ``megatron`` blocked;
    ``fallback`` (last on ``sys.path``) supplies upstream's pure-Python dependency
    ``packaging`` where the machine lacks it."""
    sys.modules["megatron"] = None  # see upstream_ab.py's docstring
    sys.path.insert(0, str(pkg_root))
    if fallback:
        sys.path.append(fallback)
    import megatron_fsdp

    where = Path(megatron_fsdp.__file__).resolve()
    if pkg_root.resolve() not in where.parents:
        raise RuntimeError(f"{side}: megatron_fsdp came from {where}, not from {pkg_root}")
    return megatron_fsdp


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """The pure-Python wheel unpacked under ``dest``; the directory holding ``megatron_fsdp``."""
    root = dest / "upstream_pkg"
    shutil.rmtree(root, ignore_errors=True)  # never a copy from another wheel
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root)
    return root
