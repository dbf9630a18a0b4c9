"""megatron-core's ``dist_checkpointing`` calls, the directory checks around them, and the
strategy that lets them run on a CPU-only torch.

[Note: saving torch_dist without CUDA] megatron-core 0.16.1's default ``torch_dist`` save
strategy stages tensors through ``FileSystemWriterAsync``, which ends with
``torch.cuda.synchronize()`` and broadcasts its failure flag from
``torch.cuda.current_device()``: on a torch without CUDA every save stops there. The tensors
it writes are DCP chunks that megatron-core itself translates (``mcore_to_pyt_state_dict``)
and plans (``MCoreSavePlanner``). ``HostTorchDistSaveStrategy`` is megatron-core's own
strategy class with only the write step replaced: the same translation and planner, then
torch's synchronous ``FileSystemWriter``; the files are the same format (``__<rank>_<i>.distcp``
and ``.metadata``). It is handed to ``dist_checkpointing.save`` through its
``sharded_strategy`` argument (megatron-core's extension point) only where CUDA is absent;
with CUDA the default strategy runs unchanged. Loading needs no such help.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..comm import device


def require_megatron_core() -> None:
    try:
        importlib.import_module("megatron.core.dist_checkpointing")
    except ImportError as exc:
        raise ImportError("the torch_dist format is megatron-core's; install megatron-core "
                          "(pip install --no-deps megatron-core) to read or write it") from exc


def require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("megatron-core's dist_checkpointing needs torch.distributed initialised (its save and "
                           "load exchange metadata over the default group); call "
                           "torch.distributed.init_process_group first (one process: world_size=1)")


def is_torch_dist_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a megatron-core distributed checkpoint in the ``torch_dist`` format
    (its ``metadata.json`` names that backend)."""
    meta = Path(path) / "metadata.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


def check_readable(path: str | os.PathLike) -> None:
    if not is_torch_dist_checkpoint(path):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a torch_dist checkpoint (no metadata.json naming "
                                "sharded_backend 'torch_dist'); pass Megatron-LM's iter_XXXXXXX directory")


def prepare_empty_dir(path: str | os.PathLike) -> None:
    """Create ``path`` (rank 0) and refuse one that already holds files."""
    path = Path(path)
    problem = ""
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        if next(path.iterdir(), None) is not None:
            problem = f"{os.fspath(path)!r} is not empty; save each checkpoint to a new directory (iter_XXXXXXX)"
    flag = [problem]
    dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        raise FileExistsError(flag[0])


def host_save_strategy():
    """megatron-core's torch_dist save strategy writing synchronously from host memory
    ([Note: saving torch_dist without CUDA]); what ``save_torch_dist`` uses without CUDA."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter, save

    class HostTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """megatron-core's torch_dist save with a synchronous host write
        ([Note: saving torch_dist without CUDA])."""

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            torch_state = mcore_to_pyt_state_dict(state, False)
            planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                       flatten_state_dict=False)
            save(torch_state, storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1), planner=planner)

    return HostTorchDistSaveStrategy("torch_dist", 1)


def save_sharded(state: dict[str, Any], path: str | os.PathLike, content_metadata: dict) -> None:
    """``dist_checkpointing.save`` of ``state`` (ShardedTensors and common values)."""
    from megatron.core import dist_checkpointing

    strategy = None if device.cuda_available() else host_save_strategy()
    dist_checkpointing.save(state, os.fspath(path), sharded_strategy=strategy, content_metadata=content_metadata)


def _allow_common_classes() -> None:
    """[Note: common.pt's classes] megatron-core reads ``common.pt`` with torch's
    ``weights_only`` unpickler and allowlists what it holds (the args ``Namespace``, numpy
    arrays, its enums) when ``megatron.core`` is first imported. An import that happened inside
    a ``torch.serialization.safe_globals`` block loses that list when the block exits, and the
    read then fails on ``argparse.Namespace``; so every read here allowlists them again, as
    importing megatron-core does."""
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()


def load_sharded(state: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    _allow_common_classes()
    return dist_checkpointing.load(state, os.fspath(path))


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's key and global shape (megatron-core's reading of the metadata)."""
    from megatron.core import dist_checkpointing

    return {key: tuple(meta.global_shape) for key, meta in dist_checkpointing.load_tensors_metadata(
        os.fspath(path)).items()}


def common_state(path: str | os.PathLike) -> dict[str, Any]:
    """``common.pt``: what rank 0 saved besides the tensors (args, iteration, ...)."""
    from megatron.core import dist_checkpointing

    _allow_common_classes()
    return dist_checkpointing.load_common_state_dict(os.fspath(path))
