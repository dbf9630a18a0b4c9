"""``MegatronFSDP``: the wrapper module that shards a model and runs its step."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import types
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import collectives
from .comm import device as device_mod
from .comm import streams
from .compat import megatron_core as mcore_compat
from .compat import transformer_engine as te_compat
from .state import model_state_dict as state_dict_mod
from .runtime.all_gather_pipeline import AllGatherPipeline
from .config import DistributedDataParallelConfig, check_unimplemented
from .comm.distributed_index import FSDPDistributedIndex, build_default_mesh
from .enums import ShardingStrategy
from .runtime import grad_norm
from .runtime.grad_reduce_pipeline import GradReducePipeline, GradReduceOptions
from .runtime.hooks import FSDPUnit, HookRuntime, guard_hooks_under_compile
from .param_marks import is_fsdp_no_shard
from .runtime.init_sync import sync_initial_state, sync_module_buffers
from .runtime.meta_init import has_meta_tensors, materialize_meta_module
from .mixed_precision import MixedPrecisionPolicy
from .runtime.wrap_checks import check_module
from .runtime.wrapped_model_guards import RefusesCopies, guard_module, refuse_moves, release_module
from .runtime.owners import COMPUTE_OWNERS, OWNERS, WRAPPED
from .optimizer import guard_optimizer_steps
from .buffers.param_and_grad_buffer import ParamAndGradBuffer
from .buffers.tensor_parallel import TPKind, check_tensor_parallel, extract_tensor_parallel, restore_dtensor_params
from .runtime.registered_params import RegisteredParams
from .buffers.units import NO_SHARD_UNIT_SIZE, UnitSpec, merge_units, slot_plan, split_into_parameter_owners
from .runtime.weight_edits import WeightEdits

logger = logging.getLogger(__name__)

def resolve_unit_classes(entries: Any) -> tuple[type, ...]:
    """``fsdp_unit_modules`` entries are module classes or import paths of them; one
    class or one path alone is accepted as a list of one."""
    if entries is None:
        return ()
    if isinstance(entries, (str, type)):
        entries = [entries]
    classes = []
    for entry in entries:
        cls = entry
        if isinstance(entry, str):
            module_path, _, attr = entry.rpartition(".")
            if not module_path:
                raise ValueError(
                    f"fsdp_unit_modules entry {entry!r} is a bare class name, which cannot be imported; pass the "
                    f"class itself (fsdp_unit_modules=[{entry}]) or its full import path ('package.module.{entry}')"
                )
            try:
                cls = getattr(importlib.import_module(module_path), attr)
            except (ImportError, AttributeError):
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"fsdp_unit_modules entry {entry!r} is neither an nn.Module subclass nor an importable "
                "path to one (e.g. 'torch.nn.TransformerEncoderLayer')"
            )
        classes.append(cls)
    return tuple(classes)


def check_policy(policy: Any) -> None:
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision_policy={policy!r} is not a MixedPrecisionPolicy; pass one, e.g. "
            "MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32, "
            "grad_comm_dtype=torch.bfloat16); the compute dtype is the model's own (model.to(torch.bfloat16))"
        )


_UNIMPLEMENTED_INIT_OPTIONS = {
    "enable_fine_grained_param_gather_backward_hook": (False, "backward-only fine-grained gathering is not implemented"),
    "fine_grained_recurse_module_types": (None, "fine-grained gathering splits every parameter-owning module"),
}


def _default_ddp_config(**upstream_fields: Any) -> DistributedDataParallelConfig:
    """The config ``MegatronFSDP(ddp_config=None)`` uses: ZeRO-3 with overlap, as upstream's."""
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        **upstream_fields,
    )


_EVERY_PARTIAL_TP_RULE = types.SimpleNamespace(sequence_parallel=True, qk_layernorm=True)


class MegatronFSDP(RefusesCopies, nn.Module):
    """Fully sharded data parallel wrapper in the Megatron style.

    ``parameters()`` / ``named_parameters()`` / ``state_dict()`` expose the
    *distributed* parameters (sharded main weights, DTensors when sharded), which
    is what the optimizer updates. Between steps ``self.module`` has the same
    parameters registered; its compute parameters only while it runs
    (registered_params.py [Note: registered parameters]).
    """

    def __init__(
        self,
        module: nn.Module,
        dist_index: Optional[FSDPDistributedIndex] = None,
        ddp_config: Optional[DistributedDataParallelConfig] = None,
        mixed_precision_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        fsdp_unit_modules: Optional[Sequence[Any]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        # Upstream's class default (fully_shard's is True): gradients are finished by
        # finish_grad_sync(), which Megatron-LM's loop and fully_shard_optimizer's step call.
        sync_model_each_microbatch: bool = False,
        keep_fp8_transpose_cache: bool = False,
        nccl_ub: bool = False,
        fsdp_double_buffer: bool = False,
        fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
        disable_symmetric_registration: bool = False,
        enable_fine_grained_param_gather_hook: bool = False,
        enable_fine_grained_param_gather_backward_hook: bool = False,
        fine_grained_recurse_module_types: Optional[Sequence[type]] = None,
        report_nan_in_param_grad: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        """Upstream's signature, plus ``broadcast_buffers``: as DDP's option of that
        name, the module's buffers (BatchNorm running statistics) are broadcast from
        the first data-parallel rank at the start of each forward that follows a
        training forward, so every rank holds rank 0's buffers.
        ``keep_fp8_transpose_cache`` ... ``disable_symmetric_registration`` only
        matter without a ``ddp_config`` (they fill the default one, as upstream's do)."""
        super().__init__()
        check_unimplemented(
            {
                "enable_fine_grained_param_gather_backward_hook": enable_fine_grained_param_gather_backward_hook,
                "fine_grained_recurse_module_types": fine_grained_recurse_module_types,
            },
            _UNIMPLEMENTED_INIT_OPTIONS,
            where="MegatronFSDP",
        )
        self.ddp_config = ddp_config or _default_ddp_config(
            keep_fp8_transpose_cache=keep_fp8_transpose_cache,
            nccl_ub=nccl_ub,
            fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
            fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
            disable_symmetric_registration=disable_symmetric_registration,
        )
        enable_fine_grained_param_gather_hook = (
            enable_fine_grained_param_gather_hook or self.ddp_config.megatron_fsdp_enable_fine_grained_param_gather
        )
        self.strategy: ShardingStrategy = self.ddp_config.sharding_strategy
        # As upstream's class: the policy given (default: fp32 main weights), never
        # ddp_config's megatron_fsdp_*_dtype fields, which Megatron-core's adapter
        # (FullyShardedDataParallel) turns into the policy it passes.
        check_policy(mixed_precision_policy)
        self.mp_policy = mixed_precision_policy
        self.device = device_mod.resolve_device(device)
        self.dist_index = dist_index or FSDPDistributedIndex(
            build_default_mesh(device_mod.mesh_device_type(self.device)), dp_shard_dim="fsdp", tp_dim="tp"
        )
        self.calculate_per_token_loss = calculate_per_token_loss
        self.report_nan_in_param_grads = report_nan_in_param_grad
        self.last_nan_report: list[str] = []
        self._admit(module, allow_meta=init_model_with_meta_device)
        partial_tp_grads = self._take_tensor_parallel(module)
        self.module = module
        self._te_hooks = te_compat.prepare_fused_wgrad(module, self.mp_policy.grads_dtype_for)
        WRAPPED[module] = self

        units = self._find_units(module, resolve_unit_classes(fsdp_unit_modules), enable_fine_grained_param_gather_hook)
        units, self.param_and_grad_buffer = self._build_buffer(module, units, disable_bucketing)
        buffer = self.param_and_grad_buffer
        self.init_peak_param_bytes = 0
        if init_model_with_meta_device and has_meta_tensors(module):
            self.init_peak_param_bytes = materialize_meta_module(module, buffer, self.device)
        self._start_runtime(units, sync_model_each_microbatch=sync_model_each_microbatch,
                            broadcast_buffers=broadcast_buffers)
        self._tp_grad_hooks = mcore_compat.reduce_partial_tp_grads(
            self, partial_tp_grads, self.dist_index.tp_mesh.get_group()) if partial_tp_grads else []
        guard_module(module)  # copies, pickles and moves of the wrapped module raise from here on

    def _apply(self, fn, recurse: bool = True) -> "MegatronFSDP":
        # model.to() / .cuda() / .half(): wrapped_model_guards.py.
        return refuse_moves(self, fn)

    # -- construction helpers -----------------------------------------------------
    def _start_runtime(self, units, *, sync_model_each_microbatch: bool, broadcast_buffers: bool) -> None:
        """Pipelines, unit hooks and ownership maps over the built buffer; ends with the
        distributed parameters registered ([Note: registered parameters])."""
        buffer = self.param_and_grad_buffer
        self.all_gather_pipeline = AllGatherPipeline()
        self.grad_reduce_pipeline = GradReducePipeline(
            buffer.groups,
            policy=self.mp_policy,
            options=self._grad_options(),
            allocator=buffer.allocator,
            comm_streams=streams.CommStreams(self.device),
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
        guard_hooks_under_compile()
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
            on_backward_start=self._on_backward_start,
            on_backward_end=self._on_backward_end,
            root_dp_group=self.dist_index.groups_for(False).shard_group,
            params_registered=lambda: self._registered.compute_registered,
        )
        self._runtime.register()
        for group in buffer.groups:
            for param in group.dist_params:
                OWNERS[param] = self
            for param in group.params:
                COMPUTE_OWNERS[param] = self
        guard_optimizer_steps(self)  # [Note: step checks]: every optimizer's step, from now on
        self._requires_grad = {p: p.requires_grad for g in buffer.groups for p in g.params}
        """Compute parameter -> requires_grad as last synchronised with its distributed twin."""
        self._edits = WeightEdits(buffer, self.all_gather_pipeline, self.dist_index, self.grad_reduce_pipeline)
        self._edits.snapshot()
        self.broadcast_buffers = broadcast_buffers
        self._buffers_need_sync = True
        self._registered = RegisteredParams(
            self.module, {c: d for g in buffer.groups for c, d in zip(g.params, g.dist_params)},
            views={p: spec.module_view for p, spec in self._tp_specs.items() if spec.kind is TPKind.DTENSOR},
        )
        self._registered.register_dist()

    def _admit(self, module: nn.Module, *, allow_meta: bool) -> None:
        """Every refusal before any buffer exists, then the initial state of every rank
        made data-parallel rank 0's ([Note: initial state from data-parallel rank 0]), as
        DDP at construction."""
        self._check_supported()
        check_module(module, self.device, allow_meta=allow_meta, wrapper_types=(MegatronFSDP,))
        check_tensor_parallel(module, self.dist_index.tp_mesh)
        te_compat.check_supported(module)  # before any buffer: FP8 parameters cannot be repointed
        streams.check_torch_for_device(self.device)
        sync_initial_state(module, self.dist_index, collectives.as_timeout(self.ddp_config.collective_timeout_s))

    def _take_tensor_parallel(self, module: nn.Module) -> dict:
        """buffers/tensor_parallel.py [Note: tensor-parallel parameters]: a TP plan's DTensor
        parameters become plain local ones (``replaced_params``), each parameter gets its
        ``TPSpec``; returns the partial TP gradients to complete (read before wrapping: the
        marks are the module's parameters')."""
        partial_tp_grads = self._partial_tp_grad_ops(module)
        self.replaced_params: dict[int, nn.Parameter] = {}
        """id(a DTensor parameter of a TP plan) -> the plain parameter that replaced it."""
        self._tp_specs = extract_tensor_parallel(module, self.dist_index.tp_mesh, self.replaced_params)
        return partial_tp_grads

    def _partial_tp_grad_ops(self, module: nn.Module) -> dict:
        """Megatron-core's tensor-parallel layers leave some replicated parameters' gradients
        partial over TP (compat/megatron_core.py [Note: tensor-parallel partial gradients]):
        their names and reductions, completed by hooks whatever the entry point. The rule
        with every switch on: megatron-core marks a parameter ``sequence_parallel`` only
        under sequence parallelism and names q/k layer norms only when it builds them."""
        if self.dist_index.tp_size <= 1 or not any(getattr(p, "tensor_model_parallel", False)
                                                  for p in module.parameters()):
            return {}
        mcore_compat.check_tp_marks(module)
        return mcore_compat.partial_tp_grad_ops(module, _EVERY_PARTIAL_TP_RULE)

    def _check_supported(self) -> None:
        cfg = self.ddp_config
        unsupported = {
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
            tp_specs=self._tp_specs,
        )
        return specs, buffer

    def _grad_options(self) -> GradReduceOptions:
        cfg = self.ddp_config
        return GradReduceOptions(
            per_token_loss=self.calculate_per_token_loss,
            average_in_collective=cfg.average_in_collective,
            overlap=cfg.overlap_grad_reduce,
            max_inflight=cfg.max_inflight_grad_reductions,
            # Upstream's report_nan_in_param_grad raises on a NaN/Inf gradient too (during
            # backward, on the rank that has it, stranding the others in their next
            # collective); here both raise on every rank once the reductions are done.
            check_for_nan=cfg.check_for_nan_in_grad or self.report_nan_in_param_grads,
        )

    # -- forward ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        try:
            output = self.module(*args, **kwargs)
        finally:
            self._registered.register_dist()
        return self._runtime.root_post_forward(output)

    @torch.compiler.disable
    def _before_forward(self) -> None:
        """The wrapper's bookkeeping, run eagerly under torch.compile (hooks.py [Note: hooks
        under torch.compile]): traced, it guarded on every parameter's id and recompiled
        for every model."""
        self._registered.check_swappable()  # refusals before any collective (registered_params.py)
        self._sync_requires_grad()
        self._edits.refresh()
        if self.broadcast_buffers and self._buffers_need_sync:
            sync_module_buffers(self.module, self.dist_index, self.grad_reduce_pipeline.timeout)
        # As DDP: a forward that will sync gradients makes the next forward sync buffers.
        self._buffers_need_sync = torch.is_grad_enabled() and self._sync_enabled()
        self._runtime.root_pre_forward()
        # [Note: registered parameters]: the module's code reads compute weights.
        self._registered.register_compute(checked=True)

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

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """PyTorch FSDP2's spelling of ``set_model_auto_sync``: ``False`` accumulates
        the following backwards locally (as ``no_sync``) until it is set back to
        ``True``, whose next backward reduces everything. One wrapper holds every
        parameter here, so ``recurse`` changes nothing."""
        self.set_model_auto_sync(requires_gradient_sync)

    @property
    def model_auto_sync(self) -> bool:
        return self._auto_sync

    def _on_backward_start(self) -> None:
        """Before gradients accumulate: zero what the user cleared (``optimizer.zero_grad()``,
        ``model.zero_grad()``, ``p.grad = None``), rebase what holds a reduced value."""
        # Recomputed forwards inside backward read compute weights ([Note: registered parameters]).
        self._registered.register_compute()
        buffer = self.param_and_grad_buffer
        buffer.write_back_grad_copies()
        for group in buffer.grad_groups:
            cleared = buffer.cleared_grads(group)
            if cleared:
                self.grad_reduce_pipeline.zero(group, cleared, reducing=True)
        self.grad_reduce_pipeline.begin_backward()

    def _on_backward_end(self) -> None:
        self._registered.register_dist()
        self.backward_since_step = True
        if self._sync_enabled():
            self.finish_grad_sync()
        else:
            self.param_and_grad_buffer.defer_grads()

    def start_grad_sync(self, *unused: Any) -> None:
        self.grad_reduce_pipeline.start_all()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Reduce what is left, wait for every collective, hand gradients to the optimizer.
        ``force_all_reduce`` is accepted and unused, as upstream's (Megatron-LM's
        ``finalize_model_grads`` passes it for DDP's sake)."""
        self.synchronize_gradient_reduce()
        self.attach_grad_to_optimizer_state()

    def synchronize_gradient_reduce(self) -> None:
        """Launch the gradient reductions not yet launched and wait for all of them,
        the outer (HSDP) ones included; ``attach_grad_to_optimizer_state`` then hands
        the gradients over (upstream's two halves of ``finish_grad_sync``)."""
        self.start_grad_sync()
        self.grad_reduce_pipeline.wait_all()
        self.grad_reduce_pipeline.reduce_outer()

    def attach_grad_to_optimizer_state(self) -> None:
        """After ``synchronize_gradient_reduce``: the NaN check (when on), then the
        reduced gradients become the distributed parameters' ``.grad``. Collective."""
        self.grad_reduce_pipeline.raise_if_nonfinite()
        self.grad_reduce_pipeline.sync_usage()
        self.param_and_grad_buffer.attach_grads(self.grad_reduce_pipeline.global_used)

    def zero_grad_buffer(self) -> None:
        self._zero_buffers(grads_stay_attached=True)

    def _zero_buffers(self, *, grads_stay_attached: bool) -> None:
        buffer = self.param_and_grad_buffer
        self.grad_reduce_pipeline.zero()
        buffer.restore_deferred()
        buffer.zero_grad_copies()
        if grads_stay_attached:
            for group in buffer.grad_groups:
                if buffer.has_attached_grads(group):  # [Note: zeroed gradients that stay attached]
                    self.grad_reduce_pipeline.zeroed_with_grads_attached(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``optimizer.zero_grad()``: the distributed parameters' gradients and the
        gradient buffers behind them."""
        self.param_and_grad_buffer.restore_deferred()
        super().zero_grad(set_to_none=set_to_none)
        self._zero_buffers(grads_stay_attached=not set_to_none)
        if set_to_none:
            self.param_and_grad_buffer.detach_grads()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the gradients of this model's parameters to a total norm of ``max_norm``
        and return the total norm before clipping (a device tensor, the same on every
        rank), as FSDP1's method of this name. Equal to torch's ``clip_grad_norm_`` of the
        unwrapped model for every layout, also where torch's cannot run: parameters on
        several meshes, experts spread over expert-parallel ranks
        ([Note: the norm under expert parallelism])."""
        experts = None
        index = self.dist_index
        if index.expt_parallel_group is not None:
            groups = index.groups_for(True)
            experts = (groups.mesh, index.expt_parallel_group)
            if groups.mesh_with_tp is not None:
                raise NotImplementedError("clip_grad_norm_ of experts spread over expert-parallel ranks and split by "
                                          "tensor parallelism is not supported; use expert tensor-parallel size 1")
        return grad_norm.clip_grad_norm(self.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                                        expert_mesh_group=experts, foreach=foreach)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.grad_reduce_pipeline.wait_all()
        for group in self.param_and_grad_buffer.grad_groups:
            group.main_grads.data.mul_(scaling_factor)
        # Views follow the buffer; dtype-cast copies (main grads narrower than the
        # main weights) were taken before the scaling and must be taken again.
        self.param_and_grad_buffer.attach_grads(self.grad_reduce_pipeline.global_used)

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
    def reset_mixed_precision_policy(self, mixed_precision_policy: MixedPrecisionPolicy) -> None:
        """Take ``grad_comm_dtype`` from ``mixed_precision_policy`` between steps.

        As upstream, the main dtypes stay those of construction (they size persistent
        buffers): the policy's ``main_params_dtype`` / ``main_grads_dtype`` are not
        read (a ``MixedPrecisionPolicy(grad_comm_dtype=...)`` carries their defaults).
        Upstream 0.6.1 takes the new ``grad_comm_dtype`` only with ``nccl_ub`` or
        ``fsdp_double_buffer``, against its own comment, and otherwise keeps the old
        one; here it always takes effect."""
        check_policy(mixed_precision_policy)
        policy = dataclasses.replace(self.mp_policy, grad_comm_dtype=mixed_precision_policy.grad_comm_dtype)
        self.grad_reduce_pipeline.wait_all()  # collectives in flight finish in their own dtype
        self.mp_policy = policy
        self.grad_reduce_pipeline.policy = policy

    @contextlib.contextmanager
    def mixed_precision_context(self, mixed_precision_policy: MixedPrecisionPolicy) -> Iterator[None]:
        """Use ``mixed_precision_policy``'s ``grad_comm_dtype`` inside the block."""
        previous = self.mp_policy
        self.reset_mixed_precision_policy(mixed_precision_policy)
        try:
            yield
        finally:
            self.reset_mixed_precision_policy(previous)

    # -- parameters ---------------------------------------------------------------
    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's main weights into the model weights used for compute."""
        # Sharded groups still gathered (the root's, kept across no_sync micro batches:
        # hooks.py [Note: root groups across micro batches]) now hold old weights.
        self.all_gather_pipeline.reshard(self.param_and_grad_buffer.groups)
        outer_gathers = self.param_and_grad_buffer.copy_main_to_model_weights()
        self.all_gather_pipeline.gather_outer(outer_gathers)
        stale = [
            g for g in self.param_and_grad_buffer.groups
            if g.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS)
        ]
        if stale:
            self.all_gather_pipeline.mark_stale(stale)
            self.start_param_sync()
        self._edits.snapshot()

    # -- user changes between steps ---------------------------------------------------
    def _sync_requires_grad(self) -> None:
        """``requires_grad`` set on either twin (between steps the module's parameters
        are the distributed ones; a reference taken before wrapping is the compute
        one) since the last forward applies to both; a group frozen at wrapping gets
        gradient buffers once a parameter of it is unfrozen."""
        for group in self.param_and_grad_buffer.groups:
            changed = []
            with torch._C.DisableTorchFunctionSubclass():  # flag reads: no op to route
                flags = [(d.requires_grad, c.requires_grad) for c, d in zip(group.params, group.dist_params)]
            for compute, dist_param, (dist_flag, compute_flag) in zip(group.params, group.dist_params, flags):
                last = self._requires_grad[compute]
                if dist_flag != last:
                    value = dist_flag
                elif compute_flag != last:
                    value = compute_flag
                else:
                    continue
                self._requires_grad[compute] = value
                compute.requires_grad_(value)
                dist_param.requires_grad_(value)
                changed.append((compute, value))
            # After the whole group is updated: gradient hooks need requires_grad set.
            if group.main_grads is None and any(value for _, value in changed):
                self._enable_grads(group)
            elif any(value for _, value in changed):
                self._runtime.register_grad_hooks(group)  # a frozen group's later-unfrozen parameters
            for compute, value in changed:
                view = self.grad_reduce_pipeline.grad_view_of(compute)
                compute.grad = view if value else None

    def _enable_grads(self, group) -> None:
        buffer = self.param_and_grad_buffer
        buffer.enable_grads(group)
        self.grad_reduce_pipeline.add_group(group)
        self.grad_reduce_pipeline.install_grad_views(
            {p: v for i, p in enumerate(group.params) if (v := buffer.grad_view(group, i)) is not None}
        )
        self._runtime.register_grad_hooks(group)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Refresh replicated model weights after a ZeRO-1/2 step (async with overlap).
        ``force_dispatch`` is accepted and unused, as in upstream 0.6.1."""
        groups = self.param_and_grad_buffer.groups
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        self.all_gather_pipeline.unshard([g for g in groups if not g.model_weights.is_distributed], async_op=async_op)

    def finish_param_sync(self) -> None:
        """Wait for the weight refresh of the last step; also brings in-place edits of
        ``model.parameters()`` made since into the compute weights (collective)."""
        self.all_gather_pipeline.wait_all()
        self._edits.refresh()

    def check_distributed_params(self) -> None:
        """Refuse, before an optimizer step changes anything, distributed parameters
        whose ``.data`` was assigned or that carry a post-accumulate hook (registered_params.py)."""
        self._registered.check_distributed()

    def settle_weights_for_reading(self) -> None:
        """Before weights are read outside the step (state dicts, export): wait for the
        weight refresh in flight and bring in in-place edits made since the step, so
        every rank reads the edited values (without it, ZeRO-1/2 would hand out stale
        replicas of other ranks' shards, different on each rank). The next forward
        still checks for edits: more may follow the read. Collective."""
        self.all_gather_pipeline.wait_all()
        self._edits.refresh(keep_armed=True)

    def synchronize_param_gather(self) -> None:
        """Wait for every weight all-gather in flight (Megatron-LM's schedules call it
        before evaluation and checkpointing)."""
        self.all_gather_pipeline.wait_all()

    def get_distributed_index(self) -> FSDPDistributedIndex:
        """The process groups and device meshes this model uses."""
        return self.dist_index

    def all_gather_and_wait_parameters_ready(
        self, params: Any, prefetch: bool = True, prefetch_order: Any = None, wait_bucket_ready: bool = True,
        bwd: bool = False,
    ) -> None:
        raise NotImplementedError(
            "MegatronFSDP.all_gather_and_wait_parameters_ready is upstream's internal step of its forward hooks; "
            "here the forward gathers each unit itself. To read full weights use "
            "megatron_fsdp.get_full_state_dict(model) or model.unshard_module()"
        )

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

    def __getattr__(self, name: str) -> Any:
        """What the wrapper lacks comes from the wrapped module (as with FSDP1), so
        that ``named_parameters()`` names (``inp.weight``, no ``module.``) resolve
        from the wrapper: torch's ``get_optimizer_state_dict`` walks them so."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The distributed parameters, named as in the wrapped module (no ``module.`` prefix).

        [Note: two names under DCP's state_dict API] ``recurse=False`` yields them
        too. torch.distributed.checkpoint.state_dict names the optimizer's state by
        ``named_parameters()`` (no prefix) but finds parameters by walking modules
        (``module.<name>``, as ``model.state_dict()`` keys them); the walk asks each
        module for ``named_parameters(recurse=False)``, so it now finds every
        parameter under both names and pairs the optimizer state saved under one
        with the parameter it walked to under the other (``set_optimizer_state_dict``
        looked for ``module.<name>`` and refused the checkpoint)."""
        for name, param in self.param_and_grad_buffer.named_dist_params():
            yield prefix + name, param

    @property
    def keeps_extra_state(self) -> bool:
        """[Note: extra state] Whether ``state_dict()`` holds the modules' extra state
        (``<name>._extra_state``, e.g. TransformerEngine's FP8 metadata). As upstream:
        yes, unless ``fully_shard``'s ``preproc_state_dict_for_dcp_ckpt`` (on by default)
        drops it under a sharded strategy. Loading sets any extra state it is given."""
        preproc = getattr(self, "preproc_state_dict_for_dcp_ckpt", False)
        return not (preproc and self.strategy is not ShardingStrategy.NO_SHARD)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Main weights (standard DTensors where sharded, see model_state_dict.py),
        persistent buffers and modules' extra state ([Note: extra state]), keyed
        ``module.<name>`` as upstream's. Collective."""
        out = state_dict_mod.sharded_state_dict(self, prefix=prefix, keep_vars=keep_vars,
                                                extra_state=self.keeps_extra_state)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """Load DTensors (any layout) or full tensors, keyed ``module.<name>`` or ``<name>``. Collective."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded buffers; use assign=False")
        return state_dict_mod.load_sharded_state_dict(self, state_dict, strict=strict)

    @contextlib.contextmanager
    def compute_params_registered(self) -> Iterator[nn.Module]:
        """``self.module`` with its compute parameters registered, for code that needs
        the parameters' identity, shape and dtype (Megatron-core's
        ``sharded_state_dict``) rather than values: under ZeRO-3 their storage is
        released between steps, so read no value inside (use ``unshard_module()``
        or ``get_full_state_dict`` for values). Nests inside a forward or backward,
        whose registration it leaves as it found it."""
        if self._registered.compute_registered:
            yield self.module
            return
        self._registered.register_compute()
        try:
            yield self.module
        finally:
            self._registered.register_dist()

    @torch.no_grad()
    def unshard_module(self) -> nn.Module:
        """Undo the wrapping: the module gets back plain parameters holding their full
        values, without hooks (``fully_shard`` calls this when building the optimizer
        fails, so that it is all or nothing). Collective."""
        self._runtime.remove()
        self._registered.register_compute()
        self._registered.release()
        self.all_gather_pipeline.wait_all()
        self.grad_reduce_pipeline.wait_all()
        for group in self.param_and_grad_buffer.groups:
            self.all_gather_pipeline.unshard_and_wait([group])
            for index, param in enumerate(group.params):
                param.data = param.data.clone()
                param.grad = None
                COMPUTE_OWNERS.pop(param)
            for dist_param in group.dist_params:
                OWNERS.pop(dist_param)
            self.all_gather_pipeline.reshard([group])
        WRAPPED.pop(self.module)
        release_module(self.module)
        restore_dtensor_params(self.module, self._tp_specs)
        return self.module

    @property
    def buffer_accounting(self):
        return self.param_and_grad_buffer.accounting
