"""``MegatronFSDP``: the wrapper module that shards a model and runs its step."""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from . import collectives
from . import device as device_mod
from . import streams, te_compat
from . import state_dict as state_dict_mod
from .all_gather_pipeline import AllGatherPipeline
from .config import DistributedDataParallelConfig
from .distributed_index import FSDPDistributedIndex, build_default_mesh
from .enums import ShardingStrategy
from .grad_reduce_pipeline import GradReducePipeline, GradReduceOptions
from .hooks import FSDPUnit, HookRuntime
from .marks import is_fsdp_no_shard
from .meta_init import has_meta_tensors, materialize_meta_module
from .mixed_precision import MixedPrecisionPolicy
from .param_and_grad_buffer import ParamAndGradBuffer
from .units import NO_SHARD_UNIT_SIZE, UnitSpec, merge_units, slot_plan, split_into_parameter_owners

logger = logging.getLogger(__name__)

# Distributed parameter -> the MegatronFSDP that owns it (fully_shard_optimizer's lookup).
_OWNERS = WeakIdKeyDictionary()


def owner_of(param: torch.Tensor) -> Optional["MegatronFSDP"]:
    return _OWNERS.get(param)


def resolve_unit_classes(entries: Optional[Sequence[Any]]) -> tuple[type, ...]:
    """``fsdp_unit_modules`` entries are module classes or import paths of them."""
    classes = []
    for entry in entries or ():
        cls = entry
        if isinstance(entry, str):
            module_path, _, attr = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_path), attr) if module_path else None
            except (ImportError, AttributeError):
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"fsdp_unit_modules entry {entry!r} is neither an nn.Module subclass nor an importable "
                "path to one (e.g. 'torch.nn.TransformerEncoderLayer')"
            )
        classes.append(cls)
    return tuple(classes)


class MegatronFSDP(nn.Module):
    """Fully sharded data parallel wrapper in the Megatron style.

    ``parameters()`` / ``named_parameters()`` / ``state_dict()`` expose the
    *distributed* parameters (sharded main weights, DTensors when sharded), which
    is what the optimizer updates; ``self.module`` keeps its compute parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        dist_index: Optional[FSDPDistributedIndex] = None,
        ddp_config: Optional[DistributedDataParallelConfig] = None,
        mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
        fsdp_unit_modules: Optional[Sequence[Any]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = True,
        enable_fine_grained_param_gather_hook: bool = False,
        report_nan_in_param_grad: bool = False,
    ) -> None:
        super().__init__()
        self.ddp_config = ddp_config or DistributedDataParallelConfig()
        self.strategy: ShardingStrategy = self.ddp_config.sharding_strategy
        self.mp_policy = mixed_precision_policy or self.ddp_config.mixed_precision_policy()
        self.device = device_mod.resolve_device(device)
        self.dist_index = dist_index or FSDPDistributedIndex(
            build_default_mesh(device_mod.mesh_device_type(self.device)), dp_shard_dim="fsdp", tp_dim="tp"
        )
        self.calculate_per_token_loss = calculate_per_token_loss
        self.report_nan_in_param_grads = report_nan_in_param_grad
        self.last_nan_report: list[str] = []
        self._check_supported()
        _check_module(module, self.device, allow_meta=init_model_with_meta_device)
        te_compat.check_supported(module)  # before any buffer: FP8 parameters cannot be repointed
        streams.check_torch_for_device(self.device)
        self.module = module
        self._te_hooks = te_compat.prepare_fused_wgrad(module, self.mp_policy.grads_dtype_for)

        units = self._find_units(module, resolve_unit_classes(fsdp_unit_modules), enable_fine_grained_param_gather_hook)
        units, self.param_and_grad_buffer = self._build_buffer(module, units, disable_bucketing)
        buffer = self.param_and_grad_buffer
        self.init_peak_param_bytes = 0
        if init_model_with_meta_device and has_meta_tensors(module):
            self.init_peak_param_bytes = materialize_meta_module(module, buffer, self.device)
        self.all_gather_pipeline = AllGatherPipeline()
        self.grad_reduce_pipeline = GradReducePipeline(
            buffer.groups,
            policy=self.mp_policy,
            options=self._grad_options(),
            allocator=buffer.allocator,
        )
        # Per model, never process-wide (collectives: [Note: collective timeouts]).
        timeout = collectives.as_timeout(self.ddp_config.collective_timeout_s)
        self.all_gather_pipeline.timeout = self.grad_reduce_pipeline.timeout = timeout
        self.grad_reduce_pipeline.install_grad_views(
            {g.params[i]: v for g in buffer.grad_groups for i in range(len(g.params)) if (v := buffer.grad_view(g, i)) is not None}
        )
        self.units = [
            FSDPUnit(index=i, name=u.name, modules=u.modules, groups=buffer.groups_of_unit(i)) for i, u in enumerate(units)
        ]
        self._auto_sync = sync_model_each_microbatch
        self.backward_since_step = False
        """Set by every backward pass, cleared by the optimizer step (misuse check)."""
        self._no_sync_depth = 0
        self._force_sync_depth = 0
        self._runtime = HookRuntime(
            buffer=buffer,
            units=self.units,
            all_gather=self.all_gather_pipeline,
            grad_reduce=self.grad_reduce_pipeline,
            overlap_param_gather=self.ddp_config.overlap_param_gather,
            prefetch_depth=self.ddp_config.prefetch_depth,
            sync_enabled=self._sync_enabled,
            on_backward_end=self._on_backward_end,
        )
        self._runtime.register()
        for group in buffer.groups:
            for param in group.dist_params:
                _OWNERS[param] = self

    # -- construction helpers -----------------------------------------------------
    def _check_supported(self) -> None:
        cfg = self.ddp_config
        unsupported = {
            "nccl_ub=True (NCCL user-buffer registration)": cfg.nccl_ub,
            "keep_fp8_transpose_cache=True (TransformerEngine FP8 parameters)": cfg.keep_fp8_transpose_cache,
            "fp8_param_gather=True (TransformerEngine FP8 parameters)": cfg.fp8_param_gather,
        }
        for feature, requested in unsupported.items():
            if requested:
                raise NotImplementedError(f"{feature} is not implemented in this version of megatron_fsdp")

    def _find_units(
        self, module: nn.Module, classes: tuple[type, ...], fine_grained: bool
    ) -> list[tuple[str, nn.Module]]:
        if classes:
            units = [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, classes)]
            if not units:
                raise ValueError(
                    f"no module of the model is an instance of fsdp_unit_modules={[c.__name__ for c in classes]}; "
                    "name classes the model actually uses"
                )
        elif self.strategy is ShardingStrategy.NO_SHARD:
            return []
        else:
            logger.info(
                "megatron_fsdp: no fsdp_unit_modules given; the whole %s is one FSDP unit", type(module).__name__
            )
            units = [("<root>", module)]
        if fine_grained:
            units = split_into_parameter_owners(units)
        # Units whose parameters all stay replicated need no gathering hooks.
        return [(name, m) for name, m in units if not all(is_fsdp_no_shard(p) for p in m.parameters())]

    def _build_buffer(
        self, module: nn.Module, units: list[tuple[str, nn.Module]], disable_bucketing: bool
    ) -> tuple[list[UnitSpec], ParamAndGradBuffer]:
        """Merge units into communication units, then lay out every parameter group."""
        cfg = self.ddp_config
        merge_limit = cfg.suggested_communication_unit_size
        if merge_limit is None and self.strategy is ShardingStrategy.NO_SHARD:
            merge_limit = NO_SHARD_UNIT_SIZE
        specs = merge_units(units, merge_limit)
        buffer = ParamAndGradBuffer(
            module,
            unit_modules=[u.modules for u in specs],
            root_merge_limit=merge_limit,
            unit_slots=slot_plan(specs, cfg.prefetch_depth + 1) if cfg.fsdp_double_buffer else None,
            strategy=self.strategy,
            policy=self.mp_policy,
            dist_index=self.dist_index,
            device=self.device,
            disable_bucketing=disable_bucketing,
            bucket_size=cfg.bucket_size,
        )
        return specs, buffer

    def _grad_options(self) -> GradReduceOptions:
        cfg = self.ddp_config
        return GradReduceOptions(
            per_token_loss=self.calculate_per_token_loss,
            average_in_collective=cfg.average_in_collective,
            overlap=cfg.overlap_grad_reduce,
            max_inflight=cfg.max_inflight_grad_reductions,
            check_for_nan=cfg.check_for_nan_in_grad,
        )

    # -- forward ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._runtime.root_pre_forward()
        output = self.module(*args, **kwargs)
        return self._runtime.root_post_forward(output)

    # -- gradient synchronisation --------------------------------------------------
    def _sync_enabled(self) -> bool:
        return self._force_sync_depth > 0 or (self._auto_sync and self._no_sync_depth == 0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (ZeRO-0/1); ZeRO-2/3 still reduce-scatter
        every microbatch, since they hold no unsharded gradient between passes."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Force gradient synchronisation at the end of the enclosed backward."""
        self._force_sync_depth += 1
        try:
            yield
        finally:
            self._force_sync_depth -= 1

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        self._auto_sync = sync_model

    @property
    def model_auto_sync(self) -> bool:
        return self._auto_sync

    def _on_backward_end(self) -> None:
        self.backward_since_step = True
        if self._sync_enabled():
            self.finish_grad_sync()

    def start_grad_sync(self, *unused: Any) -> None:
        self.grad_reduce_pipeline.start_all()

    def finish_grad_sync(self) -> None:
        """Reduce what is left, wait for every collective, hand gradients to the optimizer."""
        self.start_grad_sync()
        self.grad_reduce_pipeline.wait_all()
        self.grad_reduce_pipeline.reduce_outer()
        self.grad_reduce_pipeline.raise_if_nonfinite()
        self.param_and_grad_buffer.attach_grads()
        if self.report_nan_in_param_grads:
            self.report_nan_in_param_grad()

    def zero_grad_buffer(self) -> None:
        self.grad_reduce_pipeline.zero()

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        self.grad_reduce_pipeline.wait_all()
        for group in self.param_and_grad_buffer.grad_groups:
            group.main_grads.data.mul_(scaling_factor)
        # Views follow the buffer; dtype-cast copies (main grads narrower than the
        # main weights) were taken before the scaling and must be taken again.
        self.param_and_grad_buffer.attach_grads()

    def report_nan_in_param_grad(self) -> list[str]:
        """Names of parameters whose reduced gradient holds NaN/Inf on this rank (logged)."""
        bad = []
        for name, dist_param in self.param_and_grad_buffer.named_dist_params():
            grad = dist_param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if not bool(torch.isfinite(local).all()):
                bad.append(name)
        if bad:
            logger.error("rank %d: NaN/Inf in the reduced gradient of %s", dist.get_rank(), ", ".join(bad))
        self.last_nan_report = bad
        return bad

    # -- mixed precision ---------------------------------------------------------------
    def reset_mixed_precision_policy(self, policy: MixedPrecisionPolicy) -> None:
        """Switch ``grad_comm_dtype`` between steps. The main dtypes size persistent
        buffers, so they are fixed at construction."""
        for field in ("main_params_dtype", "main_grads_dtype"):
            if getattr(policy, field) != getattr(self.mp_policy, field):
                raise ValueError(
                    f"{field} cannot change after construction ({getattr(self.mp_policy, field)} -> "
                    f"{getattr(policy, field)}); only grad_comm_dtype can. Re-wrap the model to change it."
                )
        self.grad_reduce_pipeline.wait_all()  # collectives in flight finish in their own dtype
        self.mp_policy = policy
        self.grad_reduce_pipeline.policy = policy

    @contextlib.contextmanager
    def mixed_precision_context(self, policy: MixedPrecisionPolicy) -> Iterator[None]:
        """Use ``policy`` (a different ``grad_comm_dtype``) inside the block."""
        previous = self.mp_policy
        self.reset_mixed_precision_policy(policy)
        try:
            yield
        finally:
            self.reset_mixed_precision_policy(previous)

    # -- parameters ---------------------------------------------------------------
    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's main weights into the model weights used for compute."""
        outer_gathers = self.param_and_grad_buffer.copy_main_to_model_weights()
        self.all_gather_pipeline.gather_outer(outer_gathers)
        stale = [
            g for g in self.param_and_grad_buffer.groups
            if g.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS)
        ]
        if stale:
            self.all_gather_pipeline.mark_stale(stale)
            self.start_param_sync()

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        """Refresh replicated model weights after a ZeRO-1/2 step (async with overlap)."""
        groups = self.param_and_grad_buffer.groups
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        self.all_gather_pipeline.unshard([g for g in groups if not g.model_weights.is_distributed], async_op=async_op)

    def finish_param_sync(self) -> None:
        self.all_gather_pipeline.wait_all()

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every replica equal to its first copy: buffers replicated inside the
        shard group from shard rank 0, then everything replicated across the outer
        group from outer rank 0 (an HFSDP main-weight piece is not a replica)."""
        self.all_gather_pipeline.wait_all()
        for g in self.param_and_grad_buffer.groups:
            for buf in (g.model_weights, g.main_weights):
                if buf is None:
                    continue
                if not buf.is_distributed:
                    collectives.broadcast(buf.data, 0, g.dp.shard_group, label=g.label)
                if g.dp.outer_group is not None and not (buf is g.main_weights and g.hfsdp):
                    collectives.broadcast(buf.data, 0, g.dp.outer_group, label=f"outer:{g.label}")

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The distributed parameters, named as in the wrapped module (no ``module.`` prefix)."""
        for name, param in self.param_and_grad_buffer.named_dist_params():
            yield prefix + name, param

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Main weights (DTensors where sharded, ready for torch.distributed.checkpoint)
        and persistent buffers, keyed like the wrapped module (no ``module.`` prefix)."""
        out = state_dict_mod.sharded_state_dict(self, prefix=prefix, keep_vars=keep_vars)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """Load DTensors of this model's sharding (as DCP fills them) or full tensors."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded buffers; use assign=False")
        return state_dict_mod.load_sharded_state_dict(self, state_dict, strict=strict)

    @property
    def buffer_accounting(self):
        return self.param_and_grad_buffer.accounting


def _is_wrapper(module: nn.Module) -> bool:
    if isinstance(module, (MegatronFSDP, torch.nn.parallel.DistributedDataParallel)):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch
        return False
    return isinstance(module, FSDPModule)


def _check_module(module: nn.Module, device: torch.device, *, allow_meta: bool = False) -> None:
    for name, sub in module.named_modules():
        if _is_wrapper(sub):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(
                f"cannot wrap {type(module).__name__}: {where} is already a data-parallel wrapper "
                f"({type(sub).__name__}); wrap the plain model once, with one of megatron_fsdp, FSDP or DDP"
            )
    params = list(module.named_parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters; there is nothing for megatron_fsdp to shard")
    for name, p in params:
        if p.device != device and not (allow_meta and p.device.type == "meta"):
            raise ValueError(
                f"parameter {name!r} is on {p.device} but megatron_fsdp was given device={device}; "
                f"move the model first (module.to({str(device)!r})) or pass device={str(p.device)!r}"
            )
        if isinstance(p, torch.distributed.tensor.DTensor):
            raise ValueError(
                f"parameter {name!r} is already a DTensor; the model seems to be sharded already "
                "(megatron_fsdp cannot wrap a module inside another FSDP wrapper)"
            )
