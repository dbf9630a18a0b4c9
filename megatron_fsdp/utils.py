"""Public helpers under upstream's module name ``megatron_fsdp.utils``.

Megatron-LM imports a few of these from upstream (``find_megatron_fsdp``,
``is_mcore_tensor_model_parallel``, ``get_mcore_tensor_parallel_partition_dim``);
the others are upstream's small public utilities. ``FSDPDistributedIndex`` lives
in ``distributed_index.py`` and is re-exported here, where upstream defines it.
``make_fsdp_dtensor`` (upstream: ``param_and_grad_buffer.py``, which Megatron-LM's
checkpoint converters import it from) lives here with the tensor-parallel helpers it
uses, and is re-exported under upstream's module.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .comm.distributed_index import FSDPDistributedIndex, has_submesh
from .megatron_fsdp import MegatronFSDP
from .state.uneven_dtensor import update_uneven_dtensor_chunk_metadata, validate_uneven_dtensor

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
    "make_fsdp_dtensor",
    "safe_get_rank",
    "using_tensor_parallel",
]


def find_megatron_fsdp(model: Optional[nn.Module]):
    """The ``MegatronFSDP`` reached by following ``.module`` from ``model`` (wrapper
    chains such as Megatron's ``Float16Module`` or our ``FullyShardedDataParallel``), or ``None``."""
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


# -- make_fsdp_dtensor ----------------------------------------------------------------------
def _fsdp_tensor_spec(
    param: torch.Tensor, dist_index: FSDPDistributedIndex, is_sharded_param: bool, is_expert_param: bool
) -> tuple[DeviceMesh, list[Placement]]:
    """Upstream's mesh and placements for an FSDP tensor: ``[outer,] dp_shard [, tp]``
    dimensions; rows sharded on dp-shard (and on the outer one under HFSDP), a
    tensor-parallel DTensor's own placement kept on the tp dimension.

    Upstream also sets ``mesh._shard_order``; torch reads no such attribute, so
    nothing is patched onto the (shared, cached) mesh here."""
    hybrid = dist_index.use_hybrid_fsdp
    names: tuple = (dist_index.dp_outer_dim, dist_index.dp_shard_dim) if hybrid else (dist_index.dp_shard_dim,)
    if not is_sharded_param:
        placements: list[Placement] = [Replicate()] * len(names)
    elif hybrid:
        placements = [Shard(0) if dist_index.hsdp_outer_dp_shard else Replicate(), Shard(0)]
    else:
        placements = [Shard(0)]
    if isinstance(param, DTensor) and param._spec.num_shards > 1:  # tensor parallel as a DTensor
        if len(param.placements) != 1:
            raise ValueError(
                f"make_fsdp_dtensor: a tensor-parallel DTensor parameter must have one placement, got "
                f"{param.placements}; pass a DTensor over the tp mesh dimension only"
            )
        names = (*names, dist_index.tp_dim)
        placements = [*placements, param.placements[0]]
    return dist_index.get_submesh(names, is_expert_parallel=is_expert_param), placements


def _tensor_parallel_param(
    local_tensor: torch.Tensor,
    param: torch.Tensor,
    dist_index: FSDPDistributedIndex,
    is_expert_param: bool,
    run_check: bool,
    force_sync: bool,
) -> DTensor:
    """A Megatron-core tensor-parallel parameter (``tensor_model_parallel`` /
    ``partition_dim`` attributes) as the DTensor over the tp mesh it stands for."""
    if dist_index.tp_dim is None:
        raise ValueError(
            "make_fsdp_dtensor: tensor parallelism is in use but the FSDPDistributedIndex has no tp_dim; "
            "pass tp_dim (a trivial tp dimension of size 1 is fine)"
        )
    tp_mesh = dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_param)
    global_shape = list(param.shape)
    tp_dim = get_mcore_tensor_parallel_partition_dim(param)
    if tp_dim is None:  # duplicated across tp ranks
        placements: list[Placement] = [Replicate()]
        if force_sync and local_tensor.numel() > 0:
            torch.distributed.broadcast(local_tensor, group=tp_mesh.get_group(), group_src=0)
    else:
        placements = [Shard(tp_dim)]
        global_shape[tp_dim] *= tp_mesh.size()
    return DTensor.from_local(
        local_tensor,
        tp_mesh,
        placements,
        run_check=run_check,
        shape=tuple(global_shape),
        stride=torch.empty(global_shape, device="meta").stride(),
    )


def make_fsdp_dtensor(
    local_tensor: torch.Tensor,
    param: torch.nn.Parameter,
    dist_index: FSDPDistributedIndex,
    is_sharded_param: bool = True,
    is_expert_param: bool = False,
    run_check: bool = False,
    update_uneven_dtensor_chunk_meta: bool = False,
    force_sync_tp_duplicated_param: bool = False,
) -> DTensor:
    """Upstream's ``make_fsdp_dtensor``: ``local_tensor`` (this rank's rows of
    ``param``, or all of it when ``is_sharded_param=False``) as a DTensor shaped like
    ``param`` on the FSDP mesh of ``dist_index`` (see ``_fsdp_tensor_spec``).

    The rows may be uneven (Megatron-LM's converters cut them so):
    ``run_check`` validates that the pieces tile the tensor and
    ``update_uneven_dtensor_chunk_meta`` tells DCP their real extents (both
    collective; uneven_dtensor.py). Megatron-core tensor-parallel parameters
    become tp DTensors first, so the result spans ``[outer,] dp_shard, tp``."""
    if not is_sharded_param and param.numel() != local_tensor.numel():
        raise ValueError(
            f"make_fsdp_dtensor: is_sharded_param=False but the local tensor {tuple(local_tensor.shape)} does not "
            f"hold the whole parameter {tuple(param.shape)}; pass is_sharded_param=True for a shard"
        )
    template = param
    if not isinstance(param, DTensor) and using_tensor_parallel(dist_index, is_expert_parallel=is_expert_param):
        param = _tensor_parallel_param(
            local_tensor, param, dist_index, is_expert_param, run_check, force_sync_tp_duplicated_param
        )
    mesh, placements = _fsdp_tensor_spec(param, dist_index, is_sharded_param, is_expert_param)
    local_shape = (-1, *template.shape[1:]) if template.dim() > 1 else (-1,)
    out = DTensor.from_local(
        local_tensor.view(local_shape), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    if run_check:
        validate_uneven_dtensor(out)
    if update_uneven_dtensor_chunk_meta:
        update_uneven_dtensor_chunk_metadata(out)
    return out
