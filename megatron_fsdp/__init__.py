"""megatron_fsdp: fully sharded data parallelism in the Megatron style, on CPU and CUDA.

The package's floors, top to bottom (each imports only the floors below it; the
architecture test in ``tests/test_architecture.py`` holds them to it):

- this folder: the public face (``fully_shard``, ``megatron_fsdp`` with ``MegatronFSDP``,
  ``optimizer``, ``mcore_fsdp_adapter`` with ``FullyShardedDataParallel``) and every module
  path upstream users and Megatron-LM import (``utils``, ``uneven_dtensor``,
  ``param_and_grad_buffer``, ``distributed_data_parallel_config``, ``package_info``,
  ``mixed_precision``), ``parallel_dims`` (the data, tensor, context and expert ranks in
  Megatron-LM's order and their meshes), plus the vocabulary every floor uses (``config``, ``enums``,
  ``param_marks``, ``mixed_precision``);
- ``state/``: model and optimizer state dicts, full export, checkpoints;
- ``runtime/``: hooks, the unit schedule, the all-gather and gradient-reduce pipelines;
- ``buffers/`` and ``compat/``: parameter groups, flat buffers, layout math, the DTensor
  types; TransformerEngine and megatron-core recognition;
- ``comm/``: collectives, transports, streams, the device, the process groups.

Beside them: ``experimental/`` (the per-module API), ``models/`` (the embedded GPT),
``tools/`` (the scale planner) and ``training/`` (the launcher behind
``scripts/pretrain_gpt.py``, which ``import megatron_fsdp`` never loads).

[Note: lazy package root] The names below load their module on first use (PEP 562), so
importing a leaf module (the data preprocessor's workers read ``training/data/indexed.py``
alone) does not bring in the engine and torch with it.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from .package_info import UPSTREAM_DISTRIBUTION, __version__  # noqa: F401


def _upstream_init_files() -> list[Path]:
    """Where NVIDIA's ``megatron-fsdp`` distribution, if installed, put ``megatron_fsdp/__init__.py``."""
    try:
        upstream = metadata.distribution(UPSTREAM_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return []
    return [Path(upstream.locate_file(f)).resolve() for f in upstream.files or ()
            if f.parts == ("megatron_fsdp", "__init__.py")]


def _check_one_distribution() -> None:
    """[Note: one distribution per import name] This project (distribution ``mfsdp``) and
    NVIDIA's ``megatron-fsdp`` both install the import package ``megatron_fsdp``. Installed into
    one folder, the later install overwrites the earlier one's files and leaves the rest: a
    mixture that fails in odd places, or silently runs the other project's code. When this
    ``__init__`` runs and upstream's files claim the same folder, the import stops with the
    remedy; when upstream sits in another folder that this one shadows, a warning says which
    one runs."""
    here = Path(__file__).resolve().parent
    for init in _upstream_init_files():
        if init.parent == here:
            raise ImportError(
                f"{here} holds files of both mfsdp and NVIDIA's {UPSTREAM_DISTRIBUTION} (both install the "
                f"import package megatron_fsdp, so the folder is a mixture of the two); run "
                f"`pip uninstall -y {UPSTREAM_DISTRIBUTION} mfsdp` and install the one you want")
        warnings.warn(f"NVIDIA's {UPSTREAM_DISTRIBUTION} is also installed ({init.parent}); `import megatron_fsdp` "
                      f"runs this project's package from {here}, which comes first on sys.path. "
                      f"`pip uninstall {UPSTREAM_DISTRIBUTION}` removes the other one", stacklevel=3)


_check_one_distribution()

_EXPORTS = {
    "BucketStatus": "enums",
    "CollectiveRecorder": "comm.collectives",
    "DistributedDataParallelConfig": "config",
    "FSDPDistributedIndex": "comm.distributed_index",
    "FullyShardedDataParallel": "mcore_fsdp_adapter",
    "MegatronFSDP": "megatron_fsdp",
    "MixedPrecisionPolicy": "mixed_precision",
    "ParallelDims": "parallel_dims",
    "ShardingStrategy": "enums",
    "StateDictMismatchError": "state.model_state_dict",
    "TrainingState": "enums",
    "fsdp_no_shard": "param_marks",
    "fully_shard": "fully_shard",
    "fully_shard_model": "fully_shard",
    "fully_shard_optimizer": "fully_shard",
    "get_full_state_dict": "state.model_state_dict",
    "load_checkpoint": "state.checkpoint",
    "load_full_state_dict": "state.model_state_dict",
    "record_collectives": "comm.collectives",
    "save_checkpoint": "state.checkpoint",
    "save_full_state_dict": "state.model_state_dict",
}
"""Public name -> the module (under this package) that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        try:  # a submodule: megatron_fsdp.utils, megatron_fsdp.uneven_dtensor, ...
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _PackageRoot(types.ModuleType):
    """[Note: fully_shard, the module and the function] Upstream names a module and its
    main function alike: ``megatron_fsdp.fully_shard`` is the function, ``import
    megatron_fsdp.fully_shard`` loads the module. Importing a submodule makes the import
    system set it as an attribute of its package, which would hide the function once the
    module loads (an eager ``__init__`` rebinds the name afterwards; a lazy one cannot).
    This attribute keeps naming the function; the module stays in ``sys.modules``."""

    @property
    def fully_shard(self) -> Any:
        return importlib.import_module(".fully_shard", __name__).fully_shard

    @fully_shard.setter
    def fully_shard(self, module: types.ModuleType) -> None:
        """The import system recording the submodule: ``sys.modules`` holds it already."""


sys.modules[__name__].__class__ = _PackageRoot
