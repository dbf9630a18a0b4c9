"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP).

``save_checkpoint`` / ``load_checkpoint`` handle a model (a ``MegatronFSDP`` or any
module, e.g. DDP-wrapped) and its optimizer. Saves are atomic: every rank writes
into ``<dir>.tmp``; only when all ranks are done does rank 0 rename it to
``<dir>``, so a crash mid-save leaves the previous checkpoint intact. Loads
validate keys and shapes against the checkpoint's metadata before reading
anything, and reshard freely (DCP reads by global offsets).
"""

from __future__ import annotations

import hashlib
import json
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

from .eager_state import init_optimizer_state
from .optimizer_names import (checkpoint_keys_by_name, keys_by_name, loads_keyed_by_name, parameter_names,
                              state_dict_by_name)
from .optimizer_state_dict import indexed_params, standardize_optimizer_state_dict
from .model_state_dict import StateDictMismatchError, clone_for_load, other_ranks_expert_keys, state_dicts_on

logger = logging.getLogger(__name__)

EXTRA_STATE_FILE = "extra_state_rank{rank}.pt"
CHECKSUM_FILE = "checksums.json"
"""sha256 of every other file of the checkpoint, written last (at save) and checked
before anything is read (at load)."""


class CheckpointReadError(RuntimeError):
    """The checkpoint's files could not be read (corrupted, truncated, incomplete)."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a peer died, the disk filled); nothing was published."""


# -- optimizer state ----------------------------------------------------------------
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create the optimizer's state tensors (as its first step would, without taking
    one: no parameter and no existing state changes), so that a checkpoint can be
    loaded into them in place. ``fully_shard_optimizer`` already does this; returns
    the parameters that got new state."""
    return init_optimizer_state(optimizer)


# -- save ---------------------------------------------------------------------------------
def checkpoint_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """What ``save_checkpoint`` hands DCP: ``{"model": ..., "optimizer": ...}`` (the launcher's
    asynchronous save writes the same layout); a MoE model's optimizer state keyed by
    parameter name ([Note: optimizer state by parameter name])."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        if keys_by_name(model):
            state["optimizer"] = state_dict_by_name(model, optimizer, state["optimizer"])
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
        dcp.save(checkpoint_state(model, optimizer), checkpoint_id=str(tmp))
        if extra_state is not None:
            torch.save(extra_state, tmp / EXTRA_STATE_FILE.format(rank=rank))
        phase = "waiting for every rank to finish writing"
        dist.barrier()
        phase = "recording checksums"
        _write_checksums(tmp)
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


# -- checksums ------------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (also the legacy torch format's checksums)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_checksums(directory: Path) -> None:
    """Each rank hashes its share of the files; rank 0 writes them all. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKSUM_FILE)
    mine = {name: file_sha256(directory / name) for i, name in enumerate(files) if i % world == rank}
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        table = {name: digest for share in shares for name, digest in share.items()}
        (directory / CHECKSUM_FILE).write_text(json.dumps(table, indent=0, sort_keys=True))
    dist.barrier()


def _verify_checksums(directory: Path) -> None:
    """Raise CheckpointReadError naming every missing or altered file, on every rank,
    before anything is read. Checkpoints written before checksums existed pass."""
    table_file = directory / CHECKSUM_FILE
    problems: list[str] = []
    table: dict[str, str] = {}
    if table_file.exists():
        try:
            table = json.loads(table_file.read_text())
        except (ValueError, OSError) as exc:
            problems.append(f"{CHECKSUM_FILE} is unreadable ({exc})")
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (name, digest) in enumerate(sorted(table.items())):
        if i % world != rank:
            continue
        path = directory / name
        if not path.exists():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name} does not match its checksum (altered or truncated)")
    found: list = [None] * world
    dist.all_gather_object(found, problems)
    problems = [p for share in found for p in share]
    if problems:
        raise CheckpointReadError(
            f"the checkpoint at {directory} is damaged: {'; '.join(problems)}. Nothing was loaded; the model and "
            "optimizer are unchanged. Load an earlier checkpoint."
        )


# -- load -----------------------------------------------------------------------------------
def _checkpoint_path(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if (path / ".metadata").exists():
        return path
    old = path.with_name(path.name + ".old")  # a crash between the two renames of _publish
    if (old / ".metadata").exists():
        return old
    raise FileNotFoundError(f"no checkpoint at {path} (no .metadata file); check the path passed to --load / load_checkpoint")


def _other_ranks_expert_keys(model: nn.Module) -> set[str]:
    """The expert parameters other expert-parallel ranks hold (collective over that group):
    a checkpoint holds every expert, this rank loads its own."""
    if getattr(model, "dist_index", None) is None:  # not a MegatronFSDP: no experts spread over ranks
        return set()
    return other_ranks_expert_keys(model)


def _validate_model_keys(model_state: dict, metadata: dict, held_elsewhere: set[str] = frozenset()) -> None:
    saved = {k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.")}
    missing = [k for k in model_state if k not in saved]
    unexpected = [k for k in saved if k not in model_state and k.removeprefix("module.") not in held_elsewhere]
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


_WRAPPER_PREFIX = "module."


def _wrapper_renames(model_keys, metadata: dict) -> Optional[dict[str, str]]:
    """Model key -> checkpoint key, when the checkpoint was written through the other
    side of a wrapper: ``MegatronFSDP.state_dict()`` keys its entries ``module.<name>``
    (upstream's convention), a bare or DDP-unwrapped module ``<name>``. A run that
    switches between PyTorch DDP and Megatron-FSDP resumes across that prefix, as
    Megatron-LM's parallelism-agnostic checkpoints do; ``None`` unless every key
    matches after the rename."""
    saved = {k[len("model."):] for k in metadata if k.startswith("model.")}
    keys = list(model_keys)
    if not keys or set(keys) == saved:
        return None
    if all(k.startswith(_WRAPPER_PREFIX) for k in keys):
        renames = {k: k[len(_WRAPPER_PREFIX):] for k in keys}
    else:
        renames = {k: _WRAPPER_PREFIX + k for k in keys}
    return renames if set(renames.values()) == saved else None


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
    _verify_checksums(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # a corrupt .metadata: unpickling errors of any kind
        raise CheckpointReadError(
            f"could not read {path / '.metadata'} ({type(exc).__name__}: {exc}); nothing was loaded. "
            "Load an earlier checkpoint."
        ) from exc
    # DCP reads into host copies (state_dicts_on: built there; clone_for_load: live
    # references such as buffers copied there), so the device never holds a second
    # copy of the model or optimizer state, and nothing live changes until all is read.
    with state_dicts_on("cpu"):
        model_state = tree_map(clone_for_load, model.state_dict())
    renames = _wrapper_renames(model_state, metadata)
    if renames is not None:
        model_state = {renames[k]: v for k, v in model_state.items()}
    _validate_model_keys(model_state, metadata, held_elsewhere=_other_ranks_expert_keys(model))
    by_name = optimizer is not None and checkpoint_keys_by_name(metadata)
    created: list[torch.Tensor] = []
    try:
        state: dict[str, Any] = {"model": model_state}
        absent: list[int] = []
        if optimizer is not None:
            if any(k.startswith("optimizer.state.") for k in metadata):
                created = materialize_optimizer_state(optimizer)
            with state_dicts_on("cpu"):
                standard = _standard_state_dict(optimizer)
                if by_name:
                    standard = state_dict_by_name(model, optimizer, standard)
                state["optimizer"] = tree_map(clone_for_load, standard)
            absent = _prune_absent_optimizer_state(state["optimizer"], metadata)
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        for param in created:  # undo the state materialised for the load
            optimizer.state.pop(param, None)
        raise CheckpointReadError(
            f"could not read the checkpoint at {path} (corrupted or incomplete files?); the model and "
            f"optimizer were left unchanged. Load an earlier checkpoint. Cause: {exc}"
        ) from exc
    if renames is not None:
        back = {saved: own for own, saved in renames.items()}
        state["model"] = {back[k]: v for k, v in state["model"].items()}
    model.load_state_dict(state["model"])
    if optimizer is not None:
        with loads_keyed_by_name(model, optimizer, by_name):
            optimizer.load_state_dict(state["optimizer"])
        params = indexed_params(optimizer)
        names = parameter_names(model, optimizer) if by_name else None
        for key in absent:
            optimizer.state.pop(params[names.index(key) if by_name else key], None)
    return _load_extra_state(path)


def _standard_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` in the standard form DCP loads into. A plain optimizer
    over a wrapped model's parameters that never stepped is not bound yet (optimizer.py
    [Note: plain optimizers]): its state dict still holds the flat pieces, which name
    no DTensor layout, so it is standardised here as a bound one's would be. The
    loaded standard state is flattened again when the first step binds it."""
    state_dict = optimizer.state_dict()
    if getattr(optimizer, "megatron_fsdp_binding", None) is None:
        state_dict = standardize_optimizer_state_dict(optimizer, state_dict)
    return state_dict


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
    "save_checkpoint",
]
