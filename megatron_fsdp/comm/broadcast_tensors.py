"""Many tensors made equal to their first copy: broadcast in flat buckets, one
collective per bucket and group, instead of one per tensor.

``broadcast_from_first(tensors, groups)`` leaves every rank holding what the
first rank of the *first* group holds after the last group: groups are visited in
order, each from its own rank 0. For HSDP pass (shard group, outer group): the
shard group's rank 0 hands its values to its replica, then outer rank 0 (replica
0) to the other replicas, so every rank ends with global data-parallel rank 0's
values.
"""

from __future__ import annotations

import datetime
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from . import collectives

BUCKET_BYTES = 64 * 1024 * 1024
"""Largest flat bucket: bounds the temporary copy a broadcast needs."""


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors of one dtype, in order, cut into buckets of at most ``BUCKET_BYTES``
    (a larger tensor is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or (size and size + nbytes > BUCKET_BYTES):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


@torch.no_grad()
def _broadcast_bucket(
    bucket: list[torch.Tensor], groups: Sequence[dist.ProcessGroup], label: str, timeout, only_changed: bool
) -> None:
    # Booleans travel as bytes: gloo has no boolean broadcast.
    flat = torch.cat([t.detach().reshape(-1).to(torch.uint8 if t.dtype == torch.bool else t.dtype) for t in bucket])
    for group in groups:
        collectives.broadcast(flat, 0, group, label=label, timeout=timeout)
    for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
        value = piece.view(t.shape).to(t.dtype)
        if only_changed and torch.equal(t, value):
            continue  # [Note: buffers saved for backward]
        t.copy_(value)  # copy_ writes non-contiguous tensors element by element


def broadcast_from_first(
    tensors: Iterable[torch.Tensor],
    groups: Sequence[Optional[dist.ProcessGroup]],
    *,
    label: str,
    timeout: Optional[datetime.timedelta] = None,
    only_changed: bool = False,
) -> None:
    """Overwrite ``tensors`` in place with the values of the first rank of each of
    ``groups`` in turn (``None`` and one-rank groups skipped). Collective over every
    group: every rank passes the same tensors in the same order.

    [Note: buffers saved for backward] ``only_changed``: a tensor already equal to
    the first rank's is not written. A write bumps its version counter, and a
    forward's graph may have saved it (a position-id buffer an embedding looked up,
    with a second forward before the backward): autograd would then refuse the
    backward. Buffers broadcast before each forward are such tensors."""
    live = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
    if not live:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # one order on every rank
        for bucket in _buckets(by_dtype[dtype]):
            _broadcast_bucket(bucket, live, label, timeout, only_changed)
