"""Public helpers under upstream's module name ``megatron_fsdp.utils``.

Megatron-LM imports a few of these from upstream (``find_megatron_fsdp``,
``is_mcore_tensor_model_parallel``, ``get_mcore_tensor_parallel_partition_dim``);
the others are upstream's small public utilities. ``FSDPDistributedIndex`` lives
in ``distributed_index.py`` and is re-exported here, where upstream defines it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .distributed_index import FSDPDistributedIndex, has_submesh

__all__ = [
    "FSDPDistributedIndex",
    "contains_submesh",
    "find_megatron_fsdp",
    "get_mcore_tensor_parallel_partition_dim",
    "get_mesh_names",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "is_submodule",
    "is_torch_min_version",
    "log_single_rank",
    "safe_get_rank",
    "using_tensor_parallel",
]


def find_megatron_fsdp(model: Optional[nn.Module]):
    """The ``MegatronFSDP`` reached by following ``.module`` from ``model`` (wrapper
    chains such as Megatron's ``Float16Module`` or our ``FullyShardedDataParallel``), or ``None``."""
    from .megatron_fsdp import MegatronFSDP  # the wrapper imports this package's modules

    while model is not None:
        if isinstance(model, MegatronFSDP):
            return model
        model = getattr(model, "module", None)
    return None


def is_submodule(module: nn.Module, parent_module: nn.Module, strict: bool = True) -> bool:
    """Whether ``module`` is inside ``parent_module`` (``strict``: and not the parent itself)."""
    if strict and module is parent_module:
        return False
    return any(m is module for m in parent_module.modules())


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> Optional[int]:
    """The dimension a Megatron-core (or TransformerEngine) tensor-parallel
    parameter is split along; ``None`` when it is not split (duplicated)."""
    mode = getattr(param, "_tensor_parallel_mode", None)
    if mode in ("column", "row"):
        return 0 if mode == "column" else 1
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim", None)
        if dim is not None and dim >= 0:
            return int(dim)
    return None


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    return get_mcore_tensor_parallel_partition_dim(param) is not None


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    return get_mcore_tensor_parallel_partition_dim(param) is None


def get_mesh_names(device_mesh: Optional[DeviceMesh] = None, only_submesh_dims: bool = False) -> list[str]:
    """The mesh's dimension names, then (unless ``only_submesh_dims``) the names of
    dimensions flattened from it."""
    if device_mesh is None:
        return []
    names = list(device_mesh.mesh_dim_names or ())
    if only_submesh_dims:
        return names
    root = device_mesh._get_root_mesh() if hasattr(device_mesh, "_get_root_mesh") else device_mesh
    flattened = getattr(root, "_flatten_mapping", {}) or {}
    return names + [n for n in flattened if n not in names]


def contains_submesh(device_mesh: Optional[DeviceMesh], submesh_names: Optional[str | Sequence[str]]) -> bool:
    """Whether every name is a dimension of the mesh or flattened from it."""
    if device_mesh is None or submesh_names is None:
        return False
    names = (submesh_names,) if isinstance(submesh_names, str) else tuple(submesh_names)
    return all(has_submesh(device_mesh, n) for n in names)


def using_tensor_parallel(dist_index: FSDPDistributedIndex, is_expert_parallel: bool = False) -> bool:
    """Whether the index's tensor-parallel dimension has more than one rank."""
    if dist_index.tp_dim is None:
        return False
    return dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_parallel).size() > 1


def safe_get_rank() -> int:
    """This process's rank: from torch.distributed when initialised, else ``$RANK`` (0 if unset)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0


def log_single_rank(logger_: logging.Logger, level: int, msg: str, *args, rank: int = 0, **kwargs) -> None:
    """Log only on ``rank``."""
    if safe_get_rank() == rank:
        logger_.log(level, msg, *args, **kwargs)


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the installed torch is at least ``version`` (strictly newer without ``check_equality``)."""
    from packaging.version import Version

    installed = Version(Version(torch.__version__).base_version)
    wanted = Version(version)
    return installed >= wanted if check_equality else installed > wanted
