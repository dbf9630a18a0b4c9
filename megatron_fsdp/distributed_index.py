"""``FSDPDistributedIndex``: the one place that knows the process groups.

Everything else asks it for "the group a parameter group shards over", "the group
its replicas all-reduce over", and the matching DeviceMesh for DTensors.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)

DEFAULT_DP_SHARD_DIM = "fsdp"
DEFAULT_TP_DIM = "tp"


def _check_dim(mesh: DeviceMesh, dim: Optional[str], arg_name: str) -> None:
    if dim is None:
        return
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(
            f"{arg_name}={dim!r} is not a dimension of the device mesh (its dimensions are {list(names)}); "
            f"name one of those, or build the mesh with mesh_dim_names that include {dim!r}"
        )


def build_default_mesh(device_type: str, dp_shard_dim: str = DEFAULT_DP_SHARD_DIM, tp_dim: str = DEFAULT_TP_DIM) -> DeviceMesh:
    """A (world, 1) mesh: every rank shards, tensor parallelism is trivial."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "(e.g. launch with torchrun) before sharding a model"
        )
    return init_device_mesh(device_type, (dist.get_world_size(), 1), mesh_dim_names=(dp_shard_dim, tp_dim))


class FSDPDistributedIndex:
    """Process groups and sub-meshes used by Megatron-FSDP.

    ``dp_shard`` shards parameters/gradients/optimizer state; ``dp_outer`` (HSDP)
    replicates across shard groups; ``tp`` is tensor parallelism (only carried).
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str,
        dp_outer_dim: Optional[str] = None,
        tp_dim: Optional[str] = None,
        hybrid_fsdp_group: Optional[dist.ProcessGroup] = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: Optional[DeviceMesh] = None,
    ) -> None:
        for dim, name in ((dp_shard_dim, "dp_shard_dim"), (dp_outer_dim, "dp_outer_dim"), (tp_dim, "tp_dim")):
            _check_dim(device_mesh, dim, name)
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh

        self.dp_shard_mesh: DeviceMesh = device_mesh[dp_shard_dim]
        self.dp_shard_group: dist.ProcessGroup = self.dp_shard_mesh.get_group()
        self.dp_outer_group: Optional[dist.ProcessGroup] = (
            device_mesh[dp_outer_dim].get_group() if dp_outer_dim is not None else None
        )
        self.tp_group: Optional[dist.ProcessGroup] = device_mesh[tp_dim].get_group() if tp_dim is not None else None
        self.hybrid_fsdp_group = hybrid_fsdp_group

    # -- the data-parallel shard group ----------------------------------------
    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.dp_shard_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.dp_shard_group)

    # -- the outer (replica) group -------------------------------------------
    @property
    def outer_size(self) -> int:
        return 1 if self.dp_outer_group is None else dist.get_world_size(self.dp_outer_group)

    @property
    def dp_size(self) -> int:
        """All data-parallel ranks: gradients average over this many replicas."""
        return self.shard_size * self.outer_size

    def __repr__(self) -> str:
        return (
            f"FSDPDistributedIndex(dp_shard={self.dp_shard_dim}:{self.shard_size}, "
            f"dp_outer={self.dp_outer_dim}:{self.outer_size}, tp={self.tp_dim})"
        )
