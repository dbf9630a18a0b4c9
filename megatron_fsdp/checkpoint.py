"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP).

``save_checkpoint`` / ``load_checkpoint`` handle a model (a ``MegatronFSDP`` or any
module, e.g. DDP-wrapped) and its optimizer. Saves are atomic: every rank writes
into ``<dir>.tmp``; only when all ranks are done does rank 0 rename it to
``<dir>``, so a crash mid-save leaves the previous checkpoint intact. Loads
validate keys and shapes against the checkpoint's metadata before reading
anything, and reshard freely (DCP reads by global offsets).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils._pytree import tree_map
from torch.distributed.tensor import DTensor

from .megatron_fsdp import MegatronFSDP, owner_of
from .state_dict import StateDictMismatchError, checkpointable, clone_for_load

logger = logging.getLogger(__name__)

EXTRA_STATE_FILE = "extra_state_rank{rank}.pt"


class CheckpointReadError(RuntimeError):
    """The checkpoint's files could not be read (corrupted, truncated, incomplete)."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a peer died, the disk filled); nothing was published."""


# -- optimizer state dicts ------------------------------------------------------------
def _indexed_params(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Index -> parameter as ``Optimizer.state_dict`` numbers them (first appearance)."""
    seen: dict[int, int] = {}
    out: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen[id(p)] = len(seen)
                out[seen[id(p)]] = p
    return out


def preprocess_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post-hook: sharded state DTensors carrying DCP chunk metadata."""
    params = _indexed_params(optimizer)
    states = state_dict.get("state", {})
    for index in list(states):
        param = params.get(index)
        model = owner_of(param) if param is not None else None
        if model is None:
            continue
        # Optimizer.state_dict() hands out the live per-parameter dicts: rewrap a copy.
        param_state = states[index] = dict(states[index])
        buffer = model.param_and_grad_buffer
        group, item = buffer.dist_slot(param)
        start = buffer.local_flat_start(param)
        for key, value in param_state.items():
            if isinstance(value, DTensor) and value.shape == param.shape:
                param_state[key] = checkpointable(value, group.params[item], start)
    return state_dict


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors without changing any parameter, so that a
    checkpoint can be loaded into them in place.

    Runs one step of the underlying optimizer with learning rate 0 on zero gradients
    (parameters move by exactly 0); every value it creates is then overwritten by
    the checkpoint. Never called outside loading.
    """
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    zero_grads = []
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                zero_grads.append(p)
    try:
        type(optimizer).step(optimizer)  # the class's step: no model hooks
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lr):
            group["lr"] = lr
        for p in zero_grads:
            p.grad = None


# -- save ---------------------------------------------------------------------------------
def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return state


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    extra_state: Optional[dict] = None,
) -> None:
    """Write model (+ optimizer, + per-rank ``extra_state``) to ``directory``, atomically.
    Collective over the default process group."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    phase = "preparing the temporary directory"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir(parents=True)
        dist.barrier()
        phase = "writing shards (torch.distributed.checkpoint.save)"
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
        if extra_state is not None:
            torch.save(extra_state, tmp / EXTRA_STATE_FILE.format(rank=rank))
        phase = "waiting for every rank to finish writing"
        dist.barrier()
    except (Exception, CheckpointException) as exc:
        raise CheckpointWriteError(
            f"rank {rank}: saving the checkpoint {final} failed while {phase}: {exc}. Nothing was published; "
            f"the previous checkpoint is intact (a partial {tmp.name} may remain and is ignored)."
        ) from exc
    if rank == 0:
        _publish(tmp, final)
    dist.barrier()


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


# -- load -----------------------------------------------------------------------------------
def _checkpoint_path(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if (path / ".metadata").exists():
        return path
    old = path.with_name(path.name + ".old")  # a crash between the two renames of _publish
    if (old / ".metadata").exists():
        return old
    raise FileNotFoundError(f"no checkpoint at {path} (no .metadata file); check the path passed to --load / load_checkpoint")


def _validate_model_keys(model_state: dict, metadata: dict) -> None:
    saved = {k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.")}
    missing = [k for k in model_state if k not in saved]
    unexpected = [k for k in saved if k not in model_state]
    mismatched = [
        f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(v.shape)}"
        for k, v in model_state.items()
        if k in saved and isinstance(saved[k], TensorStorageMetadata) and tuple(saved[k].size) != tuple(v.shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {missing}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
        if mismatched:
            parts.append("shape mismatch: " + "; ".join(mismatched))
        raise StateDictMismatchError(
            "the checkpoint does not fit this model (nothing was loaded): " + " | ".join(parts)
            + ". Build the same architecture as the run that saved it."
        )


def _prune_absent_optimizer_state(opt_state: dict, metadata: dict) -> list[int]:
    """Drop state entries the checkpoint does not have (it was saved before those
    parameters' first step); returns their indices."""
    absent = []
    for index in list(opt_state.get("state", {})):
        keys = [f"optimizer.state.{index}.{k}" for k in opt_state["state"][index]]
        if not all(k in metadata for k in keys):
            absent.append(index)
            del opt_state["state"][index]
    return absent


def load_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> dict:
    """Load what ``save_checkpoint`` wrote (any world size / strategy); returns this
    rank's ``extra_state`` (rank 0's when the world size changed), or ``{}``.

    DCP reads into private copies; the model and optimizer change only once every
    read succeeded, so a bad checkpoint leaves them as they were."""
    path = _checkpoint_path(directory)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _validate_model_keys(model.state_dict(), metadata)
    created: list[torch.Tensor] = []
    try:
        state: dict[str, Any] = {"model": model.state_dict()}
        absent: list[int] = []
        if optimizer is not None:
            if any(k.startswith("optimizer.state.") for k in metadata):
                before = set(optimizer.state)
                materialize_optimizer_state(optimizer)
                created = [p for p in optimizer.state if p not in before]
            state["optimizer"] = optimizer.state_dict()
            absent = _prune_absent_optimizer_state(state["optimizer"], metadata)
        state = tree_map(clone_for_load, state)
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        for param in created:  # undo the state materialised for the load
            optimizer.state.pop(param, None)
        raise CheckpointReadError(
            f"could not read the checkpoint at {path} (corrupted or incomplete files?); the model and "
            f"optimizer were left unchanged. Load an earlier checkpoint. Cause: {exc}"
        ) from exc
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        params = _indexed_params(optimizer)
        for index in absent:
            optimizer.state.pop(params[index], None)
    return _load_extra_state(path)


def _load_extra_state(path: Path) -> dict:
    for rank in (dist.get_rank(), 0):
        file = path / EXTRA_STATE_FILE.format(rank=rank)
        if file.exists():
            return torch.load(file, map_location="cpu", weights_only=False)  # never onto the saving GPU
    return {}


__all__ = [
    "CheckpointReadError",
    "CheckpointWriteError",
    "StateDictMismatchError",
    "load_checkpoint",
    "materialize_optimizer_state",
    "preprocess_optimizer_state_dict",
    "save_checkpoint",
]
