"""Upstream Megatron-FSDP 0.6.1's own placement classes, accepted at the API boundary.

[Note: two generations of the experimental API] Upstream's experimental API changed between
its 0.6.1 release and its main branch, which this package follows. 0.6.1 code names its
placements with classes of its own (``megatron_fsdp.experimental.Replicate``, ``Partial``,
``Flat``), calls ``fully_shard`` without a ``fully_shard_context``, and passes the module, not
the context, to ``microbatch``. The main branch uses torch's DTensor placements and a context.
Both are accepted: the classes below are 0.6.1's (same names, fields and defaults), and
``Placements`` turns them into torch's before anything else reads them.

0.6.1 averages gradients over the data-parallel ranks whatever the gradient placement's
``reduce_op`` (a ``SUM`` reduction is divided by the axis size afterwards), so both its
``Partial(SUM)`` and ``Partial(AVG)`` mean torch's ``Partial("avg")`` here.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.tensor import Partial as TorchPartial, Replicate as TorchReplicate
from torch.distributed.tensor.placement_types import Placement as TorchPlacement

__all__ = ["Partial", "Placement", "Replicate", "as_torch_placement"]


class Placement:
    """Base class of upstream 0.6.1's buffer placements."""


@dataclasses.dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh axis holds the whole buffer (0.6.1's name)."""


@dataclasses.dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds an unreduced contribution (0.6.1's name): gradients between microbatches."""

    reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM


def as_torch_placement(placement: object) -> object:
    """A 0.6.1 placement as the torch placement this package computes with; any other
    value unchanged (torch's placements, ``Flat``; ``validate_placements`` judges them)."""
    if isinstance(placement, Replicate):
        return TorchReplicate()
    if isinstance(placement, Partial):
        if placement.reduce_op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(
                f"Partial(reduce_op={placement.reduce_op}): upstream 0.6.1 averages gradients over the data-parallel "
                "ranks with SUM or AVG only; use Partial() (or torch's Partial('avg'))")
        return TorchPartial("avg")
    if isinstance(placement, Placement) and not isinstance(placement, TorchPlacement):
        raise TypeError(f"placement {placement!r}: not one of upstream 0.6.1's Replicate, Partial or Flat")
    return placement
