"""The bucket-release invariant: memory a collective reads or writes is released
only after that collective's ``wait()``.

[Note: release after wait]
Temporary buckets are released by resizing their storage to zero
(allocator.StorageResizeAllocator), which frees the memory no matter who still holds
a reference: the NCCL work's stashed tensor references (torch >= 2.8) keep tensor
objects alive, not a resized storage. Freeing a bucket with its collective in
flight would let the next allocation reuse bytes the transport is still writing,
on gloo (a background thread) as on NCCL (its own stream). ``Handle.wait()`` is
also where NCCL makes the current stream wait for the collective, so every release
after it is ordered after the collective on the device too, with no
``record_stream``.

Every pipeline follows this order; ``check_release`` makes it an invariant checked
in the allocator, the one place that frees or recycles temporary buckets.
Collectives register the byte ranges of their tensors when launched and forget them
when waited; a collective whose handle is dropped without a wait is forgotten with
its handle (weak references), so a leaked handle never blocks later releases.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch


class BucketInFlightError(RuntimeError):
    """A temporary bucket was released while a collective using it was in flight."""


_live: dict[int, tuple[weakref.ref, str, list[tuple[int, int]]]] = {}
"""id(handle) -> (weak handle, label, byte ranges of its tensors)."""


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def register(handle: Any, label: str, tensors: Iterable[torch.Tensor]) -> None:
    """``handle``'s collective uses ``tensors`` until ``forget(handle)``."""
    ranges = [_byte_range(t) for t in tensors if t.numel()]
    key = id(handle)
    _live[key] = (weakref.ref(handle, lambda _ref, key=key: _live.pop(key, None)), label, ranges)


def forget(handle: Any) -> None:
    _live.pop(id(handle), None)


def in_flight_label(tensor: torch.Tensor) -> str | None:
    """The label of an in-flight collective whose tensors overlap ``tensor``'s bytes."""
    if not _live or tensor.numel() == 0 or tensor.untyped_storage().nbytes() == 0:
        return None
    start, end = _byte_range(tensor)
    for ref, label, ranges in list(_live.values()):
        if ref() is None:
            continue
        if any(s < end and start < e for s, e in ranges):
            return label
    return None


def check_release(tensor: torch.Tensor) -> None:
    """Raise unless ``tensor`` may be released now (see [Note: release after wait])."""
    label = in_flight_label(tensor)
    if label is not None:
        raise BucketInFlightError(
            f"megatron_fsdp internal error: a temporary bucket is being released while the collective "
            f"'{label}' using it is still in flight; its memory could be reused under the transport. "
            "Every release must follow the collective's wait(); please report this with the model and strategy."
        )
