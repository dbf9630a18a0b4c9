"""Export a sharded model as one plain state dict, piece by piece.

The full fp32 weights of a large model do not fit beside training state on one GPU
(32 GB for 8B parameters). So the export walks the parameter groups one at a time:
gather one group's main weights into a temporary device bucket (one FSDP unit's
worth), copy each parameter out to host memory, drop the bucket, go on. Device
memory grows by one group's unsharded bucket at most; host memory holds the full
state dict, on every rank or, with ``rank0_only=True``, on rank 0 alone (the
other ranks still join every gather and receive ``{}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from . import collectives
from .state_dict import _alias_names, _persistent_buffers, torch_key

if TYPE_CHECKING:
    from .megatron_fsdp import MegatronFSDP
    from .param_and_grad_buffer import ParameterGroup


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
