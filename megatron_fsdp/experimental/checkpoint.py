"""Checkpoints and full weights of an experimentally sharded model.

``save_checkpoint`` / ``load_checkpoint`` write and read one file per rank with
that rank's rows of every main weight and of the optimizer state (same world
size, mesh and model on load: checked, with an error naming the difference).
Upstream writes a resharding DCP checkpoint instead; see the README for the gap.

``full_state_dict`` gathers the full main weights through the DBuffers (never
through ``DTensor.full_tensor()``, which assumes torch's even row split; see
[Note: uneven shards] in dbuffer.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .dbuffer import DBuffer
from .module import FsdpModule
from .parameter_group import sync_model_weights_from_main_weights

__all__ = ["save_checkpoint", "load_checkpoint", "full_state_dict"]

_FORMAT = "megatron_fsdp.experimental/rank-local/1"


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
                    for fqn in p.fqns:
                        out[prefix + fqn] = full.get_local_tensor(index).clone()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in out and not isinstance(p, DTensor):
            out[name] = p.detach().clone()
    return out


def _path(checkpoint_dir: str | os.PathLike) -> str:
    return os.path.join(os.fspath(checkpoint_dir), f"rank{dist.get_rank():05d}.pt")


def _local(value: Any) -> Any:
    return value.to_local().clone() if isinstance(value, DTensor) else value


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Write this rank's shards of ``model``'s weights and ``optimizer``'s state."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    model_state = {name: _local(p.detach()) for name, p in model.named_parameters()}
    optim_state = optimizer.state_dict()
    optim_state["state"] = {
        index: {key: _local(value) for key, value in state.items()} for index, state in optim_state["state"].items()
    }
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    torch.save(
        {"format": _FORMAT, "world": dist.get_world_size(), "shapes": shapes, "model": model_state, "optimizer": optim_state},
        _path(checkpoint_dir),
    )
    dist.barrier()


def _as_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local.to(like.device), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_dir: str | os.PathLike,
    *,
    sync_model_weights: bool = True,
) -> None:
    """Read what ``save_checkpoint`` wrote into the same (sharded) model and optimizer."""
    saved = torch.load(_path(checkpoint_dir), weights_only=False)
    if saved.get("format") != _FORMAT:
        raise ValueError(f"{checkpoint_dir} is not a megatron_fsdp.experimental checkpoint ({saved.get('format')!r})")
    if saved["world"] != dist.get_world_size():
        raise ValueError(
            f"checkpoint was written by {saved['world']} ranks, this run has {dist.get_world_size()}; "
            "this rank-local format does not reshard: load with the same world size"
        )
    params = dict(model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    if shapes != saved["shapes"]:
        diff = sorted(set(shapes.items()) ^ set(saved["shapes"].items()))
        raise ValueError(f"checkpoint parameters differ from the model's: {diff[:6]}")
    for name, p in params.items():
        target = p.to_local() if isinstance(p, DTensor) else p
        target.copy_(saved["model"][name])
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state = saved["optimizer"]
    optim_state["state"] = {
        index: {key: _as_like(v, ordered[index]) if key != "step" and torch.is_tensor(v) and v.dim() else v
                for key, v in state.items()}
        for index, state in optim_state["state"].items()
    }
    optimizer.load_state_dict(optim_state)
    if sync_model_weights:
        sync_model_weights_from_main_weights(model.parameters())
    dist.barrier()
