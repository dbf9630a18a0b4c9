"""``ParamAndGradBuffer``: groups a module's parameters and builds, per group, the
model-weight, main-weight and main-gradient ``DataParallelBuffer``s plus the
distributed parameters the optimizer updates.

A group is the set of parameters sharing (FSDP unit, dtype, requires_grad,
data-parallel group). Which buffers are sharded follows the strategy::

    strategy             model weights   main weights   main grads
    no_shard   (ZeRO-0)  replicated      replicated     replicated
    optim      (ZeRO-1)  replicated      sharded        replicated
    optim_grads(ZeRO-2)  replicated      sharded        sharded
    optim_grads_params   sharded         sharded        sharded

The module's own parameters ("compute parameters") stay registered on their
modules; their ``.data`` is re-pointed into the model-weight bucket, so gathering a
bucket makes every parameter of the group usable at once with no copy.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .allocator import BufferAccounting, StorageResizeAllocator
from .buffer import DataParallelBuffer
from .distributed_index import FSDPDistributedIndex
from .enums import ShardingStrategy
from .layout import BucketLayout
from .mixed_precision import MixedPrecisionPolicy

logger = logging.getLogger(__name__)

ROOT_UNIT = None
"""Unit id of parameters outside every FSDP unit (or shared by several units)."""


@dataclasses.dataclass(eq=False)
class ParameterGroup:
    """Parameters that live in one set of flat buffers and communicate together."""

    index: int
    unit: Optional[int]
    dtype: torch.dtype
    requires_grad: bool
    params: list[nn.Parameter]
    names: list[str]
    layout: BucketLayout
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
    def label(self) -> str:
        where = "root" if self.unit is None else f"unit{self.unit}"
        return f"{where}/{str(self.dtype).removeprefix('torch.')}/g{self.index}"

    def __repr__(self) -> str:
        return f"ParameterGroup({self.label}, params={len(self.params)}, numel={self.layout.numel})"


def assign_units(module: nn.Module, unit_modules: list[nn.Module]) -> dict[nn.Parameter, Optional[int]]:
    """Map each parameter to the innermost unit that owns it.

    A unit owns the parameters of its subtree minus those of nested units. A
    parameter reached from two units (tied weights) belongs to no unit: it is kept
    gathered for the whole step, since either unit may need it at any time.
    """
    owners: dict[nn.Parameter, set[int]] = {}
    unit_ids = {id(m): i for i, m in enumerate(unit_modules)}
    for index, unit in enumerate(unit_modules):
        nested = [m for m in unit.modules() if m is not unit and id(m) in unit_ids]
        nested_params = {id(p) for m in nested for p in m.parameters()}
        for p in unit.parameters():
            if id(p) not in nested_params:
                owners.setdefault(p, set()).add(index)
    result: dict[nn.Parameter, Optional[int]] = {}
    for p in module.parameters():
        units = owners.get(p, set())
        result[p] = next(iter(units)) if len(units) == 1 else ROOT_UNIT
    return result


class ParamAndGradBuffer:
    """All parameter groups of one model and their buffers."""

    def __init__(
        self,
        module: nn.Module,
        *,
        unit_modules: list[nn.Module],
        strategy: ShardingStrategy,
        policy: MixedPrecisionPolicy,
        dist_index: FSDPDistributedIndex,
        device: torch.device,
        disable_bucketing: bool = False,
    ) -> None:
        self.strategy = strategy
        self.disable_bucketing = disable_bucketing
        self.policy = policy
        self.dist_index = dist_index
        self.device = device
        self.accounting = BufferAccounting()
        self.allocator = StorageResizeAllocator(self.accounting)
        self.param_names: dict[nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            self.param_names[p] = name
        self.groups: list[ParameterGroup] = self._build_groups(module, unit_modules)
        self._slot: dict[nn.Parameter, tuple[ParameterGroup, int]] = {
            p: (g, i) for g in self.groups for i, p in enumerate(g.params)
        }
        self._dist_slot: dict[nn.Parameter, tuple[ParameterGroup, int]] = {
            p: (g, i) for g in self.groups for i, p in enumerate(g.dist_params)
        }

    # -- construction ----------------------------------------------------------
    def _build_groups(self, module: nn.Module, unit_modules: list[nn.Module]) -> list[ParameterGroup]:
        unit_of = assign_units(module, unit_modules)
        keyed: dict[tuple, list[nn.Parameter]] = {}
        for p in self.param_names:
            # disable_bucketing: one group (and one collective) per parameter.
            key = (unit_of[p], p.dtype, p.requires_grad, len(keyed) if self.disable_bucketing else 0)
            keyed.setdefault(key, []).append(p)
        # Root groups first (gathered once per step), then units in module order.
        order = sorted(keyed, key=lambda k: (-1 if k[0] is None else k[0], not k[2], str(k[1]), k[3]))
        return [self._build_group(index, key, keyed[key]) for index, key in enumerate(order)]

    def _build_group(self, index: int, key: tuple, params: list[nn.Parameter]) -> ParameterGroup:
        unit, dtype, requires_grad, _ = key
        shard_group, rank = self.dist_index.dp_shard_group, self.dist_index.shard_rank
        layout = BucketLayout(tuple(p.numel() for p in params), self.dist_index.shard_size)

        def make(role: str, buf_dtype: torch.dtype, distributed: bool) -> DataParallelBuffer:
            return DataParallelBuffer(
                layout,
                dtype=buf_dtype,
                device=self.device,
                group=shard_group,
                rank=rank,
                is_distributed=distributed and layout.world_size > 1,
                allocator=self.allocator,
                category=role,
            )

        model_weights = make("model_weights", dtype, self.strategy.shards_params)
        main_weights = None
        if self.policy.main_params_dtype is not None:
            main_weights = make("main_weights", self.policy.main_params_dtype, self.strategy.shards_optimizer)
        main_grads = None
        if requires_grad:
            main_grads = make("main_grads", self.policy.grads_dtype_for(dtype), self.strategy.shards_grads)
        group = ParameterGroup(
            index=index,
            unit=unit,
            dtype=dtype,
            requires_grad=requires_grad,
            params=params,
            names=[self.param_names[p] for p in params],
            layout=layout,
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
        for i, p in enumerate(group.params):
            group.model_weights.copy_item_from(i, p.detach())
            if group.main_weights is not None:
                group.main_weights.copy_item_from(i, p.detach())
            # From here on the compute parameter is a view of the unsharded bucket.
            p.data = group.model_weights.item_in_bucket(i).view(p.shape)
        group.model_weights.free_bucket()

    def _make_dist_param(self, group: ParameterGroup, index: int) -> nn.Parameter:
        compute = group.params[index]
        source = group.main_weight_source
        if not self.strategy.shards_optimizer:
            local = source.item_in_bucket(index).view(compute.shape)
            return nn.Parameter(local, requires_grad=compute.requires_grad)
        return nn.Parameter(self.as_dtensor(source.item_in_shard(index), compute), requires_grad=compute.requires_grad)

    def as_dtensor(self, local: torch.Tensor, like: torch.Tensor) -> DTensor:
        """Wrap a flat local shard as a DTensor with ``like``'s global shape.

        The local part is a 1-D slice of the flat buffer, possibly uneven or empty;
        elementwise optimizer math only touches local data, so DTensor never needs
        to re-derive the split (checkpointing supplies real offsets separately).
        """
        return DTensor.from_local(
            local,
            self.dist_index.dp_shard_mesh,
            [Shard(0)],
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )

    # -- lookups ----------------------------------------------------------------
    def slot(self, compute_param: nn.Parameter) -> tuple[ParameterGroup, int]:
        return self._slot[compute_param]

    def dist_slot(self, dist_param: nn.Parameter) -> Optional[tuple[ParameterGroup, int]]:
        return self._dist_slot.get(dist_param)

    def named_dist_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Distributed parameters in the module's ``named_parameters`` order."""
        for p in self.param_names:
            group, index = self._slot[p]
            yield self.param_names[p], group.dist_params[index]

    def local_flat_start(self, dist_param: torch.Tensor) -> int:
        """Where this rank's part of a distributed parameter starts in the parameter's flat order."""
        group, index = self._dist_slot[dist_param]
        if not self.strategy.shards_optimizer:
            return 0
        overlap = group.layout.overlap(index, group.main_weight_source.rank)
        return 0 if overlap is None else overlap.item_start

    @property
    def grad_groups(self) -> list[ParameterGroup]:
        return [g for g in self.groups if g.requires_grad]

    def groups_of_unit(self, unit: Optional[int]) -> list[ParameterGroup]:
        return [g for g in self.groups if g.unit == unit]

    # -- gradients for the optimizer -------------------------------------------
    def main_grad_view(self, group: ParameterGroup, index: int) -> torch.Tensor:
        """The reduced gradient of item ``index`` as the optimizer sees it."""
        assert group.main_grads is not None
        compute = group.params[index]
        if not self.strategy.shards_optimizer:
            return group.main_grads.item_in_bucket(index).view(compute.shape)
        return self.as_dtensor(group.main_grads.item_in_shard(index), compute)

    def attach_grads(self) -> None:
        """Point every trainable distributed parameter's ``.grad`` at its reduced shard."""
        for group in self.grad_groups:
            for index, dist_param in enumerate(group.dist_params):
                grad = self.main_grad_view(group, index)
                if grad.dtype != dist_param.dtype:
                    # The optimizer needs grads in the main weights' dtype.
                    grad = grad.to(dist_param.dtype)
                dist_param.grad = grad

    # -- main -> model weights ---------------------------------------------------
    @torch.no_grad()
    def copy_main_to_model_weights(self) -> None:
        """Cast the optimizer's updated main weights into the model-weight buffer.

        Replicated model weights under a sharded optimizer (ZeRO-1/2) only receive
        this rank's shard here; the all-gather pipeline refreshes the rest.
        """
        for group in self.groups:
            if group.main_weights is None:
                continue
            if self.strategy.shards_optimizer:
                target, source = group.model_weights.shard, group.main_weights.shard
            else:
                target, source = group.model_weights.data, group.main_weights.data
            target.copy_(source)
