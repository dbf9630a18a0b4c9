"""``FullyShardedDataParallel``: Megatron-FSDP behind Megatron-core's data-parallel
wrapper interface.

Megatron-LM's training loop drives a model chunk through a fixed set of methods
(``no_sync``, ``start_grad_sync``, ``finish_grad_sync``, ``zero_grad_buffer``,
``start_param_sync``, ``scale_gradients``, ``broadcast_params``,
``sharded_state_dict``...) whatever the data-parallel implementation. This class
offers that interface, with the constructor of Megatron-core's
``FullyShardedDataParallel``, and delegates the work to an inner ``MegatronFSDP``
(``self.module``; the user's model is ``self.module.module``).

It accepts Megatron-core's ``DistributedDataParallelConfig`` as well as ours
(``convert_ddp_config``) and its ``ProcessGroupCollection``; megatron-core itself
is optional: with a plain PyTorch model and our config it is never imported.

Megatron-core's tensor-parallel layers (``ColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``...) are sharded over the
data-parallel ranks of their TP piece: the engine's mesh gets a ``tp`` dimension
holding Megatron-core's TP group ([Note: the mesh of Megatron-core's groups]);
the engine completes the gradients its layers leave partial over the TP ranks once,
whether the loop calls ``finish_grad_sync`` or megatron-core's ``finalize_model_grads``
(compat/megatron_core.py [Note: tensor-parallel partial gradients]), and marks the
distributed parameters for megatron-core's norm rule (buffers/param_and_grad_buffer.py
[Note: Megatron-core's gradient norm]).

A MoE model's experts (Megatron-core marks them ``allreduce=False`` under expert
parallelism) shard over the ranks holding the same experts: Megatron-core's expert
data-parallel group, or under HSDP its intra-partial expert data-parallel group
replicated over the inter-instance group; the expert mesh carries an ``ep`` dimension
for the gradient norm and the full state dict ([Note: the expert mesh of Megatron-core's
groups]). Expert parallelism with tensor parallelism is refused.

After ``finish_grad_sync()`` the reduced gradients sit in ``.grad`` of
``parameters()`` (the distributed main weights), where a plain torch optimizer
reads them; after its ``step()`` call ``install_optimized_model_weights()``, or
wrap the optimizer with ``megatron_fsdp.fully_shard_optimizer`` to do both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import device as device_mod
from .compat import megatron_core as mcore
from .config import DistributedDataParallelConfig
from .comm.distributed_index import EXPERT_PARALLEL_DIM, FSDPDistributedIndex, build_default_mesh
from .enums import ShardingStrategy
from .megatron_fsdp import MegatronFSDP
from .state.model_state_dict import get_full_state_dict, sharded_state_dict

logger = logging.getLogger(__name__)

_OUR_FIELDS = {f.name: f for f in dataclasses.fields(DistributedDataParallelConfig) if f.init}


# -- configuration -------------------------------------------------------------------------
def convert_ddp_config(ddp_config: Any) -> DistributedDataParallelConfig:
    """Our ``DistributedDataParallelConfig`` from ours or Megatron-core's (or any
    object with the same field names).

    Fields both know are copied; fields ours lacks are dropped (logged when set
    away from their default); fields the source lacks keep our defaults. Values
    our config rejects raise its ``ValueError``; features the engine does not
    implement (``nccl_ub``, ``fsdp_double_buffer``...) raise the engine's
    ``NotImplementedError`` when the model is wrapped.
    """
    if isinstance(ddp_config, DistributedDataParallelConfig):
        _check_uses_megatron_fsdp(ddp_config)
        return ddp_config
    if ddp_config is None or isinstance(ddp_config, (dict, str, int, float, bool)):
        raise TypeError(
            f"ddp_config={ddp_config!r} is not a DistributedDataParallelConfig; pass "
            "megatron_fsdp.DistributedDataParallelConfig(...) or Megatron-core's "
            "megatron.core.distributed.DistributedDataParallelConfig(use_megatron_fsdp=True, ...)"
        )
    _check_uses_megatron_fsdp(ddp_config)
    values = {name: getattr(ddp_config, name) for name in _OUR_FIELDS if hasattr(ddp_config, name)}
    ignored = _ignored_fields(ddp_config)
    if ignored:
        logger.warning(
            "megatron_fsdp: ddp_config fields that FullyShardedDataParallel does not use were set and are ignored: %s",
            ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
        )
    return DistributedDataParallelConfig(**values)


def _check_uses_megatron_fsdp(cfg: Any) -> None:
    # Megatron-core's config defaults use_megatron_fsdp to False (plain DDP); its
    # older name for the flag was use_custom_fsdp.
    if not (getattr(cfg, "use_megatron_fsdp", True) or getattr(cfg, "use_custom_fsdp", False)):
        raise ValueError(
            "ddp_config.use_megatron_fsdp=False asks for Megatron-core's plain DistributedDataParallel, "
            "not FullyShardedDataParallel; set use_megatron_fsdp=True (with data_parallel_sharding_strategy="
            "'no_shard' for DDP-like training) or wrap the model with megatron.core.distributed."
            "DistributedDataParallel"
        )


def _ignored_fields(cfg: Any) -> dict[str, Any]:
    """Fields of a dataclass config that ours lacks and that differ from their default."""
    if not dataclasses.is_dataclass(cfg):
        return {}
    ignored = {}
    for field in dataclasses.fields(cfg):
        if field.name in _OUR_FIELDS or field.name in ("use_custom_fsdp",):
            continue
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        value = getattr(cfg, field.name, default)
        if value != default:
            ignored[field.name] = value
    return ignored


# -- process groups ------------------------------------------------------------------------
_SHARD_DIM, _OUTER_DIM, _TP_DIM = "dp_cp", "outer_fsdp_dp", "tp"


@dataclasses.dataclass(frozen=True)
class _ParallelGroups:
    """The groups FSDP needs: shard over ``shard``; with HSDP replicate over ``outer``;
    tensor parallelism over ``tp``."""

    shard: dist.ProcessGroup
    outer: Optional[dist.ProcessGroup] = None
    hybrid: Optional[dist.ProcessGroup] = None
    """All data-parallel ranks (shard x outer) under HSDP."""
    tp: Optional[dist.ProcessGroup] = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp)


def _groups_from_collection(pg_collection: Any, hsdp: bool) -> _ParallelGroups:
    tp = getattr(pg_collection, "tp", None)
    if hsdp:
        names = ("intra_dp_cp", "inter_dist_opt", "dp_cp")
        missing = [n for n in names if getattr(pg_collection, n, None) is None]
        if missing:
            raise ValueError(
                f"pg_collection lacks {missing}, which num_distributed_optimizer_instances > 1 (HSDP) needs: "
                "intra_dp_cp (shard group), inter_dist_opt (replica group) and dp_cp (all of them)"
            )
        return _ParallelGroups(pg_collection.intra_dp_cp, pg_collection.inter_dist_opt, pg_collection.dp_cp, tp)
    shard = getattr(pg_collection, "dp_cp", None)
    if shard is None:
        shard = getattr(pg_collection, "dp", None)
    if shard is None:
        raise ValueError("pg_collection has neither a dp_cp nor a dp group; set pg_collection.dp_cp to the data-parallel group")
    return _ParallelGroups(shard, tp=tp)


def _groups_from_parallel_state(hsdp: bool) -> Optional[_ParallelGroups]:
    """Megatron-core's global groups when its parallel state is initialized
    (as upstream does), else ``None``."""
    ps = mcore.loaded_module("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    tp = ps.get_tensor_model_parallel_group()
    if hsdp:
        outer = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
        if outer is None:
            raise ValueError(
                "num_distributed_optimizer_instances > 1 (HSDP), but Megatron-core's parallel_state was "
                "initialized without distributed optimizer instances; pass the same "
                "num_distributed_optimizer_instances to parallel_state.initialize_model_parallel()"
            )
        return _ParallelGroups(
            ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
            outer,
            ps.get_data_parallel_group(with_context_parallel=True),
            tp,
        )
    return _ParallelGroups(ps.get_data_parallel_group(with_context_parallel=True), tp=tp)


def _hsdp_grid(shard: dist.ProcessGroup, outer: dist.ProcessGroup, hybrid: dist.ProcessGroup,
               what: str = "HSDP") -> list[list[int]]:
    """The (outer, shard) grid of the hybrid group's ranks, laid out like Megatron-core's
    (shard ranks contiguous); checked against the given groups."""
    ranks = sorted(dist.get_process_group_ranks(hybrid))
    shard_size, outer_size = dist.get_world_size(shard), dist.get_world_size(outer)
    grid = torch.tensor(ranks).reshape(outer_size, shard_size).tolist()
    me = dist.get_rank()
    row = next(r for r in grid if me in r)
    column = [r[row.index(me)] for r in grid]
    if row != dist.get_process_group_ranks(shard) or column != dist.get_process_group_ranks(outer):
        raise ValueError(
            f"the {what} groups do not form a contiguous (outer={outer_size}, shard={shard_size}) grid over ranks "
            f"{ranks}; build them as Megatron-core's parallel_state does (shard groups of consecutive ranks)"
        )
    return grid


def _grid_with_peers(grid: list, peers_group: dist.ProcessGroup, kind: str = "tensor-parallel") -> list:
    """[Note: the mesh of Megatron-core's groups] The engine's mesh is (data-parallel
    dims..., tp), and the expert mesh (expert data-parallel dims..., ep): entry
    ``[i..., j]`` is the rank at data-parallel position ``i`` of peer ``j`` of the
    ``kind`` group (TP or EP). Each peer contributes its own data-parallel grid (one
    object all-gather over the group), so the mesh holds Megatron-core's actual groups
    whatever its rank order; it is consistent when every peer sits at this rank's
    data-parallel position in its own grid (the row through this rank is the group,
    in its rank order: the order of Megatron-core's TP pieces, or of its experts) and
    no rank appears twice. Anything else is refused: the engine's DTensors would
    mislabel pieces."""
    ranks = dist.get_process_group_ranks(peers_group)
    peers: list = [None] * len(ranks)
    dist.all_gather_object(peers, grid, group=peers_group)
    where = (torch.tensor(grid) == dist.get_rank()).nonzero()[0].tolist()
    consistent = all(torch.tensor(p).shape == torch.tensor(grid).shape for p in peers)
    mesh = torch.tensor(peers).movedim(0, -1) if consistent else None
    if mesh is None or mesh[tuple(where)].tolist() != ranks or mesh.unique().numel() != mesh.numel():
        raise ValueError(
            f"rank {dist.get_rank()}: the {kind} group {ranks} and the data-parallel groups of its "
            f"members {peers} do not form a (data-parallel x {kind}) grid: each {kind} peer must sit at "
            "the same data-parallel position, and no rank may be in both. Build the groups with Megatron-core's "
            "parallel_state.initialize_model_parallel (or ProcessGroupCollection.use_mpu_process_groups())"
        )
    return mesh.tolist()


def _device_mesh(groups: _ParallelGroups, device_type: str) -> DeviceMesh:
    """A mesh over the given groups: (dp_cp), (outer_fsdp_dp, dp_cp), each with a
    trailing tp dimension under tensor parallelism."""
    if groups.outer is None and groups.tp_size == 1:
        return DeviceMesh.from_group(groups.shard, device_type, mesh_dim_names=(_SHARD_DIM,))
    dims, dim_groups = (_SHARD_DIM,), [groups.shard]
    grid: list = dist.get_process_group_ranks(groups.shard)
    if groups.outer is not None:
        dims, dim_groups = (_OUTER_DIM, _SHARD_DIM), [groups.outer, groups.shard]
        grid = _hsdp_grid(groups.shard, groups.outer, groups.hybrid)
    if groups.tp_size > 1:
        dims, dim_groups, grid = dims + (_TP_DIM,), dim_groups + [groups.tp], _grid_with_peers(grid, groups.tp)
    return DeviceMesh.from_group(dim_groups, device_type, mesh=grid, mesh_dim_names=dims)


def _index_from_groups(groups: _ParallelGroups, ddp_config: DistributedDataParallelConfig, device_type: str):
    mesh = _device_mesh(groups, device_type)
    tp_dim = _TP_DIM if groups.tp_size > 1 else None
    if groups.outer is None:
        return FSDPDistributedIndex(mesh, dp_shard_dim=_SHARD_DIM, tp_dim=tp_dim)
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=_SHARD_DIM,
        dp_outer_dim=_OUTER_DIM,
        tp_dim=tp_dim,
        hybrid_fsdp_group=groups.hybrid,
        hsdp_outer_dp_shard=ddp_config.outer_sharding_strategy is not ShardingStrategy.NO_SHARD,
    )


def _world_hsdp_index(ddp_config: DistributedDataParallelConfig, device_type: str) -> FSDPDistributedIndex:
    """HSDP over the whole world when no groups were given: ``instances`` replicas
    of shard groups of consecutive ranks, as Megatron-core lays them out."""
    instances, world = ddp_config.num_distributed_optimizer_instances, dist.get_world_size()
    if world % instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} does not divide the world size {world}; "
            f"use one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    mesh = init_device_mesh(device_type, (instances, world // instances), mesh_dim_names=(_OUTER_DIM, _SHARD_DIM))
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=_SHARD_DIM,
        dp_outer_dim=_OUTER_DIM,
        hybrid_fsdp_group=dist.group.WORLD,
        hsdp_outer_dp_shard=ddp_config.outer_sharding_strategy is not ShardingStrategy.NO_SHARD,
    )


def build_dist_index(
    ddp_config: DistributedDataParallelConfig, device: torch.device, pg_collection: Any = None, config: Any = None
) -> FSDPDistributedIndex:
    """The distributed index for ``pg_collection``'s groups, else Megatron-core's
    parallel state when initialized, else the whole world: data-parallel dimensions
    ``dp_cp`` (and ``outer_fsdp_dp`` under HSDP), plus ``tp`` when the tensor-parallel
    group is larger than one rank ([Note: the mesh of Megatron-core's groups]). With a
    MoE ``config`` (``num_moe_experts``) it carries the expert mesh too
    ([Note: the expert mesh of Megatron-core's groups])."""
    hsdp = ddp_config.num_distributed_optimizer_instances > 1
    if pg_collection is not None:
        groups = _groups_from_collection(pg_collection, hsdp)
    else:
        groups = _groups_from_parallel_state(hsdp)
    device_type = device_mod.mesh_device_type(device)
    if groups is None:
        if hsdp:
            index = _world_hsdp_index(ddp_config, device_type)
        else:
            index = FSDPDistributedIndex(build_default_mesh(device_type, _SHARD_DIM, _TP_DIM), dp_shard_dim=_SHARD_DIM,
                                         tp_dim=_TP_DIM)
    else:
        _check_experts_with_tp(config, groups, pg_collection)
        index = _index_from_groups(groups, ddp_config, device_type)
    if not getattr(config, "num_moe_experts", None):
        return index
    experts = _expert_groups(pg_collection, hsdp, index.dp_size) if groups is not None else None
    if experts is None or experts.ep_size == 1:
        expert_mesh, hybrid_expt = index.device_mesh, index.hybrid_fsdp_group  # experts shard like dense parameters
    else:
        expert_mesh, hybrid_expt = _expert_mesh(experts, device_type), experts.hybrid
    return FSDPDistributedIndex(
        index.device_mesh,
        dp_shard_dim=index.dp_shard_dim,
        dp_outer_dim=index.dp_outer_dim,
        tp_dim=index.tp_dim,
        hybrid_fsdp_group=index.hybrid_fsdp_group,
        hybrid_fsdp_expt_group=hybrid_expt,
        hsdp_outer_dp_shard=index.hsdp_outer_dp_shard,
        expt_device_mesh=expert_mesh,
    )


# -- expert parallelism ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ExpertGroups:
    """Megatron-core's groups of a MoE model's experts: they shard over ``shard`` (the
    ranks holding the same experts; under HSDP one optimizer instance's part of them),
    replicate over ``outer`` under HSDP; ``ep`` holds the other experts."""

    shard: dist.ProcessGroup
    ep: dist.ProcessGroup
    outer: Optional[dist.ProcessGroup] = None
    hybrid: Optional[dist.ProcessGroup] = None
    """All expert data-parallel ranks (shard x outer) under HSDP."""

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep)


def _expert_groups(pg_collection: Any, hsdp: bool, dp_size: int) -> Optional[_ExpertGroups]:
    """The expert groups of ``pg_collection`` (``expt_dp`` and ``ep``; under HSDP also
    ``intra_expt_dp`` and ``inter_dist_opt``) or of Megatron-core's parallel state
    (its expert data-parallel group, or under HSDP its intra-partial expert data-parallel
    group and the inter-instance group); ``None`` without expert groups (no expert parallelism)."""
    if pg_collection is None:
        ps = mcore.loaded_module("megatron.core.parallel_state")
        ep = ps.get_expert_model_parallel_group()
        if not hsdp:
            return _ExpertGroups(ps.get_expert_data_parallel_group(), ep)
        # Megatron-core's inter-instance group is the inter-partial expert data-parallel
        # group: dense and expert parameters share it.
        return _ExpertGroups(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True), ep,
                             ps.get_inter_distributed_optimizer_instance_group(), ps.get_expert_data_parallel_group())
    ep, expt_dp = getattr(pg_collection, "ep", None), getattr(pg_collection, "expt_dp", None)
    if ep is None and expt_dp is not None and dist.get_world_size(expt_dp) != dp_size:
        raise ValueError(
            f"pg_collection.expt_dp spans {dist.get_world_size(expt_dp)} ranks, not the {dp_size} data-parallel "
            "ranks, so the experts are spread over expert-parallel ranks, but pg_collection.ep is not set; set it "
            "to the expert-parallel group (ProcessGroupCollection.use_mpu_process_groups() does)"
        )
    if ep is None or dist.get_world_size(ep) == 1:
        return None
    names = ("intra_expt_dp", "inter_dist_opt", "expt_dp") if hsdp else ("expt_dp",)
    missing = [n for n in names if getattr(pg_collection, n, None) is None]
    if missing:
        raise ValueError(
            f"pg_collection.ep spans {dist.get_world_size(ep)} ranks (expert parallelism) but pg_collection lacks "
            f"{missing}, where the experts' gradients are reduced: set expt_dp (the ranks holding the same "
            "experts)" + (", intra_expt_dp and inter_dist_opt (HSDP)" if hsdp else "")
            + ", e.g. with ProcessGroupCollection.use_mpu_process_groups()"
        )
    if hsdp:
        return _ExpertGroups(pg_collection.intra_expt_dp, ep, pg_collection.inter_dist_opt, pg_collection.expt_dp)
    return _ExpertGroups(pg_collection.expt_dp, ep)


def _expert_mesh(groups: _ExpertGroups, device_type: str) -> DeviceMesh:
    """[Note: the expert mesh of Megatron-core's groups] Under expert parallelism each
    expert-parallel rank holds other experts, so the experts shard (and reduce their
    gradients) over the expert data-parallel ranks only: the engine's ``expt_device_mesh``
    is (``dp_cp``, ``ep``), or under HSDP (``outer_fsdp_dp``, ``dp_cp``, ``ep``), its
    data-parallel dimensions named as the dense mesh's because the engine reads both by
    one name. Under HSDP the shard dimension is Megatron-core's intra-partial expert
    data-parallel group and the outer one its inter-instance group, the grid checked
    against them (``_hsdp_grid``); the ``ep`` dimension comes from the expert-parallel
    peers' grids ([Note: the mesh of Megatron-core's groups]) and tells the engine whom
    to combine the experts' gradient norm and full state with. Gradients still average
    over the dense data-parallel size: the engine scales an expert's gradient, which
    already sums the tokens of its expert-parallel group, by 1/dp before a SUM, or by
    edp/dp before an AVG over the edp ranks (Megatron-core's
    ``expert_gradient_scaling_factor``)."""
    if groups.outer is None:
        dims, dim_groups = (_SHARD_DIM,), [groups.shard]
        grid: list = dist.get_process_group_ranks(groups.shard)
    else:
        dims, dim_groups = (_OUTER_DIM, _SHARD_DIM), [groups.outer, groups.shard]
        grid = _hsdp_grid(groups.shard, groups.outer, groups.hybrid, what="expert HSDP")
    grid = _grid_with_peers(grid, groups.ep, kind="expert-parallel")
    return DeviceMesh.from_group(dim_groups + [groups.ep], device_type, mesh=grid,
                                 mesh_dim_names=dims + (EXPERT_PARALLEL_DIM,))


def _expert_tp_groups(pg_collection: Any) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """(expert-parallel group, expert tensor-parallel group) of ``pg_collection`` or of
    Megatron-core's parallel state."""
    if pg_collection is not None:
        return getattr(pg_collection, "ep", None), getattr(pg_collection, "expt_tp", None)
    ps = mcore.loaded_module("megatron.core.parallel_state")
    return ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()


def _check_experts_with_tp(config: Any, groups: _ParallelGroups, pg_collection: Any) -> None:
    """Refuse expert parallelism, or an expert TP layout other than the dense one, under
    tensor parallelism: the expert mesh would need its own (expert dp x expert tp) grid."""
    if not getattr(config, "num_moe_experts", None) or groups.tp_size == 1:
        return
    ep, expt_tp = _expert_tp_groups(pg_collection)
    ep_size = 1 if ep is None else dist.get_world_size(ep)
    expt_tp_ranks = dist.get_process_group_ranks(expt_tp) if expt_tp is not None else None
    if ep_size > 1 or expt_tp_ranks not in (None, dist.get_process_group_ranks(groups.tp)):
        raise NotImplementedError(
            f"a MoE model with expert parallelism (EP size {ep_size}) or an expert tensor-parallel group "
            f"{expt_tp_ranks} other than the tensor-parallel group {dist.get_process_group_ranks(groups.tp)} "
            "is not supported by FullyShardedDataParallel together with tensor parallelism (TP size "
            f"{groups.tp_size}): the experts would need their own (expert data-parallel x expert tensor-parallel) "
            "mesh, which this adapter does not build, and sharding them on the dense one would reduce other "
            "experts' gradients together; use expert_model_parallel_size=1 and expert_tensor_parallel_size="
            "tensor_model_parallel_size, or tensor_model_parallel_size=1 with expert parallelism"
        )


def default_unit_modules(module: nn.Module, strategy: ShardingStrategy) -> list[type]:
    """Megatron-core's layer classes the model uses; none for ``no_shard``, where
    units only shape buckets and one bucket for the whole model is what DDP does."""
    if strategy is ShardingStrategy.NO_SHARD:
        return []
    classes = mcore.megatron_core_unit_classes()
    return [c for c in classes if any(isinstance(m, c) for m in module.modules())]


def _config_flag(config: Any, name: str) -> bool:
    return bool(getattr(config, name, False)) if config is not None else False


# -- the wrapper ---------------------------------------------------------------------------
class FullyShardedDataParallel(nn.Module):
    """Megatron-core's data-parallel wrapper interface over ``MegatronFSDP``.

    Args:
        config: Megatron-core ``TransformerConfig`` (or any object with its field
            names, or ``None``); read for ``calculate_per_token_loss`` and
            ``init_model_with_meta_device``; exposed as ``self.config`` for
            Megatron-LM's ``get_model_config``.
        ddp_config: ours or Megatron-core's ``DistributedDataParallelConfig``
            with ``use_megatron_fsdp=True`` (see ``convert_ddp_config``).
        module: the model to shard.
        fsdp_unit_modules: module classes (or import paths) gathered and
            reduced one instance at a time. Default: Megatron-core's layer
            classes that the model uses (``TransformerLayer``, ``MambaLayer``),
            none for ``no_shard``; with no layer class the whole model is one unit.
        disable_bucketing: one collective per parameter instead of per unit.
        device: where parameters and buffers live (default: CUDA under NCCL,
            else CPU).
        pg_collection: Megatron-core ``ProcessGroupCollection``; its ``dp_cp``
            (or ``dp``) group is the shard group, plus ``intra_dp_cp`` /
            ``inter_dist_opt`` under HSDP, and ``tp`` for tensor parallelism; for
            a MoE model under expert parallelism ``ep`` and ``expt_dp`` (under HSDP
            also ``intra_expt_dp``). Default: Megatron-core's parallel state when
            initialized, else the whole world.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: nn.Module,
        fsdp_unit_modules: Optional[Sequence[Any]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ddp_config = convert_ddp_config(ddp_config)
        self.device = device_mod.resolve_device(device)
        self.mp_policy = self.ddp_config.mixed_precision_policy()
        self.megatron_fsdp_dist_index = build_dist_index(self.ddp_config, self.device, pg_collection, config)
        if fsdp_unit_modules is None:
            fsdp_unit_modules = default_unit_modules(module, self.ddp_config.sharding_strategy)
        self.fsdp_unit_modules = list(fsdp_unit_modules)
        logger.info(
            "megatron_fsdp: FullyShardedDataParallel(%s, units=%s)",
            self.ddp_config.sharding_strategy.label,
            [getattr(c, "__name__", c) for c in self.fsdp_unit_modules] or "<whole model>",
        )
        self.module = MegatronFSDP(
            module,
            dist_index=self.megatron_fsdp_dist_index,
            ddp_config=self.ddp_config,
            mixed_precision_policy=self.mp_policy,
            fsdp_unit_modules=self.fsdp_unit_modules,
            disable_bucketing=disable_bucketing,
            device=self.device,
            calculate_per_token_loss=_config_flag(config, "calculate_per_token_loss"),
            init_model_with_meta_device=_config_flag(config, "init_model_with_meta_device"),
        )
        self.param_and_grad_buffer = self.module.param_and_grad_buffer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    # -- the data-parallel interface Megatron-LM's training loop drives -------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients of the enclosed backward passes without reducing
        them (ZeRO-2/3 still reduce-scatter each microbatch; see MegatronFSDP.no_sync)."""
        return self.module.no_sync()

    def start_grad_sync(self, *unused: Any) -> None:
        self.module.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Finish reducing gradients; afterwards ``p.grad`` of ``parameters()`` holds them.
        ``force_all_reduce`` (Megatron DDP's flag for all-reduce instead of
        reduce-scatter) has no meaning here: the strategy decides the collective."""
        self.module.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        self.module.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad_buffer()

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Refresh replicated compute weights from the updated main weights (ZeRO-1/2).
        ``force_dispatch`` is accepted for Megatron DDP compatibility and unused."""
        self.module.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self) -> None:
        self.module.finish_param_sync()

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's main weights into the compute weights (after ``step()``)."""
        self.module.install_optimized_model_weights()

    def broadcast_params(self) -> None:
        self.module.broadcast_params()

    def stop_communication(self) -> None:
        """Wait for every in-flight collective (before checkpointing or teardown)."""
        self.module.finish_param_sync()
        self.module.grad_reduce_pipeline.wait_all()

    # -- parameters ---------------------------------------------------------------------
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The distributed main weights (what the optimizer updates), named like the model's parameters."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Main weights (DTensors where sharded), persistent buffers and modules'
        extra state, keyed like the unwrapped model's ``state_dict``."""
        out = sharded_state_dict(self.module, prefix=prefix, keep_vars=keep_vars, module_prefix=False,
                                 extra_state=True)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """Load our ``state_dict()`` (same sharding) or full tensors, e.g. the state
        dict of an unwrapped model or of Megatron-core's DDP."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron-core distributed-checkpointing state dict: the wrapped model's
        own ``sharded_state_dict`` (its keys, replica ids, extra-state objects) with
        every parameter's value replaced by its main weights: whole, or this rank's
        tensor-parallel piece where Megatron-core's ``ShardedTensor`` describes one.

        The full weights are gathered (a collective over the shard and tensor-parallel
        groups, model-sized memory on every rank): Megatron-core's ``ShardedTensor``
        needs shards on a regular grid, which our flat, uneven shards are not. For
        per-rank shards use ``state_dict()`` with torch.distributed.checkpoint.
        """
        mcore.require_megatron_core("FullyShardedDataParallel.sharded_state_dict")
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        model = self.module.module
        if not hasattr(model, "sharded_state_dict"):
            raise TypeError(
                f"{type(model).__name__} has no sharded_state_dict(); it is not a Megatron-core module. "
                "Use state_dict() with torch.distributed.checkpoint instead"
            )
        full = get_full_state_dict(self.module)
        buffer = self.param_and_grad_buffer
        param_of = {id(p): (p, name) for p, name in buffer.param_names.items()}
        # Megatron-core reads its parameters' shapes: the compute ones (values replaced below).
        with self.module.compute_params_registered():
            sharded = model.sharded_state_dict(prefix, sharded_offsets, metadata)
        matched: set[str] = set()

        def with_main_weights(item: Any) -> Any:
            if isinstance(item, ShardedTensor) and id(item.data) in param_of:
                param, name = param_of[id(item.data)]
                spec = buffer.tp_spec(param)
                value = full[name] if spec is None else spec.local_of(full[name]).contiguous()
                if value.shape != item.data.shape:
                    raise NotImplementedError(
                        f"{item.key}: the local tensor {tuple(item.data.shape)} is a slice of the main weights "
                        f"{tuple(value.shape)} that megatron_fsdp does not know how to cut"
                    )
                item.data = value
                matched.add(name)
            return item

        dict_list_map_inplace(with_main_weights, sharded)
        unmatched = set(buffer.param_names.values()) - matched
        if unmatched:
            # The model put these parameters in its sharded state dict through
            # copies or views we cannot recognise: they would carry compute weights.
            logger.warning("megatron_fsdp: sharded_state_dict kept the model's own tensors for %s", sorted(unmatched))
        return sharded
