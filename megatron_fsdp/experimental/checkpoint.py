"""Checkpoints and full weights of an experimentally sharded model.

``save_checkpoint`` / ``load_checkpoint`` write and read a PyTorch Distributed
Checkpoint (DCP) of the main weights and the optimizer state. A rank's rows of a
tensor follow the flat layout, not DTensor's even split, so each local shard tells
DCP its true global extent (``dcp_chunks.py``; the main engine writes standard
torch.chunk DTensors instead); loads therefore reshard to another
world size, placement or tensor-parallel size (a tensor-parallel rank's local rows
are a flat range of its TP piece, placed inside the whole tensor).

``full_state_dict`` gathers the full main weights through the DBuffers (never
through ``DTensor.full_tensor()``, which is exact on ``FlatDTensor`` parameters but
gathers one tensor at a time; see [Note: uneven shards] in dbuffer.py), then the
tensor-parallel pieces over tp.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .dbuffer import DBuffer
from .dcp_chunks import checkpointable
from .module import FsdpModule
from .parameter_group import sync_model_weights_from_main_weights

__all__ = ["save_checkpoint", "load_checkpoint", "full_state_dict"]



def _replicated(buffer: DBuffer) -> DBuffer:
    for axis in range(buffer.mesh.ndim):
        placements = list(buffer.placements)
        placements[axis] = Replicate()
        buffer = buffer.redistribute(placements)
    return buffer


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as a full tensor on every rank (main-weight dtype).
    A collective: call it on every rank."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        prefix = f"{prefix}." if prefix else ""
        if isinstance(module, FsdpModule):
            for group in module.parameter_groups:
                full = _replicated(group.main_weight)
                for index, p in enumerate(group.fsdp_parameters):
                    piece = full.get_local_tensor(index)
                    whole = piece.clone() if p.tp is None else p.tp.full(piece)  # the TP pieces gathered
                    for fqn in p.fqns:
                        out[prefix + fqn] = whole
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in out and not isinstance(p, DTensor):
            out[name] = p.detach().clone()
    return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one physical parameter's local values lie in the whole tensor."""

    name: str
    parameter: torch.Tensor
    flat_start: int
    """Where its local rows start in the flat order of the tensor, or of its TP piece."""
    piece_shape: Optional[torch.Size] = None
    """Shape of its tensor-parallel piece (``None``: no tensor parallelism)."""
    piece_offsets: Optional[tuple[int, ...]] = None
    """Where that piece starts in the whole tensor."""

    def checkpointable(self, value: torch.Tensor) -> torch.Tensor:
        return checkpointable(value, self.parameter, self.flat_start, piece_shape=self.piece_shape,
                              piece_offsets=self.piece_offsets)


def _sharded_entries(model: nn.Module) -> dict[int, _Entry]:
    """id(sharded parameter) -> its ``_Entry``. One per physical parameter (tied ones once)."""
    entries: dict[int, _Entry] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, FsdpModule):
            continue
        prefix = f"{prefix}." if prefix else ""
        for group in module.parameter_groups:
            shapes = group.main_weight.layout.tensor_shapes
            for index, p in enumerate(group.fsdp_parameters):
                part = group.main_weight._owned(index)
                start = part.item_start if part else 0
                piece = {} if p.tp is None else dict(piece_shape=shapes[index], piece_offsets=p.tp.piece_offsets())
                entries[id(p.sharded)] = _Entry(prefix + p.fqns[0], p.sharded, start, **piece)
    for name, p in model.named_parameters():
        if id(p) not in entries:
            entries[id(p)] = _Entry(name, p, 0)
    return entries


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Tensors sharing storage with the live weights and optimizer state, each local
    shard carrying its true global extent for DCP (dcp_chunks.attach_dcp_chunks)."""
    entries = _sharded_entries(model)
    state: dict[str, Any] = {}
    for entry in entries.values():
        state[f"model.{entry.name}"] = entry.checkpointable(entry.parameter)
    for p, values in optimizer.state.items():
        entry = entries[id(p)]
        for key, value in values.items():
            if isinstance(value, DTensor) and value.shape == entry.parameter.shape:
                state[f"optimizer.{entry.name}.{key}"] = entry.checkpointable(value)
            elif torch.is_tensor(value):
                state[f"optimizer.{entry.name}.{key}"] = value  # e.g. AdamW's step: the same on every rank
    return state


@torch.no_grad()
def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors for DCP to load into: one step on zero
    gradients, with the weights restored afterwards (the load overwrites the state)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p.to_local() if isinstance(p, DTensor) else p).clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p, dtype=getattr(p, "grad_dtype", None) or p.dtype)
    optimizer.step()
    for p, value in zip(params, saved):
        (p.to_local() if isinstance(p, DTensor) else p).copy_(value)
        p.grad = None


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Write ``model``'s main weights and ``optimizer``'s state as a DCP checkpoint
    that loads at another world size or placement."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    state = _dcp_state(model, optimizer)
    # Hyperparameters (lr, betas, ...) as one opaque object: DCP would flatten a list.
    blob = io.BytesIO()
    torch.save(groups, blob)
    state["optimizer_param_groups"] = blob
    dcp.save(state, checkpoint_id=os.fspath(checkpoint_dir))


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_dir: str | os.PathLike,
    *,
    sync_model_weights: bool = True,
) -> None:
    """Read a ``save_checkpoint`` checkpoint into a sharded model and its optimizer,
    in place (DCP reshards to this run's world size and placements)."""
    _init_optimizer_state(model, optimizer)
    state = _dcp_state(model, optimizer)
    state["optimizer_param_groups"] = io.BytesIO()
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_dir))
    groups = state["optimizer_param_groups"]
    if isinstance(groups, io.BytesIO):  # DCP fills the placeholder stream in place
        groups.seek(0)
        groups = torch.load(groups, weights_only=False)
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{checkpoint_dir}: optimizer param groups {groups!r} do not match this optimizer's")
    for live, loaded in zip(optimizer.param_groups, groups):
        live.update(loaded)
    if sync_model_weights:
        sync_model_weights_from_main_weights(model.parameters())
