"""``FSDPDistributedIndex``: the one place that knows the process groups.

Everything else asks it for "the group a parameter group shards over", "the group
its replicas all-reduce over", and the matching DeviceMesh for DTensors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

logger = logging.getLogger(__name__)

DEFAULT_DP_SHARD_DIM = "fsdp"
DEFAULT_TP_DIM = "tp"


def has_submesh(mesh: DeviceMesh, dims: "str | tuple[str, ...]") -> bool:
    """Whether ``mesh[dims]`` names a sub-mesh: a dimension of the mesh or one
    flattened from its dimensions (``mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")``)."""
    try:
        mesh[dims]
    except (KeyError, ValueError, RuntimeError, IndexError):
        return False
    return True


def _check_dim(mesh: DeviceMesh, dim: Optional[str], arg_name: str) -> None:
    if dim is None or has_submesh(mesh, dim):
        return
    names = mesh.mesh_dim_names or ()
    raise ValueError(
        f"{arg_name}={dim!r} is not a dimension of the device mesh (its dimensions are {list(names)}, "
        f"plus any flattened from them); name one of those, build the mesh with mesh_dim_names that include "
        f"{dim!r}, or flatten dimensions into it (mesh[(a, b)]._flatten({dim!r}))"
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


def _flatten_for_reductions(mesh: DeviceMesh) -> None:
    """A norm of the gradients is partial over every dimension of a multi-dimensional
    DTensor mesh ((dp_outer, dp_shard) under HSDP, (dp dims..., tp) under tensor
    parallelism); DTensor reduces it in one all-reduce when the mesh has the dimensions'
    flattened twin (one process group, made once here), else in one per dimension (an
    order that may differ between ranks, and a warning)."""
    if mesh.ndim < 2 or mesh.size(mesh.ndim - 1) == 1:  # a trivial last dimension: nothing to flatten for
        return
    try:
        mesh._flatten()
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # a torch without it, or names it refuses
        logger.debug("megatron_fsdp: no flattened twin of %s: %s", mesh, exc)


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
    mesh_with_tp: Optional[DeviceMesh] = None
    """``mesh`` with the tensor-parallel dimension last: the mesh of tensor-parallel
    parameters' DTensors ([Note: tensor-parallel parameters])."""

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


EXPERT_PARALLEL_DIM = "ep"
"""The dimension of ``expt_device_mesh`` whose ranks hold different experts."""


def _expert_parallel_group(mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
    if mesh is None or EXPERT_PARALLEL_DIM not in (mesh.mesh_dim_names or ()):
        return None
    sub = mesh[EXPERT_PARALLEL_DIM]
    return sub.get_group() if sub.size() > 1 else None


class FSDPDistributedIndex:
    """Process groups and sub-meshes used by Megatron-FSDP.

    ``dp_shard`` shards parameters/gradients/optimizer state; ``dp_outer`` (HSDP)
    replicates across shard groups; ``tp`` is tensor parallelism: the engine shards
    each rank's TP piece over the data-parallel dimensions only, which therefore must
    not include ``tp`` ([Note: tensor-parallel parameters]).
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str,
        dp_outer_dim: Optional[str] = None,
        tp_dim: Optional[str] = None,
        hybrid_fsdp_group: Optional[dist.ProcessGroup] = None,
        hybrid_fsdp_expt_group: Optional[dist.ProcessGroup] = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: Optional[DeviceMesh] = None,
        fsdp_group_ag: Optional[dist.ProcessGroup] = None,
        expt_fsdp_group_ag: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Upstream's signature. ``fsdp_group_ag`` / ``expt_fsdp_group_ag`` (separate
        all-gather groups) are only stored: ``get_fsdp_group(independent_all_gather=True)``
        returns them; the engine gathers over the shard group."""
        if dp_shard_dim is None:
            raise ValueError("FSDPDistributedIndex needs dp_shard_dim: the mesh dimension parameters are sharded over")
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
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group
        self.fsdp_group_ag = fsdp_group_ag
        self.expt_fsdp_group_ag = expt_fsdp_group_ag
        if expt_device_mesh is not None:
            for dim, name in ((dp_shard_dim, "dp_shard_dim"), (dp_outer_dim, "dp_outer_dim")):
                if dim is not None and not has_submesh(expt_device_mesh, dim):
                    raise ValueError(
                        f"expt_device_mesh has no dimension {dim!r} ({name}); its dimensions are "
                        f"{list(expt_device_mesh.mesh_dim_names or ())}. Name the expert data-parallel dimensions alike."
                    )
        self._groups: dict[bool, DataParallelGroups] = {}
        self.expt_parallel_group: Optional[dist.ProcessGroup] = _expert_parallel_group(expt_device_mesh)
        """The ranks holding the other experts (expert parallelism), None without it: the
        ``ep`` dimension of ``expt_device_mesh`` when it has one of size > 1 (a caller
        with its own groups, the Megatron-core adapter, may set it)."""

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
        dtensor_mesh, placements, dims = shard_mesh, (Shard(0),), (self.dp_shard_dim,)
        if self.dp_outer_dim is not None and mesh[self.dp_outer_dim].size() > 1:
            outer_group = mesh[self.dp_outer_dim].get_group()
            dims = (self.dp_outer_dim, self.dp_shard_dim)
            dtensor_mesh = mesh[dims]
            _flatten_for_reductions(dtensor_mesh)
            placements = (Shard(0) if self.hsdp_outer_dp_shard else Replicate(), Shard(0))
        mesh_with_tp = None
        if self.tp_dim is not None and has_submesh(mesh, self.tp_dim):
            mesh_with_tp = mesh[dims + (self.tp_dim,)]
            _flatten_for_reductions(mesh_with_tp)
        return DataParallelGroups(
            shard_group=shard_mesh.get_group(),
            outer_group=outer_group,
            outer_shards_optimizer=self.hsdp_outer_dp_shard and outer_group is not None,
            mesh=dtensor_mesh,
            placements=placements,
            scaling_size=self.dp_size,
            mesh_with_tp=mesh_with_tp,
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

    # -- upstream's accessors ----------------------------------------------------------
    @property
    def use_hybrid_fsdp(self) -> bool:
        return self.dp_outer_dim is not None

    @property
    def fsdp_group(self) -> dist.ProcessGroup:
        return self.dp_shard_group

    @property
    def outer_fsdp_group(self) -> Optional[dist.ProcessGroup]:
        return self.dp_outer_group

    @property
    def expt_fsdp_group(self) -> Optional[dist.ProcessGroup]:
        return None if self.expt_device_mesh is None else self.expt_device_mesh[self.dp_shard_dim].get_group()

    @property
    def expt_outer_fsdp_group(self) -> Optional[dist.ProcessGroup]:
        if self.expt_device_mesh is None or self.dp_outer_dim is None:
            return None
        return self.expt_device_mesh[self.dp_outer_dim].get_group()

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        """The tensor-parallel sub-mesh, ``None`` without ``tp_dim``."""
        return None if self.tp_dim is None else self.device_mesh[self.tp_dim]

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_dim is None else self.device_mesh[self.tp_dim].size()

    def get_root_mesh(self, is_expert_parallel: bool = False) -> Optional[DeviceMesh]:
        """The mesh this index was built on (the expert mesh for expert parameters)."""
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh

    def get_submesh(self, mesh_dim_names: "str | Sequence[str]", is_expert_parallel: bool = False) -> DeviceMesh:
        """The sub-mesh of these dimension names (flattened ones included)."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) or mesh_dim_names is None else tuple(mesh_dim_names)
        mesh = self.get_root_mesh(is_expert_parallel)
        if mesh is None or None in names or not has_submesh(mesh, names if len(names) > 1 else names[0]):
            raise ValueError(
                f"get_submesh: no sub-mesh {names} (is_expert_parallel={is_expert_parallel}) in {mesh}; "
                "name dimensions of the (expert) device mesh"
            )
        return mesh[names if len(names) > 1 else names[0]]

    def get_fsdp_group(self, is_expert_parallel: bool = False, independent_all_gather: bool = False) -> Optional[dist.ProcessGroup]:
        """The group parameters shard over (``independent_all_gather``: the separate
        all-gather group given at construction, if any)."""
        if independent_all_gather:
            return self.expt_fsdp_group_ag if is_expert_parallel else self.fsdp_group_ag
        return self.expt_fsdp_group if is_expert_parallel else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> Optional[dist.ProcessGroup]:
        """The HSDP outer (replica) group; ``None`` without HSDP."""
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    def get_dp_group(self, is_expert_parallel: bool = False) -> Optional[dist.ProcessGroup]:
        """All data-parallel ranks: the hybrid (outer x shard) group under HSDP, else the shard group."""
        if not self.use_hybrid_fsdp:
            return self.get_fsdp_group(is_expert_parallel)
        given = self.hybrid_fsdp_expt_group if is_expert_parallel else self.hybrid_fsdp_group
        if given is not None:
            return given
        mesh = self.get_root_mesh(is_expert_parallel)
        return None if mesh is None else mesh[(self.dp_outer_dim, self.dp_shard_dim)]._flatten().get_group()

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """This rank's index when HFSDP shards over (shard, outer) in that order:
        ``shard_rank * outer_size + outer_rank`` (the optimizer piece it owns)."""
        if not self.hsdp_outer_dp_shard:
            raise ValueError("get_logical_hybrid_fsdp_rank needs HFSDP (outer_dp_sharding_strategy='optim')")
        return self.groups_for(is_expert_parallel).optimizer_rank

    def __repr__(self) -> str:
        return (
            f"FSDPDistributedIndex(dp_shard={self.dp_shard_dim}:{self.shard_size}, "
            f"dp_outer={self.dp_outer_dim}:{self.outer_size}, tp={self.tp_dim}:{self.tp_size})"
        )
