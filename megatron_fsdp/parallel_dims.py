"""The launcher's process layout: data- and tensor-parallel ranks in Megatron-LM's order,
the device mesh megatron_fsdp wraps the model with, and the group the training loop
sums its losses over.

[Note: rank order] Megatron-LM numbers the ranks tensor-parallel fastest: global rank
= data-parallel rank x TP + TP rank, and with HSDP (``--num-distributed-optimizer-instances``
> 1) data-parallel rank = outer index x shard size + shard index. The mesh is that order
read as a row-major array, ``(dp_outer, dp_shard, tp)`` with HSDP or ``(dp_shard, tp)``,
so the TP groups are runs of consecutive ranks (one node's fast links) and the batch
of data-parallel rank d goes to the TP ranks d x TP .. d x TP + TP - 1 alike.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world`` ranks split into tensor- and data-parallel groups."""

    world: int
    tp: int = 1
    """``--tensor-model-parallel-size``."""
    outer: int = 1
    """``--num-distributed-optimizer-instances``: HSDP replicas of the shard group."""
    sequence_parallel: bool = False
    """``--sequence-parallel`` (with ``tp`` > 1)."""

    def __post_init__(self) -> None:
        for name in ("world", "tp", "outer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.world % self.tp:
            raise ValueError(f"tensor-parallel size {self.tp} does not divide the world size {self.world}; "
                             "launch a multiple of it")
        if self.dp % self.outer:
            raise ValueError(f"{self.outer} optimizer instances do not divide the data-parallel size {self.dp}; "
                             "use a divisor of it")

    @classmethod
    def from_args(cls, args, world: int) -> "ParallelDims":
        return cls(world=world, tp=args.tensor_model_parallel_size, outer=args.num_distributed_optimizer_instances,
                   sequence_parallel=bool(args.sequence_parallel) and args.tensor_model_parallel_size > 1)

    @property
    def dp(self) -> int:
        """The data-parallel size: ranks that train on different samples."""
        return self.world // self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.outer

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (see [Note: rank order])."""
        return rank // self.tp

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """The wrapper's mesh (collective: every rank calls it), or None when neither TP nor
        HSDP needs one (megatron_fsdp then shards over the default group)."""
        if self.tp == 1 and self.outer == 1:
            return None
        if self.outer > 1:
            return init_device_mesh(device_type, (self.outer, self.dp_shard, self.tp),
                                    mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp_shard", "tp"))

    def wrap_kwargs(self, mesh: Optional[DeviceMesh], dp_group: Optional[dist.ProcessGroup]) -> dict:
        """``fully_shard_model``'s mesh arguments for ``build_mesh``'s mesh and
        ``data_parallel_group``'s group (HSDP's whole data-parallel group)."""
        if mesh is None:
            return {}
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        if self.outer > 1:
            kwargs.update(dp_outer_dim="dp_outer", hybrid_fsdp_group=dp_group or dist.group.WORLD)
        return kwargs

    def data_parallel_group(self, mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
        """The ranks sharing this rank's TP piece and training on other samples; None when
        that is every rank (no TP). Collective; call it once per mesh (with HSDP it
        flattens the two data-parallel dimensions into a new group)."""
        if mesh is None or self.tp == 1:
            return None
        if self.outer > 1:
            return mesh["dp_outer", "dp_shard"]._flatten().get_group()
        return mesh["dp_shard"].get_group()
