"""``--ckpt-format torch_dist``: megatron-core's own distributed checkpoint, written and read
through megatron-core's ``dist_checkpointing`` (``megatron_fsdp.interop.torch_dist``), so that
Megatron-LM loads what the launcher saves and the launcher resumes what Megatron-LM saves.

In ``iter_XXXXXXX/``: the model under GPTModel's keys, Adam's moments and the fp32 main weights
in the distributed optimizer's ``fully_reshardable`` layout, and ``common.pt`` with what
Megatron-LM keeps there (``args``, ``iteration``, ``checkpoint_version``,
``opt_param_scheduler``, ``num_floating_point_operations_so_far``) plus the launcher's progress
(``LAUNCHER_KEY``). Each rank also leaves its own extra state (its RNG streams) in
``extra_state_rank{r}.pt`` beside the tensors, as the ``fsdp_dtensor`` layout does, so that a
resume draws what the uninterrupted run draws; megatron-core ignores the file.

[Note: torch_dist's reach] The map from this launcher's model to GPTModel's keys covers the
embedded GPT with Adam on the Megatron-FSDP, Megatron-core DDP and PyTorch DDP paths, without
tensor or expert parallelism, MLA or MTP (``fallback_reason``). Everything else keeps the
``fsdp_dtensor`` layout under ``--ckpt-format torch_dist`` and says so once: megatron-core
models (whose own keys that layout already holds), SGD and Muon (no Adam moments), FSDP2 and
version 2, tensor- and expert-parallel runs, and asynchronous saves.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_fsdp.interop.torch_dist import load_torch_dist, save_torch_dist
from megatron_fsdp.interop.torch_dist_io import is_torch_dist_checkpoint, tensor_shapes
from megatron_fsdp.state import EXTRA_STATE_FILE

from ..args.arg_types import DataParallelPath
from .dcp_checkpoint import checkpoint_dir, publish_checkpoint, read_tracker
from .torch_checkpoint import CHECKPOINT_VERSION, LAUNCHER_KEY, plain_args

__all__ = ["fallback_reason", "holds_checkpoint", "holds_optimizer_state", "load", "save"]

logger = logging.getLogger(__name__)
_PATHS = (DataParallelPath.MEGATRON_FSDP, DataParallelPath.MEGATRON_DDP, DataParallelPath.TORCH_DDP)


def fallback_reason(args) -> Optional[str]:
    """Why this run keeps the fsdp_dtensor layout under --ckpt-format torch_dist, or None
    ([Note: torch_dist's reach])."""
    reasons = [
        (args.use_mcore_models, "megatron-core models"),
        (args.optimizer != "adam", f"--optimizer {args.optimizer} (the format holds Adam's moments)"),
        (args.dp_path not in _PATHS, f"the {args.dp_path.value} path"),
        (args.tensor_model_parallel_size > 1, "tensor parallelism"),
        (args.expert_model_parallel_size > 1, "expert parallelism"),
        (bool(args.multi_latent_attention), "multi-latent attention"),
        (bool(args.mtp_num_layers), "multi-token prediction"),
        (args.async_save, "--async-save"),
    ]
    found = [why for hit, why in reasons if hit]
    return ", ".join(found) if found else None


def holds_checkpoint(root: Optional[str], step: Optional[int] = None) -> bool:
    """Whether ``root``'s tracked (or ``step``'s) iteration is a megatron-core torch_dist checkpoint."""
    iteration = read_tracker(root) if root and step is None else step
    return iteration is not None and is_torch_dist_checkpoint(checkpoint_dir(root, iteration))


def holds_optimizer_state(root: str, step: Optional[int] = None) -> bool:
    """Whether that checkpoint holds optimizer state (a converted one holds weights only)."""
    iteration = read_tracker(root) if step is None else step
    return any(key.startswith("optimizer.") for key in tensor_shapes(checkpoint_dir(root, iteration)))


def _common(args, iteration: int, extra_state: dict) -> dict[str, Any]:
    train_state = extra_state["train_state"]
    saved_args = argparse.Namespace(**plain_args(args))
    saved_args.consumed_train_samples = train_state["consumed_train_samples"]
    return {"args": saved_args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
            "opt_param_scheduler": extra_state["lr_schedule"],
            "num_floating_point_operations_so_far": train_state.get("floating_point_operations_so_far", 0),
            LAUNCHER_KEY: {"train_state": train_state, "loss_scaler": extra_state.get("loss_scaler")}}


def save(root: str, iteration: int, model, optimizer, extra_state: dict, args, config,
         retain_interval: Optional[int] = None) -> str:
    """Collective: every rank writes its blocks and its extra state, then rank 0 moves the
    tracker (``publish_checkpoint``)."""
    directory = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
    save_torch_dist(model, directory, config=config, optimizer=optimizer,
                    common_state=_common(args, iteration, extra_state))
    torch.save(extra_state, os.path.join(directory, EXTRA_STATE_FILE.format(rank=dist.get_rank())))
    dist.barrier()  # every rank's files are in place before the tracker names this iteration
    if dist.get_rank() == 0:
        publish_checkpoint(root, iteration, retain_interval)
    dist.barrier()
    logger.info("  successfully saved checkpoint from iteration %7d to %s (torch_dist format)", iteration, root)
    return directory


def _extra_state(directory: str, common: dict[str, Any]) -> dict:
    """This rank's extra state (rank 0's when the world size changed); from ``common.pt``
    alone for a checkpoint Megatron-LM wrote (no progress of this launcher: {})."""
    for rank in (dist.get_rank(), 0):
        path = os.path.join(directory, EXTRA_STATE_FILE.format(rank=rank))
        if os.path.isfile(path):
            return torch.load(path, weights_only=True)
    progress = common.get(LAUNCHER_KEY)
    if not progress:
        return {}
    return {"train_state": progress["train_state"], "lr_schedule": common.get("opt_param_scheduler"),
            "loss_scaler": progress.get("loss_scaler")}


def load(root: str, model, optimizer, config, step: Optional[int] = None) -> dict:
    """Read the tracked (or ``step``'s) torch_dist checkpoint into ``model`` and ``optimizer``
    (None: weights only) and return the launcher's extra state ({} for a checkpoint another
    program wrote: read it with --finetune or --no-load-optim). Collective."""
    iteration = read_tracker(root) if step is None else step
    directory = checkpoint_dir(root, iteration)
    common = load_torch_dist(model, directory, config=config, optimizer=optimizer)
    logger.info("  successfully loaded checkpoint from %s [ iteration %d ] (torch_dist format)", root, iteration)
    return _extra_state(directory, common)
