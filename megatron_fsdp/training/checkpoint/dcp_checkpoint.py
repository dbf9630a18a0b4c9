"""Megatron-LM's checkpoint layout on top of the engine's DCP checkpoints (``megatron_fsdp.state``):
``<save>/iter_0000010/`` per saved iteration plus the tracker file
``latest_checkpointed_iteration.txt`` naming the newest complete one.

[Note: checkpoint atomicity] ``save_checkpoint`` writes a temporary directory and
renames it once every rank is done, so an ``iter_*`` directory is always complete.
The tracker is written by rank 0 only after a barrier (every rank has returned
from the save), to a temporary file that ``os.replace`` swaps in atomically: a
crash at any point leaves the previous tracker naming a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_fsdp.comm import device as device_mod
from megatron_fsdp import state as engine_state

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration the tracker names, or None when there is no tracker."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, not an iteration number; fix or delete the file") from None


def publish_checkpoint(root: str, iteration: int, retain_interval: Optional[int]) -> None:
    """Rank 0, once ``iteration``'s checkpoint is complete: name it in the tracker. With
    ``--save-retain-interval`` the checkpoint the tracker named before is deleted unless
    its iteration is a multiple of the interval (Megatron-LM's rule: the newest and every
    retained one stay; a symbolic link is left alone)."""
    previous = read_tracker(root) if retain_interval is not None else None
    _write_tracker(root, iteration)
    if previous is None or previous <= 0 or previous == iteration or previous % retain_interval == 0:
        return
    stale = checkpoint_dir(root, previous)
    if os.path.islink(stale):
        logger.info("  keeping the checkpoint of iteration %7d at %s: it is a symbolic link", previous, root)
        return
    shutil.rmtree(stale, ignore_errors=True)
    logger.info("  deleted the checkpoint of iteration %7d (--save-retain-interval %d)", previous, retain_interval)


def _write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER_FILENAME)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state(device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Python, torch CPU and (where CUDA is used) CUDA generator states of this rank;
    with megatron-core's GPTModel also its RNG tracker's streams (``tracker``, Megatron-LM's
    ``rng_tracker_states``), which its attention dropout draws from."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "device": device_mod.rng_state(device)}
    tracker = _mcore_rng_tracker()
    if tracker is not None:
        state["tracker"] = {name: value.clone() if isinstance(value, torch.Tensor) else value
                            for name, value in tracker.get_states().items()}
    return state


def set_rng_state(state: dict[str, Any], device: torch.device = torch.device("cpu")) -> None:
    random.setstate(state["python"])
    if state.get("numpy") is not None:  # torch-format checkpoints carry Megatron-LM's numpy state too
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    device_mod.set_rng_state(state.get("device"), device)
    tracker = _mcore_rng_tracker()
    if tracker is not None and state.get("tracker"):
        tracker.set_states(dict(state["tracker"]))


def _mcore_rng_tracker():
    """megatron-core's model-parallel RNG tracker once seeded (megatron-core models only;
    its streams are checkpointed, or a resumed run's attention dropout would draw other
    masks than the uninterrupted run's)."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None:
        return None
    tracker = module.get_cuda_rng_tracker()
    initialized = getattr(tracker, "is_initialized", None)
    return tracker if initialized is None or initialized() else None


def checkpoint_module(model):
    """The module whose ``state_dict`` a checkpoint holds: PyTorch DDP's inner module, so
    the keys are the model's own (``decoder.layers.0.self_attention.linear_qkv.weight`` for
    megatron-core's GPTModel, ``blocks.0.attn.qkv.weight`` for the embedded GPT); the
    parameters are shared, so loading into it loads the wrapped model. Megatron-FSDP's
    wrapper keys them ``module.<name>`` (upstream's convention); the load maps one onto
    the other, so a run may switch between the two (checkpoint.py ``_wrapper_renames``)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def save(root: str, iteration: int, model, optimizer, extra_state: dict,
         retain_interval: Optional[int] = None) -> str:
    """Collective: every rank saves its part, then rank 0 moves the tracker (and retires
    the previous checkpoint under ``retain_interval``: ``publish_checkpoint``)."""
    directory = checkpoint_dir(root, iteration)
    model = checkpoint_module(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    engine_state.save_checkpoint(directory, model, optimizer, extra_state=extra_state)
    if dist.is_initialized():
        dist.barrier()  # every rank finished writing before the tracker names this iteration
    if rank == 0:
        publish_checkpoint(root, iteration, retain_interval)
    if dist.is_initialized():
        dist.barrier()
    logger.info("  successfully saved checkpoint from iteration %7d to %s", iteration, root)
    return directory


class AsyncSaver:
    """``--async-save``: shards are staged in memory and written by
    ``torch.distributed.checkpoint.async_save`` in the background while training
    goes on; the checkpoint is published (renamed from ``iter_X.tmp`` and named by
    the tracker) once every rank's write finished, at the next save or at the end
    (``finalize``). Its collectives run on a private gloo group so they never
    interleave with training's."""

    def __init__(self, retain_interval: Optional[int] = None) -> None:
        self._group = dist.new_group(backend="gloo")
        self._retain_interval = retain_interval
        self._pending: Optional[tuple[Any, Any, str, str, int]] = None

    def save(self, root: str, iteration: int, model, optimizer, extra_state: dict) -> None:
        self.finalize()
        # The same layout and per-rank extra-state files as the synchronous save.
        rank = dist.get_rank()
        final = checkpoint_dir(root, iteration)
        tmp = final + ".tmp"
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        torch.save(extra_state, os.path.join(tmp, engine_state.EXTRA_STATE_FILE.format(rank=rank)))
        module = checkpoint_module(model)
        state = engine_state.checkpoint_state(module, optimizer)
        stager = _OneHostCopy(_live_storages(module, optimizer))
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group, async_stager=stager)
        self._pending = (future, stager, root, tmp, iteration)
        logger.info("  started an asynchronous save of iteration %7d to %s", iteration, root)

    def finalize(self) -> None:
        if self._pending is None:
            return
        future, stager, root, tmp, iteration = self._pending
        self._pending = None
        future.result()
        stager.close()  # DCP leaves closing a stager it was given to the caller
        dist.barrier()
        if dist.get_rank() == 0:
            final = checkpoint_dir(root, iteration)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            publish_checkpoint(root, iteration, self._retain_interval)
        dist.barrier()
        logger.info("  successfully saved checkpoint from iteration %7d to %s (asynchronously)", iteration, root)


class _OneHostCopy:
    """[Note: one host copy] An asynchronous save must not see training change what it writes,
    so the state is staged in host memory before ``async_save`` returns. DCP's default stager
    copies every tensor, but many of ours are already private: the state dict's whole-row
    DTensors of sharded weights and optimizer states are built fresh for it. This stager
    (DCP's ``AsyncStager`` protocol) copies only the tensors that share storage with the live
    model or optimizer, and those on the GPU (pinned host memory there, as DCP's pinned
    stager), so every value exists once on the host while the save is written (before: a
    host copy of everything, then DCP's copy of that copy)."""


    def __init__(self, live: set[int]) -> None:
        self.live = live
        """Storage addresses of the model's parameters and buffers and the optimizer's state."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Read by DCP: nothing to wait for, staging is done when ``stage`` returns."""
        return False

    def stage(self, state_dict: dict) -> dict:
        from torch.utils._pytree import tree_map

        return tree_map(self._private, state_dict)

    def _private(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.device.type == "cpu" and local.untyped_storage().data_ptr() not in self.live:
            return value  # built for the state dict: nothing else writes it
        copy = torch.empty_like(local, device="cpu", pin_memory=local.device.type == "cuda")
        copy.copy_(local)
        if local is value:
            return copy
        return type(value).from_local(copy, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _live_storages(model, optimizer) -> set[int]:
    from torch.utils._pytree import tree_leaves

    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [t for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, torch.Tensor)]
    return {(t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr() for t in tensors}


def holds_optimizer_state(root: str, step: Optional[int] = None) -> bool:
    """Whether the checkpoint of iteration ``step`` (default: the tracker's) holds optimizer
    state: a weights-only one (``python -m megatron_fsdp.convert``'s) does not. False when
    ``root`` names no checkpoint."""
    iteration = read_tracker(root) if step is None else step
    directory = checkpoint_dir(root, iteration) if iteration is not None else None
    if directory is None or not os.path.isfile(os.path.join(directory, ".metadata")):
        return False
    keys = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer") for key in keys)


def load(root: str, model, optimizer, step: Optional[int] = None) -> Optional[dict]:
    """Load the checkpoint of iteration ``step`` (default: the tracker's) into
    ``model``/``optimizer`` (None: skip the optimizer) and return its extra state;
    None when ``root`` has no tracker and no step was asked for."""
    iteration = read_tracker(root) if step is None else step
    if iteration is None:
        # INFO with Megatron-LM's wording: every rank hits this, rank 0 says it once.
        logger.info("WARNING: could not find the metadata file %s; will not load any checkpoints and "
                    "will start from random", os.path.join(root, TRACKER_FILENAME))
        return None
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        source = f"--ckpt-step {step}" if step is not None else os.path.join(root, TRACKER_FILENAME)
        raise FileNotFoundError(
            f"{source} names iteration {iteration} but {directory} does not exist; point --load at a complete "
            "checkpoint directory (or --ckpt-step at a saved iteration)"
        )
    extra = engine_state.load_checkpoint(directory, checkpoint_module(model), optimizer)
    logger.info("  successfully loaded checkpoint from %s [ iteration %d ]", root, iteration)
    return extra
