"""Megatron-LM's legacy ``--ckpt-format torch``: one ``torch.save`` file per checkpoint,

    <save>/iter_0000010/mp_rank_00/model_optim_rng.pt
    <save>/latest_checkpointed_iteration.txt

written by data-parallel rank 0 (``mp_rank_00``: tensor and pipeline rank 0, the only
ones here). The file holds Megatron-LM's keys: ``args`` (an ``argparse.Namespace``,
with the consumed-sample counters Megatron-LM resumes from), ``checkpoint_version``,
``iteration``, ``model`` (the unwrapped model's ``state_dict``), ``optimizer``
(``torch.optim``'s ``state_dict``), ``opt_param_scheduler``, ``rng_state`` (a list
indexed by data-parallel rank), ``num_floating_point_operations_so_far``; plus
``megatron_fsdp``, this launcher's exact progress (``TrainState``, loss scale).

[Note: torch format scope] The file holds whole tensors, so it is written only where
every data-parallel rank has all of them: PyTorch DDP (fp32, no distributed optimizer).
Megatron-FSDP and the Megatron-core DDP path keep DTensor shards; Megatron-LM itself
refuses this format with Megatron-FSDP, and here the DDP-path runs are refused too
(``option_problems``) rather than writing a file that holds one rank's shard.

[Note: torch format integrity] As the DCP checkpoints here, the file is staged in
``iter_X.tmp`` and renamed once complete, its SHA-256 digest is recorded beside it
(``checksums.json``, absent from Megatron-LM-written checkpoints) and checked before
it is read, and the tracker names the iteration only after that (``publish_checkpoint``).
A load checks the model's keys and shapes and the optimizer's groups and state shapes
before anything changes.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp.checkpoint import CheckpointReadError, CheckpointWriteError
from megatron_fsdp.state_dict import StateDictMismatchError

from .checkpointing import checkpoint_dir, checkpoint_module, publish_checkpoint, read_tracker

logger = logging.getLogger(__name__)

MODEL_FILE = os.path.join("mp_rank_00", "model_optim_rng.pt")
"""Megatron-LM's ``get_checkpoint_name`` for tensor rank 0 without pipeline parallelism."""
CHECKSUM_FILE = "checksums.json"
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's current ``checkpoint_version`` (its loader fixes up older QKV layouts)."""
LAUNCHER_KEY = "megatron_fsdp"
"""This launcher's own progress entry: what a resumed run needs to match an
uninterrupted one exactly, which Megatron-LM's keys spread over ``args``."""


class CheckpointFormat(enum.Enum):
    """Megatron-LM's ``--ckpt-format`` values."""

    TORCH = "torch"
    """Legacy: one ``torch.save`` file from data-parallel rank 0 (this module)."""
    TORCH_DIST = "torch_dist"
    """Megatron-LM's distributed format; DCP shards here (``checkpointing.py``)."""
    TORCH_DCP = "torch_dcp"
    """torch.distributed.checkpoint directories."""
    FSDP_DTENSOR = "fsdp_dtensor"
    """DCP directories of Megatron-FSDP's DTensors."""


def option_problems(args: argparse.Namespace) -> list[str]:
    """The flag combinations ``--ckpt-format torch`` cannot run, each with its fix
    (validation.py calls this before any process group starts)."""
    if CheckpointFormat(args.ckpt_format) is not CheckpointFormat.TORCH:
        return []
    problems = []
    if args.use_megatron_fsdp:  # Megatron-LM: "Megatron-FSDP requires the fsdp_dtensor checkpointing format"
        problems.append("--ckpt-format torch cannot be used with --use-megatron-fsdp (Megatron-LM's rule: "
                        "Megatron-FSDP requires --ckpt-format fsdp_dtensor, since its weights are sharded and the "
                        "torch format is one whole-tensor file); use --ckpt-format fsdp_dtensor")
    else:
        sharded = [flag for flag, given in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                            ("--bf16", args.bf16), ("--fp16", args.fp16),
                                            ("--ddp-average-in-collective", args.ddp_average_in_collective))
                   if given]
        if sharded:  # these runs train on Megatron-FSDP's engine (DataParallelPath.MEGATRON_DDP)
            problems.append(f"--ckpt-format torch is implemented here only for PyTorch DDP runs (fp32, no "
                            f"distributed optimizer); with {' '.join(sharded)} the model and optimizer state are "
                            "DTensors of Megatron-FSDP's engine, which this one-file format does not hold here; "
                            "use --ckpt-format torch_dist (the same resume, saved as DCP shards)")
    if args.async_save:  # Megatron-LM: "Async checkpoint save not implemented for legacy checkpoints"
        problems.append("--async-save with --ckpt-format torch: Megatron-LM has no asynchronous save for its legacy "
                        "torch format (it fails at the first save); drop --async-save or use --ckpt-format "
                        "torch_dist")
    return problems


def model_file(root: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir(root, iteration), MODEL_FILE)


def holds_checkpoint(root: str, step: Optional[int] = None) -> bool:
    """Whether the checkpoint ``--load root`` (``--ckpt-step step``) names is in the torch
    format; Megatron-LM's loader tells the formats apart by the ``mp_rank_*`` entries."""
    iteration = read_tracker(root) if step is None else step
    if iteration is None:
        return False
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        return False
    ranks = sorted(name for name in os.listdir(directory) if name.startswith("mp_rank_"))
    if not ranks:
        return False
    if ranks != ["mp_rank_00"] or os.path.exists(os.path.join(directory, "mp_rank_00", "distrib_optim.pt")):
        # Tensor/pipeline-parallel files, or a distributed optimizer's: not this launcher's layout.
        raise CheckpointReadError(
            f"{directory} holds Megatron-LM torch-format files {ranks} of a model-parallel or distributed-optimizer "
            "run; only a single mp_rank_00/model_optim_rng.pt (tensor and pipeline size 1, no distributed "
            "optimizer) can be read here. Convert it to one rank first or start from it with a matching layout"
        )
    return True


# -- save ---------------------------------------------------------------------------------
def save(root: str, iteration: int, model, optimizer, extra_state: dict, args: argparse.Namespace, *,
         retain_interval: Optional[int] = None) -> str:
    """Collective: every rank contributes its RNG state, data-parallel rank 0 writes
    the file, then the tracker moves (``publish_checkpoint``). ``extra_state`` is the
    launcher's (``checkpoint_extra_state`` in scripts/pretrain_gpt.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model_state = checkpoint_module(model).state_dict()
    optimizer_state = optimizer.state_dict()
    _require_whole_tensors(model_state, "the model")
    _require_whole_tensors(optimizer_state, "the optimizer")
    rng_states: list = [None] * world
    dist.all_gather_object(rng_states, _megatron_rng(extra_state["rng"]))
    directory = checkpoint_dir(root, iteration)
    failure = [None]
    if rank == 0:
        train_state = extra_state["train_state"]
        state = {
            "args": _saved_args(args, train_state),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "model": model_state,
            "optimizer": optimizer_state,
            "opt_param_scheduler": extra_state["lr_schedule"],
            "rng_state": rng_states,
            "num_floating_point_operations_so_far": train_state["floating_point_operations_so_far"],
            LAUNCHER_KEY: {"train_state": train_state, "loss_scaler": extra_state.get("loss_scaler")},
        }
        try:
            _write(directory, state)
        except Exception as exc:  # every rank must learn of it, or the others wait at the next collective
            failure = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointWriteError(
            f"rank 0 could not write the torch-format checkpoint {os.path.join(directory, MODEL_FILE)} "
            f"({failure[0]}); nothing was published and the tracker still names the previous checkpoint")
    if rank == 0:
        publish_checkpoint(root, iteration, retain_interval)
    dist.barrier()
    logger.info("  successfully saved checkpoint from iteration %7d to %s (torch format)", iteration, root)
    return directory


def _require_whole_tensors(state: Any, owner: str, key: str = "") -> None:
    """An internal guard behind ``option_problems``: a DTensor here would be one rank's shard."""
    if isinstance(state, DTensor):
        raise TypeError(f"--ckpt-format torch: {owner}'s state {key!r} is a DTensor shard, but this format saves "
                        "whole tensors from rank 0 only; use --ckpt-format torch_dist")
    if isinstance(state, dict):
        for name, value in state.items():
            _require_whole_tensors(value, owner, f"{key}.{name}" if key else str(name))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            _require_whole_tensors(value, owner, f"{key}[{index}]")


def _plain(value: Any) -> bool:
    # Exact types: an IntEnum or str-valued enum is an int/str subclass that weights_only refuses.
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (list, tuple) and all(_plain(v) for v in value)


def _saved_args(args: argparse.Namespace, train_state: dict) -> argparse.Namespace:
    """Megatron-LM saves its ``args``; here the plain-valued ones (the derived objects and
    enums are rebuilt from the flags), so the file loads with ``weights_only``. Megatron-LM
    resumes its sample counters from these three attributes."""
    saved = argparse.Namespace(**{k: v for k, v in vars(args).items() if _plain(v)})
    saved.consumed_train_samples = train_state["consumed_train_samples"]
    saved.skipped_train_samples = train_state.get("skipped_train_samples", 0)
    saved.consumed_valid_samples = train_state.get("consumed_valid_samples", 0)
    return saved


def _megatron_rng(rng: dict) -> dict:
    """The launcher's RNG state (``checkpointing.rng_state``) under Megatron-LM's names."""
    return {"random_rng_state": rng["python"], "np_rng_state": np.random.get_state(),
            "torch_rng_state": rng["torch"], "cuda_rng_state": rng.get("device"), "rng_tracker_states": {}}


def _write(directory: str, state: dict) -> None:
    """Stage ``directory + '.tmp'``, then swap it in: a crash leaves no half-written
    ``iter_*`` behind (a previous save of the same iteration is replaced whole)."""
    staging = directory + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of a crashed save
    path = os.path.join(staging, MODEL_FILE)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    digests = {os.path.basename(path): _sha256(path)}
    with open(os.path.join(os.path.dirname(path), CHECKSUM_FILE), "w") as f:
        json.dump(digests, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- load ---------------------------------------------------------------------------------
def load(root: str, model, optimizer, *, step: Optional[int] = None, finetune: bool = False) -> dict:
    """Load the torch-format checkpoint ``holds_checkpoint`` found into ``model`` and
    ``optimizer`` (None: keep the optimizer as it is) and return the launcher's extra
    state for this rank (``train_state``, ``lr_schedule``, ``loss_scaler``, ``rng``).
    ``finetune``: the caller reads only the weights, so a file without this launcher's
    progress (one Megatron-LM wrote) is fine. Every check runs before anything changes."""
    iteration = read_tracker(root) if step is None else step
    path = model_file(root, iteration)
    _verify_checksum(path)
    saved = _read(path)
    launcher = saved.get(LAUNCHER_KEY)
    if launcher is None and not finetune:
        raise CheckpointReadError(
            f"{path} has no '{LAUNCHER_KEY}' progress entry: it was not written by this launcher (Megatron-LM's "
            "optimizer and schedule states differ from this one's), so only its weights can be read; add "
            "--finetune (weights only, iteration 0)")
    module = checkpoint_module(model)
    live = module.state_dict()
    if any(isinstance(value, DTensor) for value in live.values()):
        raise CheckpointReadError(
            f"{path} is a torch-format (whole-tensor) checkpoint, but this run's model is sharded on Megatron-FSDP's "
            "engine (--use-megatron-fsdp, --use-distributed-optimizer, --bf16 or --fp16), which reads only DCP "
            "checkpoints here; load it in a PyTorch DDP run (fp32) and save it again with --ckpt-format torch_dist")
    _check_model(saved.get("model"), live, path)
    if optimizer is not None:
        _check_optimizer(saved.get("optimizer"), optimizer, path)
    module.load_state_dict(saved["model"])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    logger.info("  successfully loaded checkpoint from %s [ iteration %d ] (torch format)", root, iteration)
    if launcher is None:
        return {}
    return {"train_state": launcher["train_state"], "lr_schedule": saved["opt_param_scheduler"],
            "loss_scaler": launcher.get("loss_scaler"), "rng": _own_rng(saved.get("rng_state"), path)}


def _verify_checksum(path: str) -> None:
    """Rank 0 hashes the file against ``checksums.json`` (when the writer recorded one)
    and every rank raises on a mismatch, before any rank reads it."""
    verdict = [None]
    if dist.get_rank() == 0:
        table_path = os.path.join(os.path.dirname(path), CHECKSUM_FILE)
        if os.path.isfile(table_path):
            try:
                with open(table_path) as f:
                    expected = json.load(f).get(os.path.basename(path))
                if expected is not None and os.path.isfile(path) and _sha256(path) != expected:
                    verdict = ["does not match its checksum (altered or truncated)"]
            except (OSError, ValueError) as exc:
                verdict = [f"has an unreadable {CHECKSUM_FILE} ({exc})"]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointReadError(f"the checkpoint file {path} {verdict[0]}; nothing was loaded. Load an "
                                  "earlier checkpoint (--ckpt-step)")


def _safe_globals() -> list:
    """What a torch-format file holds besides tensors and builtins: the args namespace and
    numpy's RNG state (Megatron-LM allows the same list in megatron/core/safe_globals.py)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [argparse.Namespace, np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no torch-format checkpoint file {path}; point --load (or --ckpt-step) at a "
                                "saved iteration")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            # On the host: a file saved from GPU tensors must not land on the saving device.
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointReadError(f"could not read {path} ({type(exc).__name__}: {exc}); nothing was loaded. Load "
                                  "an earlier checkpoint (--ckpt-step)") from exc
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointReadError(f"{path} is not a Megatron-LM torch-format checkpoint (no 'model' entry)")
    return saved


def _check_model(saved: Any, live: dict, path: str) -> None:
    if not isinstance(saved, dict):
        raise CheckpointReadError(f"{path}: its 'model' entry is {type(saved).__name__}, not a state dict")
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    mismatched = [f"{k}: checkpoint {tuple(getattr(saved[k], 'shape', ()))} vs model {tuple(v.shape)}"
                  for k, v in live.items()
                  if k in saved and isinstance(v, torch.Tensor) and tuple(getattr(saved[k], "shape", ())) != v.shape]
    if missing or unexpected or mismatched:
        raise StateDictMismatchError(
            f"{path} does not fit this model (nothing was loaded): missing keys {missing}, unexpected keys "
            f"{unexpected}, shape mismatches {mismatched}. Build the same architecture as the run that saved it")


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """What ``Optimizer.load_state_dict`` would refuse (group and parameter counts) and
    what it would not notice (state tensors shaped for other parameters), checked first."""
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise CheckpointReadError(f"{path} holds no torch.optim optimizer state; add --no-load-optim to start the "
                                  "optimizer fresh")
    groups = optimizer.param_groups
    counts = [len(g["params"]) for g in saved["param_groups"]]
    if counts != [len(g["params"]) for g in groups]:
        raise StateDictMismatchError(
            f"{path}: the optimizer's parameter groups hold {counts} parameters, this run's "
            f"{[len(g['params']) for g in groups]} (nothing was loaded); build the same model and optimizer, or add "
            "--no-load-optim")
    params = {pid: p for saved_group, group in zip(saved["param_groups"], groups)
              for pid, p in zip(saved_group["params"], group["params"])}
    for pid, entry in saved["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                raise StateDictMismatchError(
                    f"{path}: optimizer state {name!r} of parameter {pid} is {tuple(value.shape)}, the parameter "
                    f"{tuple(params[pid].shape)} (nothing was loaded); add --no-load-optim")


def _own_rng(entries: Any, path: str) -> dict:
    """This rank's generators from ``rng_state``: its own entry when the file has one per
    data-parallel rank (as written here), else entry 0 (Megatron-LM's file without
    --data-parallel-random-init), in the launcher's names (``checkpointing.set_rng_state``)."""
    if not entries:
        raise CheckpointReadError(f"{path} holds no rng_state; add --no-load-rng to keep this run's generators")
    rank = dist.get_rank()
    entry = entries[rank] if len(entries) == dist.get_world_size() else entries[0]
    return {"python": entry["random_rng_state"], "torch": entry["torch_rng_state"],
            "device": entry.get("cuda_rng_state"), "numpy": entry.get("np_rng_state")}
