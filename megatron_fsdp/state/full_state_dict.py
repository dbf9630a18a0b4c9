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

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..buffers.tensor_parallel import TPSpec
from .gather import gather_items_to, gather_main_weights
from .keys import alias_names, extra_states, persistent_buffers, torch_key
from .sharded_model import ShardedModel


@torch.no_grad()
def gather_full_state_dict(
    model: ShardedModel,
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
    experts = _expert_groups(model)
    for group in buffer.groups:
        flat, temporary = gather_main_weights(group, timeout)
        for index, (name, param) in enumerate(zip(group.names, group.params)):
            start, end = group.layout.item_range(index)
            value = whole_tensor(flat[start:end].view(param.shape), buffer.tp_spec(param))
            if keep or group.dp is experts:  # experts travel to the other expert-parallel ranks below
                full[name] = _export(value, dtype, device)
        if temporary:
            del flat  # one group's bucket at a time on the device
    others = _other_ranks_experts(model, {n: full[n] for g in buffer.groups if g.dp is experts for n in g.names},
                                  to_all=not rank0_only)
    if not keep:
        return {}
    # Tied weights appear under every name, as in nn.Module.state_dict().
    out = {alias: full[name] for alias, name in alias_names(model).items()}
    out.update({name: value.to(device) for name, value in others.items()})
    for name, value in persistent_buffers(model.module):
        out[torch_key(name)] = _export(value.detach(), None, device)
    return out


def _expert_groups(model: ShardedModel) -> Any:
    """The experts' data-parallel topology when experts are spread over expert-parallel
    ranks (each rank then holds only its own), else None."""
    index = model.dist_index
    return index.groups_for(True) if index.expt_parallel_group is not None else None


def _other_ranks_experts(model: ShardedModel, mine: dict[str, torch.Tensor], *, to_all: bool) -> dict:
    """[Note: full state dicts under expert parallelism] Each expert-parallel rank holds
    other experts under their global names, so a full state dict gathers them over the
    expert-parallel group: to every rank, or (``to_all=False``) to the group's first rank,
    which for rank 0 is rank 0 itself (Megatron-LM's order: EP groups are consecutive
    ranks). On the host, in pickled form. A model that names its experts by local index
    (the same names on every expert-parallel rank, as megatron-core's ``local_experts``)
    keeps each rank's own under those names: a plain dict cannot hold them all."""
    group = model.dist_index.expt_parallel_group
    if group is None:
        return {}
    mine = {name: value.cpu() for name, value in mine.items()}
    size, me = dist.get_world_size(group), dist.get_rank(group)
    received: list = [None] * size
    if to_all:
        dist.all_gather_object(received, mine, group=group)
    else:
        first = dist.get_global_rank(group, 0)
        dist.gather_object(mine, received if me == 0 else None, dst=first, group=group)
    return {name: value for rank, part in enumerate(received) if rank != me and part
            for name, value in part.items() if name not in mine}


def whole_tensor(local: torch.Tensor, spec: Optional[TPSpec]) -> torch.Tensor:
    """A parameter's whole value from this rank's tensor-parallel piece (gathered over
    the TP ranks: every rank calls it, ``rank0_only`` or not)."""
    if spec is None or not spec.sharded:
        return local
    return spec.dtensor(local).full_tensor()


def _export(value: torch.Tensor, dtype: Optional[torch.dtype], device: torch.device) -> torch.Tensor:
    """A private copy on ``device`` (never a view of a live buffer)."""
    return value.to(device=device, dtype=dtype or value.dtype, copy=True)


@torch.no_grad()
def gather_main_weights_to(
    model: ShardedModel,
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
    if any(spec.sharded for spec in model.param_and_grad_buffer.tp_specs.values()):
        raise NotImplementedError(
            "gathering a tensor-parallel model's weights to one rank (Megatron-LM's legacy --ckpt-format torch) "
            "is not implemented: each tensor-parallel rank holds other pieces. Save a DCP checkpoint "
            "(--ckpt-format torch_dist / torch_dcp, or save_checkpoint), or export with get_full_state_dict"
        )
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


def compute_dtypes(model: ShardedModel) -> dict[str, torch.dtype]:
    """Each parameter's compute (model-weight) dtype, keyed as ``gather_main_weights_to``."""
    return {name: group.dtype for group in model.param_and_grad_buffer.groups for name in group.names}


def module_state_dict_from(model: ShardedModel, weights: dict[str, torch.Tensor], *,
                           device: torch.device | str = "cpu") -> dict[str, Any]:
    """The wrapped module's ``state_dict()`` (its keys, tied weights under every name,
    persistent buffers and modules' extra state) with parameter values from
    ``weights`` (``gather_main_weights_to``'s keys) cast to their compute dtype, as
    the model weights are cast from the main weights after each step."""
    device = torch.device(device)
    dtypes = compute_dtypes(model)
    cast = {name: value.to(dtype=dtypes[name]) for name, value in weights.items()}
    out: dict[str, Any] = {alias: cast[name] for alias, name in alias_names(model).items()}
    for name, value in persistent_buffers(model.module):
        out[torch_key(name)] = _export(value.detach(), None, device)
    for key, sub in extra_states(model.module):
        out[key] = sub.get_extra_state()
    # nn.Module.state_dict()'s order (each module's parameters, buffers, extra state in turn);
    # between steps the module holds the distributed parameters: nothing is gathered.
    order = {torch_key(key): i for i, key in enumerate(model.module.state_dict(keep_vars=True))}
    return dict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))
