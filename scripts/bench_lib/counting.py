"""One counting wrapper for every implementation's collectives.

The wrapper replaces the Python collectives of ``torch.distributed`` in the worker
process and records, per collective kind, the *unsharded* payload: the gathered
output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or broadcast.

[Note: who calls what]
* FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` by
  attribute at call time: patching ``torch.distributed`` sees them.
* megatron_fsdp binds ``_all_gather_flat = dist.all_gather_single`` (and the
  reduce-scatter) once at import, so a patch of ``torch.distributed`` made later is
  never called. ``install`` therefore also rebinds every module-level alias of a
  patched function found in an imported module (outside ``torch.distributed``'s own
  ``distributed_c10d``) and reports where it did so.
* megatron_fsdp over gloo moves its all-gathers and reduce-scatters as
  point-to-point messages (``megatron_fsdp/comm/p2p_transport.py``), which no wrapper
  of a torch collective sees. Its collective entry points
  (``megatron_fsdp.comm.collectives.all_gather`` ...) are therefore wrapped too, with
  the same payload definition; a torch collective called inside one of them (the
  native path, e.g. NCCL) is not counted a second time.
* DDP's reducer all-reduces from C++. A communication hook that delegates to
  ``default_hooks.allreduce_hook`` makes it call ``dist.all_reduce`` from Python,
  where this same wrapper counts it; the hook also tallies bucket sizes, as a
  cross-check of the wrapper.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import threading
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _sum_nbytes(tensors: Any) -> int:
    return sum(_nbytes(t) for t in tensors)


# torch.distributed function -> (kind, argument holding the unsharded payload, sizer).
_TARGETS: dict[str, tuple[str, str, Callable[[Any], int]]] = {
    "all_gather_single": ("all_gather", "output_tensor", _nbytes),
    "all_gather_into_tensor": ("all_gather", "output_tensor", _nbytes),
    "_all_gather_base": ("all_gather", "output_tensor", _nbytes),
    "all_gather": ("all_gather", "tensor_list", _sum_nbytes),
    "reduce_scatter_single": ("reduce_scatter", "input", _nbytes),
    "reduce_scatter_tensor": ("reduce_scatter", "input", _nbytes),
    "_reduce_scatter_base": ("reduce_scatter", "input", _nbytes),
    "reduce_scatter": ("reduce_scatter", "input_list", _sum_nbytes),
    "all_reduce": ("all_reduce", "tensor", _nbytes),
    "broadcast": ("broadcast", "tensor", _nbytes),
}


# megatron_fsdp.comm.collectives function -> the same triple.
_PACKAGE_TARGETS: dict[str, tuple[str, str, Callable[[Any], int]]] = {
    "all_gather": ("all_gather", "output", _nbytes),
    "reduce_scatter": ("reduce_scatter", "full", _nbytes),
    "all_reduce": ("all_reduce", "tensor", _nbytes),
    "broadcast": ("broadcast", "tensor", _nbytes),
    # Flags that decide what the data collectives do (gradient presence, weight
    # edits): counted apart, as the package's own recorder does.
    "control_all_reduce": ("control", "tensor", _nbytes),
}


@dataclasses.dataclass
class CollectiveCounter:
    """Calls and payload bytes per collective kind while ``enabled``."""

    enabled: bool = False
    counts: Counter = dataclasses.field(default_factory=Counter)
    bytes: Counter = dataclasses.field(default_factory=Counter)
    ddp_bucket_numel: int = 0
    """Elements of the DDP gradient buckets seen by the communication hook (cross-check)."""
    patch_sites: list = dataclasses.field(default_factory=list)
    """``module.attr`` names the wrapper was installed at."""
    _local: threading.local = dataclasses.field(default_factory=threading.local, repr=False)

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.ddp_bucket_numel = 0

    def record(self, kind: str, nbytes: int) -> None:
        if self.enabled:
            self.counts[kind] += 1
            self.bytes[kind] += nbytes

    def wrap(self, name: str, original: Callable, targets: dict = _TARGETS) -> Callable:
        kind, arg_name, sizer = targets[name]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            # A deprecated alias calling its successor is one collective, not two.
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                payload = signature.bind(*args, **kwargs).arguments[arg_name]
                self.record(kind, sizer(payload))
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__bench_original__ = original
        return counted

    def install(self) -> None:
        """Patch ``torch.distributed`` and every module alias of its collectives."""
        originals = {}
        for name in _TARGETS:
            original = getattr(dist, name, None)
            if original is None or hasattr(original, "__bench_original__"):
                continue
            originals[id(original)] = (name, self.wrap(name, original))
            setattr(dist, name, originals[id(original)][1])
            self.patch_sites.append(f"torch.distributed.{name}")
        for module_name, module in list(sys.modules.items()):
            # The defining module keeps its own names: its deprecated aliases call
            # their successors through them, and the outer call is already counted.
            if module is None or module is dist or module_name == "torch.distributed.distributed_c10d":
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                entry = originals.get(id(value))
                if entry is not None and callable(value):
                    setattr(module, attr, entry[1])
                    self.patch_sites.append(f"{module_name}.{attr}")
        package = sys.modules.get("megatron_fsdp.comm.collectives")
        for name in _PACKAGE_TARGETS if package is not None else ():
            original = getattr(package, name)
            if not hasattr(original, "__bench_original__"):
                setattr(package, name, self.wrap(name, original, _PACKAGE_TARGETS))
                self.patch_sites.append(f"megatron_fsdp.comm.collectives.{name}")
        logger.info("collective counter installed at: %s", ", ".join(self.patch_sites))

    def ddp_hook(self, base_hook: Callable) -> Callable:
        """A DDP communication hook: tally the bucket, then run ``base_hook``
        (whose ``dist.all_reduce`` call the wrapper counts)."""

        # No annotations: DDP compares them with real types, and this module's
        # postponed annotations would be strings.
        def hook(state, bucket):  # (Any, dist.GradBucket) -> Future[Tensor]
            if self.enabled:
                self.ddp_bucket_numel += bucket.buffer().numel()
            return base_hook(state, bucket)

        return hook

    def snapshot(self) -> dict:
        return {
            "counts": {k: self.counts.get(k, 0) for k in KINDS},
            "bytes": {k: self.bytes.get(k, 0) for k in KINDS},
            "control_bytes": self.bytes.get("control", 0),
            "ddp_bucket_numel": self.ddp_bucket_numel,
        }
