"""The optimizer's state dict in the model state dict's standard form.

[Note: standard optimizer state] The optimizer steps the distributed parameters:
DTensors whose local tensor is a flat 1-D slice of the group's flat buffer,
possibly uneven, empty or starting mid-row (see [Note: standard state-dict
DTensors] in model_state_dict.py). Its per-parameter state (Adam's moments) is cut the
same way. No DTensor placement describes such a slice, so ``optimizer.state_dict()``
does not hand it out: a post-hook (``Optimizer.register_state_dict_post_hook``,
torch's extension point; no closure is stored on any tensor, so the result
pickles) turns every parameter-shaped state tensor into the DTensor
``model.state_dict()`` gives for the weight: whole rows split like ``torch.chunk``
over the dp-shard mesh dimension (``Shard(0)``), ``Replicate()`` for replicated
groups. Scalars (Adam's ``step``) and the key structure stay exactly torch's:
integer parameter ids in ``state``, ``param_groups`` with ``params`` lists, so
upstream's checkpoints (same keys, DCP addresses data by global offsets) load.

Cost of ``state_dict()``: for each parameter group and state key, in turn, one
all-gather of the group's flat state (the group's unsharded size in temporary
memory, freed before the next key), plus the returned standard pieces, which
are about the size of the live state (each tensor's rows split ``world`` ways).

Loading (``Optimizer.register_load_state_dict_pre_hook``) goes the other way,
one tensor at a time: any DTensor layout (our standard one as DCP filled it,
upstream's uneven one) or a plain full tensor becomes the full tensor (a
collective over the value's mesh; the largest parameter's size in temporary
memory), of which this rank keeps its flat slice. Collective: every rank must
call ``state_dict()`` / ``load_state_dict()`` with the same parameters and keys.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..buffers.param_and_grad_buffer import ParameterGroup
from .gather import gather_items_to, gather_unsharded
from ..runtime.owners import owner_of
from ..buffers.piece_dtensor import PieceDTensor, piece_dtensor
from .model_state_dict import full_value, standard_dtensor
from .sharded_model import ShardedModel


def indexed_params(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Index -> parameter as ``Optimizer.state_dict`` numbers them (first appearance)."""
    seen: dict[int, int] = {}
    out: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen[id(p)] = len(seen)
                out[seen[id(p)]] = p
    return out


def _is_piece(value: Any, param: torch.Tensor) -> bool:
    """Per-parameter state cut like the parameter (Adam's moments; not ``step``)."""
    return isinstance(value, DTensor) and value.dim() > 0 and value.shape == param.shape


def _models(params: Iterable[torch.Tensor]) -> list[ShardedModel]:
    """The models owning ``params``, in first-appearance order (the same on every rank)."""
    models: list[ShardedModel] = []
    for p in params:
        model = owner_of(p)
        if model is not None and model not in models:
            models.append(model)
    return models


# -- state_dict(): flat pieces -> standard DTensors ------------------------------------------
@torch.no_grad()
def standardize_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post-hook: see [Note: standard optimizer state]."""
    params = indexed_params(optimizer)
    # Optimizer.state_dict() hands out the live per-parameter dicts: rewrite copies.
    states = state_dict["state"] = {i: dict(s) for i, s in state_dict.get("state", {}).items()}
    for model in _models(params.values()):
        buffer = model.param_and_grad_buffer
        entries: dict[ParameterGroup, list[tuple[int, int]]] = {}
        for index, param in params.items():
            slot = buffer.dist_slot(param) if owner_of(param) is model else None
            if slot is not None and index in states and slot[0].strategy.shards_optimizer:
                entries.setdefault(slot[0], []).append((index, slot[1]))
            elif slot is not None and index in states:  # replicated: already whole, only the type
                states[index] = {k: _plain_dtensor(v) for k, v in states[index].items()}
        timeout = model.all_gather_pipeline.timeout
        for group in buffer.groups:  # the buffer's order: the same collectives on every rank
            if group in entries:
                _standardize_group(group, entries[group], states, timeout, buffer.tp_spec)
    return state_dict


def _plain_dtensor(value: Any) -> Any:
    """A replicated ``PieceDTensor`` (no_shard's states) as the plain DTensor a standard
    state dict holds, sharing its local tensor."""
    if not isinstance(value, PieceDTensor):
        return value
    return DTensor.from_local(value.to_local(), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _standardize_group(group: ParameterGroup, entries: list[tuple[int, int]], states: dict, timeout, tp_spec) -> None:
    """Replace the flat state pieces of one sharded group's parameters, one state
    key at a time (one unsharded flat bucket of the group alive at a time).
    ``tp_spec``: compute parameter -> its tensor-parallel layout or ``None``."""
    keys = sorted({k for i, item in entries for k, v in states[i].items() if _is_piece(v, group.dist_params[item])})
    layout = group.optimizer_layout
    base = group.dp.optimizer_rank * layout.shard_numel
    for key in keys:
        like = next(states[i][key] for i, item in entries if _is_piece(states[i].get(key), group.dist_params[item]))
        local = torch.zeros(layout.shard_numel, dtype=like.dtype, device=like.to_local().device)
        for i, item in entries:
            value = states[i].get(key)
            start, numel = group.optimizer_piece(item)
            if _is_piece(value, group.dist_params[item]) and numel:
                local[start - base : start - base + numel].copy_(value.to_local().reshape(-1))
        flat = gather_unsharded(group, local, outer=group.hfsdp, label=f"optimizer_state:{group.label}", timeout=timeout)
        for i, item in entries:
            if _is_piece(states[i].get(key), group.dist_params[item]):
                start, end = group.layout.item_range(item)
                param = group.params[item]
                states[i][key] = standard_dtensor(group, flat[start:end].view(param.shape),
                                                  tp_spec(param))
        del flat, local


# -- whole tensors on one rank (legacy one-file checkpoints) ----------------------------------
def packed_param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """``param_groups`` as ``Optimizer.state_dict()`` packs them (hyper-parameters, and
    ``params`` as integer ids numbered by first appearance), without its hooks."""
    ids: dict[int, int] = {}
    groups = []
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [ids.setdefault(id(p), len(ids)) for p in group["params"]]
        groups.append(packed)
    return groups


@torch.no_grad()
def gather_optimizer_state_to(
    optimizer: torch.optim.Optimizer,
    *,
    dst: int = 0,
    pg: Optional[dist.ProcessGroup] = None,
    comm_device: Optional[torch.device] = None,
    device: "torch.device | str" = "cpu",
) -> dict:
    """``Optimizer.state_dict()``'s structure with every per-parameter tensor whole
    and private on ``device``, on global rank ``dst``; ``{}`` on the others.

    Sharded state travels to ``dst`` shard by shard, one group and state key at a
    time (``full_state_dict.gather_items_to``): no rank holds a group's state
    unsharded on the device, and only ``dst``'s host memory holds the result
    (``optimizer.state_dict()`` instead all-gathers each group's state on every
    rank). Replicated state is copied by ``dst`` alone. Collective: every rank calls
    it with the same parameters and state keys."""
    device = torch.device(device)
    keep = dist.get_rank() == dst
    params = indexed_params(optimizer)
    states: dict[int, dict] = {}
    sharded: dict[ShardedModel, dict[ParameterGroup, list[tuple[int, int]]]] = {}
    for index, param in params.items():
        live = optimizer.state.get(param)
        if live is None:
            continue
        model = owner_of(param)
        slot = model.param_and_grad_buffer.dist_slot(param) if model is not None else None
        if slot is not None and slot[0].strategy.shards_optimizer:
            sharded.setdefault(model, {}).setdefault(slot[0], []).append((index, slot[1]))
        if keep:
            states[index] = {k: _private(v, device) for k, v in live.items()
                             if slot is None or not slot[0].strategy.shards_optimizer or not _is_piece(v, param)}
    for model in _models(params.values()):  # first-appearance order: the same on every rank
        entries = sharded.get(model, {})
        for group in model.param_and_grad_buffer.groups:  # the buffer's order, as every rank
            if group in entries:
                _gather_group_state(group, entries[group], params, optimizer, states if keep else None,
                                    dst=dst, pg=pg, comm_device=comm_device, device=device)
    if not keep:
        return {}
    # Keys in the optimizer's order, as Optimizer.state_dict() lists them.
    return {"state": {i: states[i] for i in sorted(states)}, "param_groups": packed_param_groups(optimizer)}


def _private(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value  # replicated: the whole tensor
    return local.detach().to(device, copy=True)


def _gather_group_state(group: ParameterGroup, entries: list[tuple[int, int]], params: dict[int, torch.Tensor],
                        optimizer: torch.optim.Optimizer, states: Optional[dict], **send) -> None:
    """One sharded group's parameter-shaped state, key by key, to ``dst`` (``states``
    there, ``None`` elsewhere): this rank's pieces laid into its shard of the flat
    bucket, then ``gather_items_to``."""
    keys = sorted({k for i, item in entries for k, v in optimizer.state[params[i]].items()
                   if _is_piece(v, group.dist_params[item])})
    layout = group.optimizer_layout
    base = group.dp.optimizer_rank * layout.shard_numel
    for key in keys:
        like = next(optimizer.state[params[i]][key] for i, item in entries
                    if _is_piece(optimizer.state[params[i]].get(key), group.dist_params[item]))
        local = torch.zeros(layout.shard_numel, dtype=like.dtype, device=like.to_local().device)
        for i, item in entries:
            value = optimizer.state[params[i]].get(key)
            start, numel = group.optimizer_piece(item)
            if _is_piece(value, group.dist_params[item]) and numel:
                local[start - base : start - base + numel].copy_(value.to_local().reshape(-1))
        items = gather_items_to(group, local, **send)
        del local
        if states is None or items is None:
            continue
        for i, item in entries:
            if _is_piece(optimizer.state[params[i]].get(key), group.dist_params[item]):
                states[i][key] = items[item].view(group.params[item].shape)


# -- load_state_dict(): any layout -> flat pieces ----------------------------------------------
@torch.no_grad()
def flatten_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.load_state_dict`` pre-hook: every parameter-shaped state tensor
    becomes what the optimizer steps (this rank's flat piece as a DTensor shaped
    like the parameter). The caller's dicts are not modified."""
    # The saved keys name parameters by position, as Optimizer.load_state_dict pairs
    # them: integer ids from state_dict(), or FQNs from torch.distributed.checkpoint's
    # set_optimizer_state_dict (which leaves them for the positions to resolve).
    saved = itertools.chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
    params = dict(zip(saved, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
    state_dict = dict(state_dict)
    states = {}
    for index in sorted(state_dict.get("state", {}), key=str):  # one order on every rank
        param_state = state_dict["state"][index]
        param = params.get(index)
        model = owner_of(param) if param is not None else None
        if model is None or not isinstance(param_state, dict):
            states[index] = param_state  # torch's own load reports what does not fit
            continue
        converted = {  # sorted: the same collectives on every rank
            key: _flat_piece(model, param, value)
            for key, value in sorted(param_state.items())
            if _is_state_tensor(value, param)
        }
        states[index] = {key: converted.get(key, value) for key, value in param_state.items()}
    state_dict["state"] = states
    return state_dict


def _is_state_tensor(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _flat_piece(model: ShardedModel, param: DTensor, value: torch.Tensor) -> DTensor:
    """This rank's part of ``value`` (any DTensor layout or a full tensor of
    ``param``'s shape), cut and wrapped as ``param`` is. Collective for DTensors."""
    local = param.to_local()
    # A plain tensor is cut where it is (host memory, possibly a memory-mapped file)
    # and only the piece moves; a DTensor is gathered whole first.
    full = value if not isinstance(value, DTensor) else full_value(value, local.device)
    spec = model.param_and_grad_buffer.tp_spec(param)
    if spec is not None:
        full = spec.local_of(full)  # this rank's tensor-parallel piece
    if local.shape == full.shape:  # replicated over the data-parallel ranks: the whole tensor
        piece = full.to(device=local.device, dtype=local.dtype, copy=True)
    else:
        start = model.param_and_grad_buffer.local_flat_start(param)
        piece = full.reshape(-1)[start : start + local.numel()].to(device=local.device, dtype=local.dtype, copy=True)
    if isinstance(param, PieceDTensor):  # keep the parameter's type (piece_dtensor.py)
        return piece_dtensor(piece, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return DTensor.from_local(
        piece, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def state_dict_hooks(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Register both hooks on ``optimizer``; returns their removable handles."""
    return [
        optimizer.register_state_dict_post_hook(standardize_optimizer_state_dict),
        optimizer.register_load_state_dict_pre_hook(flatten_optimizer_state_dict),
    ]


__all__ = ["flatten_optimizer_state_dict", "gather_optimizer_state_to", "indexed_params", "packed_param_groups",
           "standardize_optimizer_state_dict", "state_dict_hooks"]
