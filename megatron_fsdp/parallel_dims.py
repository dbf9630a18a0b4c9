"""The process layout of every parallelism at once: data, tensor, context and expert
ranks in Megatron-LM's order, the device meshes megatron_fsdp wraps a model with, and
the groups a training loop sums its losses and counts over. The launcher builds it from
``--*-parallel-size`` flags; a user's own loop builds one directly::

    dims = ParallelDims(world=8, tp=2, cp=2)
    mesh = dims.build_mesh("cuda")            # (dp_shard, cp, tp), dp_shard_cp flattened
    model = apply_tensor_parallel(model, dims.tp_mesh(mesh))
    model = apply_context_parallel(model, dims.cp_mesh(mesh))
    model = fully_shard_model(model, **dims.wrap_kwargs(mesh, dims.data_parallel_group(mesh)))

[Note: rank order] Megatron-LM numbers the dense ranks tensor-parallel fastest, then
context-parallel, then data-parallel (``parallel_state``'s default ``tp-cp-ep-dp-pp``):
global rank = (dp rank x CP + cp rank) x TP + tp rank; with HSDP
(``--num-distributed-optimizer-instances`` > 1) data-parallel rank = outer index x shard
size + shard index. The dense mesh is that order read as a row-major array,
``(dp_outer, dp_shard, cp, tp)`` (dimensions of size 1 left out), so TP groups are runs
of consecutive ranks (one node's fast links), the CP ranks of one data-parallel rank
come next, and the batch of data-parallel rank d goes to all of its TP x CP ranks.

Experts have a layout of their own (Megatron-LM's expert rank generator, ``tp-ep-dp-pp``
with the expert tensor-parallel size 1): global rank = expert-data-parallel rank x EP +
EP rank, so EP groups are consecutive ranks carved out of the data x context ranks, and
the expert data-parallel ranks (which hold the same experts) are strided by EP. The
expert mesh is ``(dp_outer, dp_shard, ep)``; with HSDP its outer dimension splits the
expert data-parallel ranks into consecutive blocks, as megatron-core's partial expert
data-parallel groups do, which are the dense outer blocks too.

[Note: sharding over data x context] Every CP rank of a data-parallel rank holds the
whole model and computes gradients for its part of the sequences, so dense parameters
are sharded, and their gradients averaged, over the data x context ranks: the flattened
``dp_shard_cp`` dimension (upstream Megatron-FSDP's recipe). The loss each CP rank
backpropagates is scaled so that this average is the global batch's gradient
(``models.context_parallel``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm.distributed_index import DEFAULT_DP_SHARD_DIM

SHARD_CP_DIM = "dp_shard_cp"
"""The flattened (dp_shard, cp) dimension dense parameters shard over when CP > 1."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world`` ranks split into tensor-, context-, expert- and data-parallel groups."""

    world: int
    tp: int = 1
    """``--tensor-model-parallel-size``."""
    cp: int = 1
    """``--context-parallel-size``: ranks that share each sequence."""
    ep: int = 1
    """``--expert-model-parallel-size``: ranks that share each MoE layer's experts."""
    outer: int = 1
    """``--num-distributed-optimizer-instances``: HSDP replicas of the shard group."""
    sequence_parallel: bool = False
    """``--sequence-parallel`` (with ``tp`` > 1)."""

    def __post_init__(self) -> None:
        for name in ("world", "tp", "cp", "ep", "outer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.world % (self.tp * self.cp):
            raise ValueError(f"tensor-parallel size {self.tp} x context-parallel size {self.cp} does not divide the "
                             f"world size {self.world}; launch a multiple of {self.tp * self.cp} ranks")
        if self.dp % self.outer:
            raise ValueError(f"{self.outer} optimizer instances do not divide the data-parallel size {self.dp}; "
                             "use a divisor of it")
        self._check_experts()

    def _check_experts(self) -> None:
        if self.ep == 1:
            return
        if self.tp > 1:
            raise ValueError(f"expert-model-parallel size {self.ep} with tensor-parallel size {self.tp}: experts are "
                             "not supported together with tensor parallelism here; use --tensor-model-parallel-size 1 "
                             "or --expert-model-parallel-size 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert-model-parallel size {self.ep} does not divide the data x context-parallel size "
                             f"{self.dp * self.cp} it is carved out of; use a divisor of it")
        if self.edp % self.outer:
            raise ValueError(f"{self.outer} optimizer instances do not divide the expert data-parallel size "
                             f"{self.edp} (world {self.world} / expert-model-parallel size {self.ep}); use a divisor")

    @classmethod
    def from_args(cls, args, world: int) -> "ParallelDims":
        tp = args.tensor_model_parallel_size
        return cls(world=world, tp=tp, cp=getattr(args, "context_parallel_size", 1),
                   ep=getattr(args, "expert_model_parallel_size", 1),
                   outer=args.num_distributed_optimizer_instances,
                   sequence_parallel=bool(args.sequence_parallel) and tp > 1)

    # -- sizes and ranks ----------------------------------------------------------------
    @property
    def dp(self) -> int:
        """The data-parallel size: ranks that train on different samples."""
        return self.world // (self.tp * self.cp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.outer

    @property
    def edp(self) -> int:
        """The expert data-parallel size: ranks holding the same experts."""
        return self.world // (self.tp * self.ep)

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (see [Note: rank order])."""
        return rank // (self.tp * self.cp)

    def context_parallel_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def expert_parallel_rank(self, rank: int) -> int:
        return rank % self.ep

    # -- meshes ---------------------------------------------------------------------------
    @property
    def shard_dim(self) -> str:
        """The dense mesh dimension parameters shard over."""
        if self.cp > 1:
            return SHARD_CP_DIM
        return "dp_shard" if self._needs_mesh else DEFAULT_DP_SHARD_DIM

    @property
    def _needs_mesh(self) -> bool:
        return self.tp > 1 or self.cp > 1 or self.outer > 1

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """The wrapper's dense mesh (collective: every rank calls it), or None when no TP,
        CP or HSDP needs one (megatron_fsdp then shards over the default group)."""
        if not self._needs_mesh:
            return None
        dims = [("dp_outer", self.outer), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
        dims = [(name, size) for name, size in dims if size > 1 or name in ("dp_shard", "tp")]
        mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        if self.cp > 1:
            mesh["dp_shard", "cp"]._flatten(SHARD_CP_DIM)
        return mesh

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The expert mesh ``(dp_outer, <shard_dim>, ep)`` (collective): experts shard over
        its shard dimension, named as the dense mesh's because the engine reads both by
        one name, and ``ep_mesh`` is its expert-parallel dimension."""
        if self.tp > 1:
            raise ValueError(f"a mixture-of-experts model with tensor-parallel size {self.tp}: experts are not "
                             "supported together with tensor parallelism here (they would need an expert "
                             "tensor-parallel layout); use --tensor-model-parallel-size 1")
        dims = [("dp_outer", self.outer), (self.shard_dim, self.edp // self.outer), ("ep", self.ep)]
        dims = [(name, size) for name, size in dims if size > 1 or name != "dp_outer"]
        return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))

    @staticmethod
    def tp_mesh(mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
        return mesh["tp"] if mesh is not None and mesh["tp"].size() > 1 else None

    def cp_mesh(self, mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
        return mesh["cp"] if self.cp > 1 else None

    def ep_mesh(self, expert_mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
        return expert_mesh["ep"] if self.ep > 1 and expert_mesh is not None else None

    def wrap_kwargs(self, mesh: Optional[DeviceMesh], dp_group: Optional[dist.ProcessGroup]) -> dict:
        """``fully_shard_model``'s mesh arguments for ``build_mesh``'s mesh and
        ``data_parallel_group``'s group (HSDP's whole data-parallel group)."""
        if mesh is None:
            return {}
        kwargs = dict(device_mesh=mesh, dp_shard_dim=self.shard_dim, tp_dim="tp")
        if self.outer > 1:
            whole = dp_group if self.cp == 1 else self.data_context_group(mesh)  # every rank of this TP piece
            kwargs.update(dp_outer_dim="dp_outer", hybrid_fsdp_group=whole or dist.group.WORLD)
        return kwargs

    # -- groups --------------------------------------------------------------------------
    def data_parallel_group(self, mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
        """The ranks sharing this rank's TP piece and CP part and training on other
        samples; None when that is every rank. Collective; call it once per mesh (with
        HSDP it flattens the two data-parallel dimensions into a new group)."""
        if mesh is None or (self.tp == 1 and self.cp == 1):
            return None
        if self.outer > 1:
            return mesh["dp_outer", "dp_shard"]._flatten().get_group()
        return mesh["dp_shard"].get_group()

    def data_context_group(self, mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
        """The data x context ranks of this rank's TP piece (the dense gradients' group);
        None when that is every rank. Collective, as ``data_parallel_group``."""
        if mesh is None or self.tp == 1:
            return None
        if self.cp == 1:
            return self.data_parallel_group(mesh)
        if self.outer > 1:
            return mesh["dp_outer", SHARD_CP_DIM]._flatten().get_group()
        return mesh[SHARD_CP_DIM].get_group()
