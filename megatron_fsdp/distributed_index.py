"""``FSDPDistributedIndex``: the one place that knows the process groups.

Everything else asks it for "the group a parameter group shards over", "the group
its replicas all-reduce over", and the matching DeviceMesh for DTensors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

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


_meshes: dict[tuple, DeviceMesh] = {}


def _world_size() -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "(e.g. launch with torchrun) before sharding a model"
        )
    return dist.get_world_size()


def _cached_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Build (once per process group) a mesh over the whole world.

    Building a mesh creates process groups; a long-lived process that wraps many
    models should not pile them up."""
    key = (id(dist.group.WORLD), device_type, shape, names)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _meshes[key]


def build_default_mesh(device_type: str, dp_shard_dim: str = DEFAULT_DP_SHARD_DIM, tp_dim: str = DEFAULT_TP_DIM) -> DeviceMesh:
    """A (world, 1) mesh: every rank shards, tensor parallelism is trivial."""
    return _cached_mesh(device_type, (_world_size(), 1), (dp_shard_dim, tp_dim))


def build_hybrid_mesh(
    device_type: str,
    outer_size: int,
    *,
    dp_outer_dim: str = "dp_outer",
    dp_shard_dim: str = "dp_shard",
    tp_dim: str = DEFAULT_TP_DIM,
) -> DeviceMesh:
    """An (outer, shard, 1) mesh for HSDP/HFSDP: ``outer_size`` replicas (Megatron's
    ``num_distributed_optimizer_instances``) of a shard group."""
    world = _world_size()
    if outer_size < 1 or world % outer_size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"num_distributed_optimizer_instances={outer_size} does not divide the world size {world}; "
            f"use one of {divisors}"
        )
    return _cached_mesh(device_type, (outer_size, world // outer_size, 1), (dp_outer_dim, dp_shard_dim, tp_dim))


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallelGroups:
    """The data-parallel topology one parameter group lives on.

    Buffers shard over ``shard_group``; HSDP replicates across ``outer_group``;
    HFSDP (``outer_shards_optimizer``) also splits each shard's optimizer state
    across ``outer_group``: rank (outer o, shard r) owns piece o of shard r.
    """

    shard_group: dist.ProcessGroup
    outer_group: Optional[dist.ProcessGroup]
    outer_shards_optimizer: bool
    mesh: DeviceMesh
    """Mesh of the distributed parameters' DTensors."""
    placements: tuple[Placement, ...]
    scaling_size: int
    """Gradients average over this many replicas (the dense data-parallel size, also
    for expert parameters, as Megatron scales them)."""

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer_group is None else dist.get_world_size(self.outer_group)

    @property
    def outer_rank(self) -> int:
        return 0 if self.outer_group is None else dist.get_rank(self.outer_group)

    @property
    def optimizer_parts(self) -> int:
        """Into how many pieces the optimizer splits each shard (HFSDP: the outer size)."""
        return self.outer_size if self.outer_shards_optimizer else 1

    @property
    def optimizer_rank(self) -> int:
        return self.shard_rank * self.optimizer_parts + (self.outer_rank if self.outer_shards_optimizer else 0)


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
        if expt_device_mesh is not None:
            for dim, name in ((dp_shard_dim, "dp_shard_dim"), (dp_outer_dim, "dp_outer_dim")):
                if dim is not None and dim not in (expt_device_mesh.mesh_dim_names or ()):
                    raise ValueError(
                        f"expt_device_mesh has no dimension {dim!r} ({name}); its dimensions are "
                        f"{list(expt_device_mesh.mesh_dim_names or ())}. Name the expert data-parallel dimensions alike."
                    )
        self._groups: dict[bool, DataParallelGroups] = {}

    def groups_for(self, is_expert: bool = False) -> DataParallelGroups:
        """The topology of regular (or expert) parameters."""
        if is_expert and self.expt_device_mesh is None:
            raise ValueError(
                "the model has expert parameters (marked allreduce=False) but no expt_device_mesh was given; "
                "pass expt_device_mesh= with the expert data-parallel dimensions"
            )
        if is_expert not in self._groups:
            mesh = self.expt_device_mesh if is_expert else self.device_mesh
            self._groups[is_expert] = self._make_groups(mesh)
        return self._groups[is_expert]

    def _make_groups(self, mesh: DeviceMesh) -> DataParallelGroups:
        shard_mesh = mesh[self.dp_shard_dim]
        outer_group = None
        dtensor_mesh, placements = shard_mesh, (Shard(0),)
        if self.dp_outer_dim is not None and mesh[self.dp_outer_dim].size() > 1:
            outer_group = mesh[self.dp_outer_dim].get_group()
            dtensor_mesh = mesh[(self.dp_outer_dim, self.dp_shard_dim)]
            placements = (Shard(0) if self.hsdp_outer_dp_shard else Replicate(), Shard(0))
        return DataParallelGroups(
            shard_group=shard_mesh.get_group(),
            outer_group=outer_group,
            outer_shards_optimizer=self.hsdp_outer_dp_shard and outer_group is not None,
            mesh=dtensor_mesh,
            placements=placements,
            scaling_size=self.dp_size,
        )

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
