"""Gathering a parameter group's flat quantities: whole on every rank
(``gather_main_weights``, ``gather_unsharded``) or to one rank shard by shard
(``gather_items_to``), for the state dicts, the full export and legacy checkpoints.
Collective over the group's data-parallel ranks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..buffers.param_and_grad_buffer import ParameterGroup
from ..comm import collectives


def gather_main_weights(group: ParameterGroup, timeout) -> tuple[torch.Tensor, bool]:
    """The unsharded main weights of one group (and whether that is a temporary)."""
    source = group.main_weight_source
    if not source.is_distributed:
        return source.data, False
    outer = group.hfsdp and source is group.main_weights
    return gather_unsharded(group, source.data, outer=outer, label=f"export:{group.label}", timeout=timeout), True


def gather_unsharded(group: ParameterGroup, flat: torch.Tensor, *, outer: bool, label: str, timeout) -> torch.Tensor:
    """A new unsharded flat bucket (``layout.padded_numel``) from this rank's
    shard ``flat`` of it; ``outer``: ``flat`` is a piece of the finer HFSDP
    (``optimizer_layout``) split, gathered across the outer group first."""
    try:
        if outer:
            shard = torch.empty(group.layout.shard_numel, dtype=flat.dtype, device=flat.device)
            collectives.all_gather(shard, flat, group.dp.outer_group, async_op=False, label=label, timeout=timeout)
            flat = shard
        if group.layout.world_size > 1:
            gathered = torch.empty(group.layout.padded_numel, dtype=flat.dtype, device=flat.device)
            collectives.all_gather(gathered, flat, group.dp.shard_group, async_op=False, label=label, timeout=timeout)
            flat = gathered
    except collectives.CollectiveError as exc:
        # The usual cause is DDP's habit `if rank == 0: torch.save(model.state_dict())`.
        raise collectives.CollectiveError(
            f"{exc}\nState dicts of sharded groups are gathered collectively: model.state_dict() under "
            "ZeRO-3, optimizer.state_dict() under ZeRO-1..3 and get_full_state_dict() must be called on every "
            "rank of the data-parallel group (then save on one rank), or use megatron_fsdp.save_checkpoint / "
            "torch.distributed.checkpoint, which every rank calls"
        ) from exc
    return flat


# -- to one rank, shard by shard (legacy one-file checkpoints) ------------------------------
@torch.no_grad()
def gather_items_to(
    group: ParameterGroup,
    local: torch.Tensor,
    *,
    dst: int,
    pg: Optional[dist.ProcessGroup] = None,
    comm_device: Optional[torch.device] = None,
    device: torch.device | str = "cpu",
) -> Optional[list[torch.Tensor]]:
    """The whole items (flat, on ``device``) of a quantity laid out like ``group``'s
    main weights, on global rank ``dst`` (``None`` elsewhere). ``local`` is what this
    rank holds of it: its optimizer shard (``optimizer_layout.shard_numel`` elements)
    under a sharded optimizer, else the whole padded bucket (then ``dst`` copies its
    own and nothing moves).

    The shards travel over ``pg`` (default: the default group; a gloo group moves
    them through host memory, as Megatron-LM's distributed-optimizer save does), to
    ``dst`` one at a time: ``dst`` holds one incoming shard beside the result, the
    others nothing beyond a copy of their own shard on ``comm_device``. Ranks outside
    ``dst``'s shard group (HSDP replicas of it) take no part. Every rank of ``dst``'s
    shard group must call it for the same groups in the same order."""
    device = torch.device(device)
    layout = group.optimizer_layout
    me = dist.get_rank()
    if not group.strategy.shards_optimizer or layout.world_size == 1:
        if me != dst:
            return None
        return [local[slice(*layout.item_range(i))].to(device, copy=True) for i in range(len(layout.item_numels))]
    if group.hfsdp:
        raise NotImplementedError(
            f"{group.label}: gathering HFSDP optimizer pieces to one rank is not implemented (the outer group splits "
            "each shard again); save a DCP checkpoint (megatron_fsdp.save_checkpoint) instead")
    members = [dist.get_global_rank(group.dp.shard_group, r) for r in range(layout.world_size)]
    if dst not in members:
        return None
    comm_device = torch.device(comm_device) if comm_device is not None else local.device
    if me != dst:
        dist.send(local.to(comm_device).contiguous(), dst=dst, group=pg)
        return None
    items = [torch.empty(n, dtype=local.dtype, device=device) for n in layout.item_numels]
    incoming = torch.empty(layout.shard_numel, dtype=local.dtype, device=comm_device)
    for shard_rank, source in enumerate(members):
        if source == me:
            shard = local
        else:
            dist.recv(incoming, src=source, group=pg)
            shard = incoming
        for index, item in enumerate(items):
            overlap = layout.overlap(index, shard_rank)
            if overlap is not None:
                item[overlap.item_start : overlap.item_start + overlap.numel].copy_(
                    shard[overlap.shard_start : overlap.shard_start + overlap.numel])
    return items
