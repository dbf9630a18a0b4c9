"""Export a sharded model as one plain state dict, piece by piece.

The full fp32 weights of a large model do not fit beside training state on one GPU
(32 GB for 8B parameters). So the export walks the parameter groups one at a time:
gather one group's main weights into a temporary device bucket (one FSDP unit's
worth), copy each parameter out to host memory, drop the bucket, go on. Device
memory grows by one group's unsharded bucket at most; host memory holds the full
state dict, on every rank or, with ``rank0_only=True``, on rank 0 alone (the
other ranks still join every gather and receive ``{}``).

``gather_main_weights_to`` / ``gather_items_to`` send the pieces to one rank instead
(Megatron-LM's legacy ``--ckpt-format torch`` writer): the destination receives one
rank's shard of a group at a time, the others send theirs, so no rank ever holds a
group unsharded on the device; only the destination's host memory holds the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..comm import collectives
from .model_state_dict import _alias_names, _persistent_buffers, extra_states, torch_key

if TYPE_CHECKING:
    from ..megatron_fsdp import MegatronFSDP
    from ..buffers.param_and_grad_buffer import ParameterGroup


@torch.no_grad()
def gather_full_state_dict(
    model: "MegatronFSDP",
    *,
    dtype: Optional[torch.dtype] = None,
    device: torch.device | str = "cpu",
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Full main weights and persistent buffers keyed like the unwrapped module.
    Collective over the model's groups: every rank must call it."""
    device = torch.device(device)
    keep = not rank0_only or dist.get_rank() == 0
    buffer = model.param_and_grad_buffer
    model.settle_weights_for_reading()  # edits since the step included
    timeout = model.all_gather_pipeline.timeout
    full: dict[str, torch.Tensor] = {}
    for group in buffer.groups:
        flat, temporary = _gather_main_weights(group, timeout)
        if keep:
            for index, (name, param) in enumerate(zip(group.names, group.params)):
                start, end = group.layout.item_range(index)
                full[name] = _export(flat[start:end].view(param.shape), dtype, device)
        if temporary:
            del flat  # one group's bucket at a time on the device
    if not keep:
        return {}
    # Tied weights appear under every name, as in nn.Module.state_dict().
    out = {alias: full[name] for alias, name in _alias_names(model).items()}
    for name, value in _persistent_buffers(model.module):
        out[torch_key(name)] = _export(value.detach(), None, device)
    return out


def _export(value: torch.Tensor, dtype: Optional[torch.dtype], device: torch.device) -> torch.Tensor:
    """A private copy on ``device`` (never a view of a live buffer)."""
    return value.to(device=device, dtype=dtype or value.dtype, copy=True)


def _gather_main_weights(group: "ParameterGroup", timeout) -> tuple[torch.Tensor, bool]:
    """The unsharded main weights of one group (and whether that is a temporary)."""
    source = group.main_weight_source
    if not source.is_distributed:
        return source.data, False
    outer = group.hfsdp and source is group.main_weights
    return gather_unsharded(group, source.data, outer=outer, label=f"export:{group.label}", timeout=timeout), True


def gather_unsharded(group: "ParameterGroup", flat: torch.Tensor, *, outer: bool, label: str, timeout) -> torch.Tensor:
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
    group: "ParameterGroup",
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


@torch.no_grad()
def gather_main_weights_to(
    model: "MegatronFSDP",
    *,
    dst: int = 0,
    pg: Optional[dist.ProcessGroup] = None,
    comm_device: Optional[torch.device] = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Every parameter's full main weights (the optimizer's precision), keyed by the
    buffer's parameter names, on global rank ``dst``; ``{}`` on the others. Each rank
    contributes the shard its optimizer owns (``gather_items_to``). Collective: every
    rank calls it (``settle_weights_for_reading`` first)."""
    model.settle_weights_for_reading()
    out: dict[str, torch.Tensor] = {}
    for group in model.param_and_grad_buffer.groups:
        source = group.main_weight_source
        if group.strategy.shards_optimizer and not group.hfsdp:
            # This rank's own shard is authoritative whether or not the buffer is
            # replicated (a replicated one is refreshed from the others after the step).
            local = source.data if source.is_distributed else source.shard
        else:
            local = source.data
        items = gather_items_to(group, local, dst=dst, pg=pg, comm_device=comm_device, device=device)
        if items is not None:
            out.update({name: item.view(param.shape) for name, param, item in zip(group.names, group.params, items)})
    return out


def compute_dtypes(model: "MegatronFSDP") -> dict[str, torch.dtype]:
    """Each parameter's compute (model-weight) dtype, keyed as ``gather_main_weights_to``."""
    return {name: group.dtype for group in model.param_and_grad_buffer.groups for name in group.names}


def module_state_dict_from(model: "MegatronFSDP", weights: dict[str, torch.Tensor], *,
                           device: torch.device | str = "cpu") -> dict[str, Any]:
    """The wrapped module's ``state_dict()`` (its keys, tied weights under every name,
    persistent buffers and modules' extra state) with parameter values from
    ``weights`` (``gather_main_weights_to``'s keys) cast to their compute dtype, as
    the model weights are cast from the main weights after each step."""
    device = torch.device(device)
    dtypes = compute_dtypes(model)
    cast = {name: value.to(dtype=dtypes[name]) for name, value in weights.items()}
    out: dict[str, Any] = {alias: cast[name] for alias, name in _alias_names(model).items()}
    for name, value in _persistent_buffers(model.module):
        out[torch_key(name)] = _export(value.detach(), None, device)
    for key, sub in extra_states(model.module):
        out[key] = sub.get_extra_state()
    # nn.Module.state_dict()'s order (each module's parameters, buffers, extra state in turn);
    # between steps the module holds the distributed parameters: nothing is gathered.
    order = {torch_key(key): i for i, key in enumerate(model.module.state_dict(keep_vars=True))}
    return dict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))
