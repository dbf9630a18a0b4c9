"""``ParamAndGradBuffer``: groups a module's parameters and builds, per group, the
model-weight, main-weight and main-gradient ``DataParallelBuffer``s plus the
distributed parameters the optimizer updates.

A group is the set of parameters sharing (FSDP unit, dtype, requires_grad,
expert-ness, no_shard mark). Which buffers are sharded follows the group's strategy::

    strategy             model weights   main weights   main grads
    no_shard   (ZeRO-0)  replicated      replicated     replicated
    optim      (ZeRO-1)  replicated      sharded        replicated
    optim_grads(ZeRO-2)  replicated      sharded        sharded
    optim_grads_params   sharded         sharded        sharded

HFSDP splits each main-weight shard once more across the outer group (the
"optimizer layout"); main gradients keep the dp-shard layout, because that is what
the dp-shard reduce-scatter produces and accumulates.

The module's own parameters ("compute parameters") have their ``.data``
re-pointed into the model-weight bucket, so gathering a bucket makes every
parameter of the group usable at once with no copy. They are registered on the
module only while it runs (registered_params.py [Note: registered parameters]).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from typing import Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from .allocator import BufferAccounting, BufferPool, StorageResizeAllocator
from .data_parallel_buffer import DataParallelBuffer
from ..comm.distributed_index import DataParallelGroups, FSDPDistributedIndex
from ..enums import ShardingStrategy
from .layout import BucketLayout
from ..param_marks import is_expert_param, is_fsdp_no_shard, restore_marks
from ..mixed_precision import MixedPrecisionPolicy
from .piece_dtensor import FLAT_START_ATTR, TP_CUT_ATTR, piece_dtensor
from .tensor_parallel import TPSpec
from .units import plan_merge
from .unsynced_grad import unsynced_grad

logger = logging.getLogger(__name__)

MEGATRON_PARAM_ATTRS = (
    "allreduce", "sequence_parallel", "shared", "tensor_model_parallel", "partition_dim", "partition_stride",
    "is_embedding_or_output_parameter", "is_embedding_parameter", "_tensor_parallel_mode",
)
"""Attributes Megatron sets on parameters and reads back (expert-ness, tensor
parallelism, embeddings): copied onto the distributed twins, as upstream does."""

FSDP_PARAM_ATTR = "__fsdp_param__"
"""[Note: Megatron-core's gradient norm] How Megatron-core's optimizer recognises
Megatron-FSDP's distributed parameters (upstream marks its own so). It counts gradient
elements for its norm and zero count (``get_main_grads_for_grad_norm``,
``count_zeros_fp32``) from each parameter's local gradient: for a marked one the local
piece ``grad._local_tensor``, kept when ``param_is_not_tensor_parallel_duplicate``
(TP-split parameters on every TP rank, replicated ones on TP rank 0 only), the squares
summed over the distributed optimizer instance (or the model-parallel group without the
distributed optimizer). Our distributed parameters' pieces are disjoint over the shard
group and carry ``tensor_model_parallel``, so each element counts once. Unmarked, it
would read the DTensor gradient and ask its mesh for one data-parallel group, which a
mesh with a ``tp`` dimension (or HSDP's two dimensions) does not have. Under HFSDP
(pieces split over the outer group too) one instance holds only part of each gradient
and that sum falls short; torch's ``clip_grad_norm_`` on ``parameters()`` is exact
without any mark (DTensors over the data-parallel dimensions and ``tp``), HFSDP included."""

ROOT_UNIT = None
"""Unit id of parameters outside every FSDP unit (or shared by several units)."""


@dataclasses.dataclass(eq=False)
class ParameterGroup:
    """Parameters that live in one set of flat buffers and communicate together."""

    index: int
    unit: Optional[int]
    dtype: torch.dtype
    requires_grad: bool
    strategy: ShardingStrategy
    """The model's strategy, or NO_SHARD for parameters marked ``fsdp_no_shard``."""
    dp: DataParallelGroups
    params: list[nn.Parameter]
    names: list[str]
    layout: BucketLayout
    """dp-shard layout: model weights and main gradients."""
    optimizer_layout: BucketLayout
    """Layout of the main weights (finer than ``layout`` under HFSDP)."""
    model_weights: DataParallelBuffer
    main_weights: Optional[DataParallelBuffer]
    """``None`` when the model weights serve as main weights (``main_params_dtype=None``)."""
    main_grads: Optional[DataParallelBuffer]
    """``None`` for frozen groups."""
    dist_params: list[nn.Parameter] = dataclasses.field(default_factory=list)

    @property
    def main_weight_source(self) -> DataParallelBuffer:
        return self.main_weights if self.main_weights is not None else self.model_weights

    @property
    def hfsdp(self) -> bool:
        return self.dp.outer_shards_optimizer

    # Upstream's names for the fields above, read by Megatron-LM's DistributedOptimizer and by
    # upstream's users and tests (``parameter_groups[i].main_weight_buffer.data.dtype``).
    @property
    def fsdp_unit_id(self) -> Optional[int]:
        return self.unit

    @property
    def model_weight_buffer(self) -> DataParallelBuffer:
        return self.model_weights

    @property
    def main_weight_buffer(self) -> Optional[DataParallelBuffer]:
        return self.main_weights

    @property
    def main_grad_buffer(self) -> Optional[DataParallelBuffer]:
        return self.main_grads

    @property
    def label(self) -> str:
        where = "root" if self.unit is None else f"unit{self.unit}"
        return f"{where}/{str(self.dtype).removeprefix('torch.')}/g{self.index}"

    def cast_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's model weights, the main weights they are a local cast of): the
        shards under a sharded optimizer, the whole buffers otherwise. For groups with
        main weights that are not HFSDP (whose model shard is gathered instead)."""
        if self.strategy.shards_optimizer:
            return self.model_weights.shard, self.main_weights.shard
        return self.model_weights.data, self.main_weights.data

    def recast(self) -> None:
        """Cast this rank's model weights again from the main weights (``cast_pair``)."""
        model, main = self.cast_pair()
        model.copy_(main)

    def optimizer_piece(self, index: int) -> tuple[int, int]:
        """(start in the unsharded bucket, numel) of the part of item ``index`` this
        rank's optimizer owns."""
        if not self.strategy.shards_optimizer:
            start, end = self.layout.item_range(index)
            return start, end - start
        rank = self.dp.optimizer_rank
        overlap = self.optimizer_layout.overlap(index, rank)
        base = rank * self.optimizer_layout.shard_numel
        return (base, 0) if overlap is None else (base + overlap.shard_start, overlap.numel)

    def local_flat_start(self, index: int) -> int:
        """Where the optimizer's part of item ``index`` starts in the item's flat order."""
        start, numel = self.optimizer_piece(index)
        return start - self.layout.item_range(index)[0] if numel else 0

    def __repr__(self) -> str:
        return f"ParameterGroup({self.label}, {self.strategy.label}, params={len(self.params)}, numel={self.layout.numel})"


OUTSIDE = -1
"""The owner standing for the modules outside every unit."""


def assign_units(module: nn.Module, unit_modules: Sequence[Sequence[nn.Module]]) -> dict[nn.Parameter, Optional[int]]:
    """Map each parameter to the innermost unit that owns it (a unit is one or
    more modules).

    A unit owns the parameters of its modules' subtrees minus those of modules of
    other units nested inside. A parameter reached from two units (tied weights),
    or from a unit and a module outside every unit (an output head in a unit
    sharing the root's embedding), belongs to no unit: it is kept gathered for the
    whole step, since either user may need it at any time.
    """
    owners: dict[nn.Parameter, set[int]] = {}
    unit_of_module = {id(m): i for i, members in enumerate(unit_modules) for m in members}
    for p in _outside_units(module, unit_of_module):
        owners.setdefault(p, set()).add(OUTSIDE)
    for index, members in enumerate(unit_modules):
        for member in members:
            nested = [m for m in member.modules() if unit_of_module.get(id(m), index) != index]
            nested_params = {id(p) for m in nested for p in m.parameters()}
            for p in member.parameters():
                if id(p) not in nested_params:
                    owners.setdefault(p, set()).add(index)
    result: dict[nn.Parameter, Optional[int]] = {}
    for p in module.parameters():
        units = owners.get(p, set())
        result[p] = next(iter(units)) if len(units) == 1 and OUTSIDE not in units else ROOT_UNIT
    return result


def _outside_units(module: nn.Module, unit_of_module: dict[int, int]) -> list[nn.Parameter]:
    """Parameters registered on modules that belong to no unit."""
    found = []
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in unit_of_module:
            continue
        found.extend(p for p in m.parameters(recurse=False))
        stack.extend(m.children())
    return found


def root_owners(names: dict[nn.Parameter, str], unit_of: dict, limit: Optional[int]) -> dict[str, int]:
    """Parameters outside units are bucketed by top-level module: their gradients
    arrive at very different times (the final norm's first, the embedding's last),
    and one bucket would stay open all backward long. A communication-unit size
    merges neighbouring top-level modules up to that many elements."""
    numel: dict[str, int] = {}
    for p, name in names.items():
        if unit_of[p] is ROOT_UNIT:
            top = name.split(".")[0]
            numel[top] = numel.get(top, 0) + p.numel()
    tops = list(numel)
    return {tops[i]: run_index for run_index, run in enumerate(plan_merge([numel[t] for t in tops], limit)) for i in run}


class ParamAndGradBuffer:
    """All parameter groups of one model and their buffers."""

    def __init__(
        self,
        module: nn.Module,
        *,
        unit_modules: Sequence[Sequence[nn.Module]],
        strategy: ShardingStrategy,
        policy: MixedPrecisionPolicy,
        dist_index: FSDPDistributedIndex,
        device: torch.device,
        disable_bucketing: bool = False,
        bucket_size: Optional[int] = None,
        root_merge_limit: Optional[int] = None,
        unit_slots: Optional[dict[int, int]] = None,
        tp_specs: Optional[Mapping[nn.Parameter, TPSpec]] = None,
    ) -> None:
        """``unit_slots``: pool temporary buckets (``fsdp_double_buffer``), with unit
        weights in these slots (units.slot_plan); ``None`` allocates them per use.
        ``tp_specs``: compute parameter -> its tensor-parallel layout, for every
        parameter of a tensor-parallel model ([Note: tensor-parallel parameters])."""
        self.tp_specs: Mapping[nn.Parameter, TPSpec] = tp_specs or {}
        self.strategy = strategy
        self.root_merge_limit = root_merge_limit
        self.bucket_size = bucket_size
        self.policy = policy
        self.dist_index = dist_index
        self.device = device
        self.disable_bucketing = disable_bucketing
        self.accounting = BufferAccounting()
        self.allocator = (
            StorageResizeAllocator(self.accounting)
            if unit_slots is None
            else BufferPool(self.accounting, unit_slots)
        )
        self._compute_names: dict[nn.Parameter, str] = {p: name for name, p in module.named_parameters()}
        """Compute parameter -> name, in the module's ``named_parameters`` order."""
        self.param_names: dict[nn.Parameter, str] = dict(self._compute_names)
        """Compute *or* distributed parameter -> name: the module registers either
        (registered_params.py [Note: registered parameters]), and lookups by a parameter
        walked from the module must find both."""
        self._bucket_views: dict[nn.Parameter, torch.Tensor] = {}
        self.groups: list[ParameterGroup] = self._build_groups(module, unit_modules)
        for group in self.groups:
            self.param_names.update(zip(group.dist_params, group.names))
        self._slot = {p: (g, i) for g in self.groups for i, p in enumerate(g.params)}
        self._dist_slot = {p: (g, i) for g in self.groups for i, p in enumerate(g.dist_params)}
        self._grad_views: dict[nn.Parameter, torch.Tensor] = {}
        self._attached: dict[nn.Parameter, torch.Tensor] = {}
        """The ``.grad`` each distributed parameter was last given (to see it cleared)."""
        self._copies_to_write_back = False
        """Attached gradients include dtype-cast copies not yet written back ([Note: gradient copies])."""
        self._deferred: dict[nn.Parameter, tuple[torch.Tensor, bool]] = {}
        """Distributed parameter -> (its placeholder .grad, whether its attached gradient was
        present before) ([Note: deferred gradient sync] in unsynced_grad.py)."""

    # -- construction ----------------------------------------------------------
    def _build_groups(self, module: nn.Module, unit_modules: Sequence[Sequence[nn.Module]]) -> list[ParameterGroup]:
        unit_of = assign_units(module, unit_modules)
        root_owner = root_owners(self._compute_names, unit_of, self.root_merge_limit)
        keyed: dict[tuple, list[nn.Parameter]] = {}
        filled: dict[tuple, tuple[int, int]] = {}  # kind -> (current bucket, its numel)
        for p, name in self._compute_names.items():
            owner = root_owner[name.split(".")[0]] if unit_of[p] is ROOT_UNIT else -1
            kind = (unit_of[p], owner, p.dtype, p.requires_grad, is_expert_param(p), is_fsdp_no_shard(p))
            bucket, numel = filled.get(kind, (0, 0))
            # disable_bucketing: one group (and one collective) per parameter;
            # bucket_size: start a new bucket when this parameter would overflow it.
            if numel and (self.disable_bucketing or (self.bucket_size and numel + p.numel() > self.bucket_size)):
                bucket, numel = bucket + 1, 0
            filled[kind] = (bucket, numel + p.numel())
            keyed.setdefault(kind + (bucket,), []).append(p)
        # Root groups first (gathered once per step), then units in module order.
        first_seen = {key: i for i, key in enumerate(keyed)}
        order = sorted(keyed, key=lambda k: (-1 if k[0] is None else k[0], first_seen[k]))
        return [self._build_group(index, key, keyed[key]) for index, key in enumerate(order)]

    def _build_group(self, index: int, key: tuple, params: list[nn.Parameter]) -> ParameterGroup:
        unit, _, dtype, requires_grad, is_expert, no_shard, _ = key
        dp = self.dist_index.groups_for(is_expert)
        strategy = ShardingStrategy.NO_SHARD if no_shard else self.strategy
        numels = tuple(p.numel() for p in params)
        # Pad shards to split evenly across the outer group under HSDP too, so that
        # HSDP and HFSDP buffers compare exactly (half the main weights per rank).
        layout = BucketLayout(numels, dp.shard_size, shard_divisor=dp.outer_size)
        optimizer_layout = layout.split(dp.optimizer_parts) if strategy.shards_optimizer else layout


        def make(role: str, buf_dtype: torch.dtype, buf_layout: BucketLayout, rank: int, distributed: bool, bucket=None):
            return DataParallelBuffer(
                buf_layout,
                dtype=buf_dtype,
                device=self.device,
                group=dp.shard_group,
                rank=rank,
                is_distributed=distributed and buf_layout.world_size > 1,
                allocator=self.allocator,
                category=role,
                bucket=bucket,
            )

        slot_bucket = None
        if isinstance(self.allocator, BufferPool) and layout.world_size > 1 and strategy.shards_params:
            # Unit weights cycle through the pool's slots. Root groups are gathered
            # for every whole step: their buckets stay. Frozen groups (held until
            # backward ends) and nested units allocate per use.
            if unit is ROOT_UNIT:
                slot_bucket = self.allocator.kept_bucket(layout.padded_numel, dtype, self.device)
            elif requires_grad:
                slot_bucket = self.allocator.slot_bucket(unit, layout.padded_numel, dtype, self.device)
        model_weights = make("model_weights", dtype, layout, dp.shard_rank, strategy.shards_params, slot_bucket)
        main_weights = None
        hfsdp = dp.outer_shards_optimizer and strategy.shards_optimizer
        main_dtype = self.policy.main_params_dtype
        if main_dtype == dtype and not hfsdp:
            main_dtype = None  # the model weights already hold main-precision values
        elif main_dtype is None and hfsdp:
            main_dtype = dtype
        if main_dtype is not None:
            # HFSDP always keeps its own optimizer piece: the model-weight shard is
            # gathered from the pieces after every step.
            if hfsdp:
                main_weights = make("main_weights", main_dtype, optimizer_layout, dp.optimizer_rank, True)
            else:
                main_weights = make("main_weights", main_dtype, layout, dp.shard_rank, strategy.shards_optimizer)
        main_grads = None
        if requires_grad:
            main_grads = make("main_grads", self.policy.grads_dtype_for(dtype), layout, dp.shard_rank, strategy.shards_grads)
        group = ParameterGroup(
            index=index,
            unit=unit,
            dtype=dtype,
            requires_grad=requires_grad,
            strategy=strategy,
            dp=dp,
            params=params,
            names=[self._compute_names[p] for p in params],
            layout=layout,
            optimizer_layout=optimizer_layout,
            model_weights=model_weights,
            main_weights=main_weights,
            main_grads=main_grads,
        )
        self._fill_and_repoint(group)
        group.dist_params = [self._make_dist_param(group, i) for i in range(len(params))]
        return group

    @torch.no_grad()
    def _fill_and_repoint(self, group: ParameterGroup) -> None:
        # Views can only be cut from allocated storage; they survive its release.
        group.model_weights.allocate_bucket()
        views = [group.model_weights.item_in_bucket(i).view(p.shape) for i, p in enumerate(group.params)]
        group.model_weights.free_bucket()
        self._bucket_views.update(zip(group.params, views))
        for i, p in enumerate(group.params):
            if p.device.type != "meta":  # meta parameters are filled when materialised
                self.store_param_value(group, i, p.detach())
                self.repoint(group, i)

    def repoint(self, group: ParameterGroup, index: int) -> None:
        """From here on the compute parameter is a view of the unsharded bucket."""
        param = group.params[index]
        param.data = self._bucket_views[param]

    @torch.no_grad()
    def store_param_value(self, group: ParameterGroup, index: int, value: torch.Tensor) -> None:
        """Write a whole parameter value into the model- and main-weight buffers."""
        group.model_weights.copy_item_from(index, value)
        if group.main_weights is not None:
            start, numel = group.optimizer_piece(index)
            item_start = start - group.layout.item_range(index)[0]
            if group.main_weights.is_distributed:
                group.main_weights.global_view(start, numel).copy_(value.reshape(-1)[item_start : item_start + numel])
            else:
                group.main_weights.copy_item_from(index, value)

    def _make_dist_param(self, group: ParameterGroup, index: int) -> nn.Parameter:
        compute = group.params[index]
        local = self._optimizer_view(group, group.main_weight_source, index)
        # Replicated groups of a no_shard model are Replicate() DTensors too, as upstream's.
        value = self.as_dtensor(group, local, compute)
        dist_param = nn.Parameter(value, requires_grad=compute.requires_grad)
        # Megatron's conventions, read from the module's parameters (which between
        # steps are these: registered_params.py), as upstream's distributed parameters carry them.
        for attr in MEGATRON_PARAM_ATTRS:
            if hasattr(compute, attr):
                setattr(dist_param, attr, getattr(compute, attr))
        restore_marks(dist_param, is_fsdp_no_shard(compute))
        setattr(dist_param, FSDP_PARAM_ATTR, True)  # [Note: Megatron-core's gradient norm]
        spec = self.tp_specs.get(compute)
        tp_sharded = spec is not None and spec.sharded
        if group.strategy.shards_optimizer or tp_sharded:
            # Where the piece sits in the whole parameter, for random fills (piece_dtensor.py
            # [Note: random fills of pieces]): in its TP piece, if tensor parallel.
            start = group.local_flat_start(index) if group.strategy.shards_optimizer else 0
            setattr(dist_param, FLAT_START_ATTR, start)
            if tp_sharded:
                setattr(dist_param, TP_CUT_ATTR, (spec.placement.dim, spec.mesh.size(), spec.mesh.get_local_rank()))
        return dist_param

    def _optimizer_view(self, group: ParameterGroup, buffer: DataParallelBuffer, index: int) -> torch.Tensor:
        """What the optimizer sees of item ``index`` in ``buffer``: the whole item
        (shaped) for replicated groups, else its flat piece."""
        if not group.strategy.shards_optimizer:
            return buffer.item_in_bucket(index).view(group.params[index].shape)
        start, numel = group.optimizer_piece(index)
        return buffer.global_view(start, numel)

    def as_dtensor(self, group: ParameterGroup, local: torch.Tensor, like: torch.Tensor) -> DTensor:
        """Wrap a local piece as a DTensor with ``like``'s global shape.

        A sharded piece is a 1-D slice of the flat buffer, possibly uneven or empty:
        a ``PieceDTensor``, on which what DTensor would compute wrongly from such a
        split raises (piece_dtensor.py [Note: flat pieces]; state dicts supply real
        offsets separately: see model_state_dict.py). Replicated groups inside a sharded
        model become Replicate DTensors, so one optimizer sees one kind."""
        placements = group.dp.placements
        if not group.strategy.shards_optimizer:
            # Replicate DTensors too, as upstream's; PieceDTensor for the autograd refusal
            # (piece_dtensor.py [Note: autograd to distributed parameters]).
            placements = (Replicate(),) * group.dp.mesh.ndim
        spec = self.tp_specs.get(like)
        if spec is None:
            return piece_dtensor(local, group.dp.mesh, placements, shape=like.shape, stride=like.stride())
        # Over the data-parallel dims and tp: norms count each element once.
        return piece_dtensor(local, group.dp.mesh_with_tp, spec.with_dp(placements), shape=spec.global_shape,
                             stride=spec.global_stride)

    # -- lookups ----------------------------------------------------------------
    def slot(self, compute_param: nn.Parameter) -> tuple[ParameterGroup, int]:
        return self._slot[compute_param]

    def dist_slot(self, dist_param: nn.Parameter) -> Optional[tuple[ParameterGroup, int]]:
        return self._dist_slot.get(dist_param)

    def tp_spec(self, param: torch.Tensor) -> Optional[TPSpec]:
        """The tensor-parallel layout of a compute or distributed parameter (``None``
        without tensor parallelism, or for anything else)."""
        slot = self._dist_slot.get(param)
        return self.tp_specs.get(slot[0].params[slot[1]] if slot is not None else param)

    def local_flat_start(self, dist_param: torch.Tensor) -> int:
        """Where this rank's part of a distributed parameter starts in the parameter's flat order."""
        group, index = self._dist_slot[dist_param]
        return group.local_flat_start(index)

    def named_dist_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Distributed parameters in the module's ``named_parameters`` order."""
        for p, name in self._compute_names.items():
            group, index = self._slot[p]
            yield name, group.dist_params[index]

    @property
    def grad_groups(self) -> list[ParameterGroup]:
        return [g for g in self.groups if g.requires_grad]

    # Upstream's names: the group list, and each (compute or distributed) parameter's group index.
    @property
    def parameter_groups(self) -> list[ParameterGroup]:
        return self.groups

    @functools.cached_property
    def param_to_param_group(self) -> Mapping[nn.Parameter, int]:
        # Built once (the groups and their parameters are fixed at construction), so a
        # lookup per parameter stays linear; read-only, so a write cannot silently vanish.
        return types.MappingProxyType(
            {p: g.index for p, (g, _) in (*self._slot.items(), *self._dist_slot.items())})

    def groups_of_unit(self, unit: Optional[int]) -> list[ParameterGroup]:
        return [g for g in self.groups if g.unit == unit]

    # -- gradients for the optimizer -------------------------------------------
    def attach_grads(self, global_used: Optional[dict[ParameterGroup, torch.Tensor]] = None) -> None:
        """Point trainable distributed parameters' ``.grad`` at their reduced pieces.

        [Note: gradient presence] A parameter that no rank used since the last
        zeroing keeps ``grad=None`` unless it already had one (as in DDP and plain
        PyTorch, a zeroed-but-present gradient stays present). Views of the
        persistent main-grad buffer are built once; a dtype cast (main grads
        narrower than main weights) is made afresh."""
        self.restore_deferred()
        for group in self.grad_groups:
            used = (global_used or {}).get(group)
            for index, dist_param in enumerate(group.dist_params):
                present = dist_param in self._attached and dist_param.grad is self._attached[dist_param]
                if not present and used is not None and not bool(used[index]):
                    continue
                cached = self._grad_views.get(dist_param)
                if cached is None:
                    local = self._optimizer_view(group, group.main_grads, index)
                    if local.dtype != dist_param.dtype:
                        local = local.to(dist_param.dtype)  # the optimizer needs the main weights' dtype
                    wrapped = self.as_dtensor(group, local, group.params[index]) if isinstance(dist_param, DTensor) else local
                    if local.dtype == group.main_grads.dtype:
                        self._grad_views[dist_param] = wrapped
                    else:
                        self._copies_to_write_back = True
                    cached = wrapped
                dist_param.grad = cached
                self._attached[dist_param] = cached

    @torch.no_grad()
    def write_back_grad_copies(self) -> None:
        """[Note: gradient copies] A gradient attached as a dtype-cast copy (main grads
        narrower than the main weights) is not a view of the buffer, so in-place
        changes to it (``zero_grad(set_to_none=False)``, clipping) would not reach the
        buffer that the next backward accumulates into. Before that backward, write
        such copies back (a round trip of unchanged values is exact), as a view would
        have carried them. Once per attachment: later backwards accumulate on top."""
        if not self._copies_to_write_back:
            return
        self._copies_to_write_back = False
        for group in self.grad_groups:
            for index, dist_param in enumerate(group.dist_params):
                attached = self._attached.get(dist_param)
                if attached is None or dist_param.grad is not attached or attached.dtype == group.main_grads.dtype:
                    continue
                local = attached._local_tensor if isinstance(attached, DTensor) else attached
                self._optimizer_view(group, group.main_grads, index).copy_(local)

    @torch.no_grad()
    def zero_grad_copies(self) -> None:
        """The buffers were zeroed: so are the gradients attached as copies (views
        follow the buffer by themselves)."""
        self._copies_to_write_back = False
        for group in self.grad_groups:
            for dist_param in group.dist_params:
                attached = self._attached.get(dist_param)
                if attached is not None and dist_param.grad is attached and attached.dtype != group.main_grads.dtype:
                    attached.zero_()

    def defer_grads(self) -> None:
        """A backward ended without gradient sync: trainable distributed parameters'
        ``.grad`` becomes an ``UnsyncedGrad`` until the sync ([Note: deferred gradient sync])."""
        for group in self.grad_groups:
            for dist_param in group.dist_params:
                if not dist_param.requires_grad or dist_param in self._deferred:
                    continue
                attached = self._attached.get(dist_param)
                present = attached is not None and dist_param.grad is attached
                placeholder = unsynced_grad(dist_param)
                self._deferred[dist_param] = (placeholder, present)
                dist_param.grad = placeholder

    def restore_deferred(self) -> None:
        """Put back the ``.grad`` each placeholder stood in for (before attaching the
        synchronised gradients, or when the buffers are zeroed)."""
        for dist_param, (placeholder, present) in self._deferred.items():
            if dist_param.grad is placeholder:
                dist_param.grad = self._attached[dist_param] if present else None
        self._deferred.clear()

    def cleared_grads(self, group: ParameterGroup) -> list[int]:
        """Items whose attached ``.grad`` someone replaced or set to ``None`` since
        (``optimizer.zero_grad()``, ``model.zero_grad()``, ``p.grad = None``): their
        main gradients are to be zeroed before more accumulate. Forgets them."""
        with torch._C.DisableTorchFunctionSubclass():  # reads of .grad: no op to route
            return self._cleared_grads(group)

    def _cleared_grads(self, group: ParameterGroup) -> list[int]:
        cleared = []
        for index, dist_param in enumerate(group.dist_params):
            deferred = self._deferred.get(dist_param)
            if deferred is not None:
                if dist_param.grad is deferred[0]:
                    continue  # still accumulating towards a deferred sync
                # The user dropped the deferred gradients: what accumulated goes too.
                del self._deferred[dist_param]
                self._attached.pop(dist_param, None)
                cleared.append(index)
                continue
            attached = self._attached.get(dist_param)
            if attached is not None and dist_param.grad is not attached:
                cleared.append(index)
                del self._attached[dist_param]
        return cleared

    def has_attached_grads(self, group: ParameterGroup) -> bool:
        """Some distributed parameter of ``group`` still shows its attached gradient."""
        return any(
            (attached := self._attached.get(p)) is not None and p.grad is attached for p in group.dist_params
        )

    def detach_grads(self) -> None:
        """Forget attached gradients (the buffers were zeroed explicitly)."""
        self.restore_deferred()
        self._attached.clear()
        self._copies_to_write_back = False

    def enable_grads(self, group: ParameterGroup) -> None:
        """Give a group frozen at wrapping its main-gradient buffer (a parameter of it
        was unfrozen)."""
        dp = group.dp
        group.main_grads = DataParallelBuffer(
            group.layout,
            dtype=self.policy.grads_dtype_for(group.dtype),
            device=self.device,
            group=dp.shard_group,
            rank=dp.shard_rank,
            is_distributed=group.strategy.shards_grads and group.layout.world_size > 1,
            allocator=self.allocator,
            category="main_grads",
        )
        group.requires_grad = True

    def grad_view(self, group: ParameterGroup, index: int) -> Optional[torch.Tensor]:
        """For replicated main grads of the parameter's own dtype: the view autograd can
        accumulate into directly (as DDP's gradient_as_bucket_view)."""
        main = group.main_grads
        if main is None or group.strategy.shards_grads or main.dtype != group.dtype:
            return None
        return main.item_in_bucket(index).view(group.params[index].shape)

    # -- main -> model weights ---------------------------------------------------
    @torch.no_grad()
    def copy_main_to_model_weights(self) -> list[ParameterGroup]:
        """Cast the optimizer's updated main weights into the model-weight buffer,
        where that is a local copy. Returns the HFSDP groups, whose model-weight
        shard must instead be all-gathered from the outer group's pieces.

        Replicated model weights under a sharded optimizer (ZeRO-1/2) only receive
        this rank's shard here; the all-gather pipeline refreshes the rest.
        """
        outer_gathers = []
        for group in self.groups:
            if group.hfsdp and group.strategy.shards_optimizer:
                outer_gathers.append(group)
            elif group.main_weights is not None:
                group.recast()
        return outer_gathers
