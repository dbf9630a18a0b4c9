"""Communication streams and events: the CUDA side of the pipelines, in one place.

[Note: the CUDA stream design]
On CUDA, NCCL collectives issued with ``async_op=True`` run on the process group's
internal stream and ``Work.wait()`` makes the *current* stream wait for them (no
host sync). The design this module provides for the pipelines::

    compute stream (default)   ----fwd unit k----fwd unit k+1---- ... bwd ...
    all_gather   (high prio)     gather k+1 ^ event: bucket ready -> compute waits
    reduce_scatter (high prio)                    grads of k ^ event: compute done
    outer        (high prio)   HSDP/HFSDP outer reduction of a group, overlapped
                               with the next group's reduce-scatter

* Each kind of collective is launched from its own high-priority stream, which
  first waits for an event recorded on the compute stream where its input became
  ready (copy-in of gradients, the previous release of a bucket); consumers wait for
  the event recorded after the collective. Ordering is by events, never by
  ``synchronize()``.
* Memory lifetime follows [Note: release after wait] (release_after_wait.py): a bucket is
  released only after its collective's ``wait()``, on the compute stream, so the
  caching allocator may reuse it at once: reshard events replace
  ``record_stream``. This needs torch >= 2.8, where NCCL work holds its tensors
  until ``wait()`` instead of calling ``record_stream`` (pytorch/pytorch#150398);
  ``check_torch_for_device`` refuses older releases on CUDA.
* On CPU/gloo every call here is a no-op (``CommStreams.on(...)`` is a null
  context, events are ``None``): the pipelines read the same on both.

Wired today: the gradient reductions (grad_reduce_pipeline: [Note: the
reduce-scatter stream]). The gathers need no stream of their own: they copy nothing
on the compute stream (buckets are flat and parameters are views into them), and
NCCL already runs each process group's collectives on that group's internal stream,
which is also why the HSDP/HFSDP outer reductions (their own process group) overlap
backward ([Note: overlapped outer reduction]).

[Note: streams switch] The reduce-scatter stream is on by default on CUDA. On an
H100 (torch 2.11) it trained exactly under gradient accumulation with
NaN checks and pooled buckets, ``TORCH_CUDA_SANITIZER=1`` found no unordered access
(while it flags the same code with the stream's wait for the compute stream
removed), and a ~1B ZeRO-3 step was ~0.9% faster than on one stream.
``MFSDP_COMM_STREAMS=0`` keeps everything on the compute stream (to bisect a
suspected race); ``scripts/gpu_check.py``'s ``streams`` and ``sanitizer`` sections
and its ``optim_grads_params-streams`` step-time row check both again.

Only this module and device.py may call ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
import enum
import os
from typing import Iterator, Optional

import torch

MIN_TORCH_FOR_CUDA = (2, 8)


class StreamKind(enum.Enum):
    ALL_GATHER = "all_gather"
    """Parameter gathers (prefetch of the next unit)."""
    REDUCE_SCATTER = "reduce_scatter"
    """Gradient reduce-scatters / all-reduces of the dp-shard group."""
    OUTER = "outer"
    """HSDP/HFSDP reduction across the outer (replica) group."""


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch_for_device(device: torch.device, version: Optional[tuple[int, int]] = None) -> None:
    """Refuse CUDA training on a torch whose NCCL work does not hold its tensors
    until ``wait()`` (see the note above)."""
    version = version or torch_version()
    if device.type == "cuda" and version < MIN_TORCH_FOR_CUDA:
        need = ".".join(map(str, MIN_TORCH_FOR_CUDA))
        raise RuntimeError(
            f"megatron_fsdp on CUDA needs torch >= {need} (found {torch.__version__}): older NCCL process "
            "groups free collective buffers through record_stream, which megatron_fsdp's storage-resize "
            f"release does not follow. Upgrade torch to {need} or newer, or train on CPU/gloo"
        )


STREAMS_ENV = "MFSDP_COMM_STREAMS"


def side_streams_enabled() -> bool:
    """[Note: streams switch]: on unless ``MFSDP_COMM_STREAMS`` is 0/false/off."""
    value = os.environ.get(STREAMS_ENV, "1").strip().lower()
    if value in ("1", "true", "on", ""):
        return True
    if value in ("0", "false", "off"):
        return False
    raise ValueError(f"{STREAMS_ENV}={value!r} is not one of 1/true/on or 0/false/off")


class CommStreams:
    """The communication streams of one device (none on CPU, or with the switch off)."""

    def __init__(self, device: torch.device, enabled: Optional[bool] = None) -> None:
        self.device = device
        self._streams: dict[StreamKind, object] = {}
        if enabled is None:
            enabled = side_streams_enabled()
        if device.type == "cuda" and enabled:
            # Lower number = higher priority; -1 is the highest CUDA exposes today.
            low, high = torch.cuda.Stream.priority_range()
            self._streams = {kind: torch.cuda.Stream(device=device, priority=high) for kind in StreamKind}

    @property
    def active(self) -> bool:
        return bool(self._streams)

    def stream(self, kind: StreamKind):
        return self._streams.get(kind)

    @contextlib.contextmanager
    def on(self, kind: StreamKind, ready: Optional[object] = None) -> Iterator[None]:
        """Issue work on ``kind``'s stream after ``ready`` (an event; default: all the
        compute stream's work so far). A null context on CPU."""
        stream = self._streams.get(kind)
        if stream is None:
            yield
            return
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def record(self, kind: Optional[StreamKind] = None) -> Optional[object]:
        """An event at the current end of ``kind``'s stream (``None``: the compute
        stream); ``None`` on CPU."""
        if not self._streams:
            return None
        stream = self._streams[kind] if kind is not None else torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Optional[object]) -> None:
        """Make the compute stream wait for ``event`` (no host sync); no-op on CPU."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
