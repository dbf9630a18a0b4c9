"""``DistributedDataParallelConfig``: the Megatron-style knobs, validated once.

Field names follow Megatron-core's config of the same name, so either object can
be handed to ``FullyShardedDataParallel``. The strategy fields keep the user's
spelling for compatibility; code reads the parsed enums (``sharding_strategy``,
``outer_sharding_strategy``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional, Union

import torch

from .enums import ShardingStrategy
from .mixed_precision import MixedPrecisionPolicy, parse_dtype

DtypeLike = Union[torch.dtype, str, None]


@dataclasses.dataclass
class DistributedDataParallelConfig:
    """Configuration of data-parallel training with Megatron-FSDP.

    Upstream's fields come first, in upstream's order, so positional arguments mean
    the same; upstream options this engine does not implement are accepted at their
    default and any other value raises ``NotImplementedError`` naming the option
    (``UNIMPLEMENTED_OPTIONS``); NCCL allocation/registration options that change no
    value are accepted with a warning (``PERFORMANCE_ONLY_OPTIONS``)."""

    # -- upstream's fields, in upstream's order ----------------------------------------
    overlap_grad_reduce: bool = False
    """Reduce a bucket's gradients as soon as they are ready, during backward
    (default off, as upstream's config; ``fully_shard_model`` turns it on)."""
    overlap_param_gather: bool = False
    """Gather the next unit's weights while the current one computes (default off, as upstream's config)."""
    check_for_nan_in_grad: bool = False
    """Raise on every rank, after the gradient collectives and before the optimizer
    step, when a local gradient held NaN/Inf (nan_check.py)."""
    bucket_size: Optional[int] = None
    """Most elements per bucket: a unit's parameter group larger than this is split
    into several buckets (a parameter is never split). ``None``: one bucket per group."""
    average_in_collective: bool = False
    """Average with ``ReduceOp.AVG`` inside the collective instead of pre-scaling."""
    fp8_param_gather: bool = False
    data_parallel_sharding_strategy: Union[str, int] = "no_shard"
    """ZeRO level inside the shard group: no_shard, optim, optim_grads, optim_grads_params (0-3).
    The default is upstream's (``no_shard``); ``MegatronFSDP(ddp_config=None)`` and
    ``fully_shard_model`` default to ``optim_grads_params``, as upstream's do."""
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    """Group consecutive small units into one collective of about this many elements."""
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    """NCCL user-buffer registration (CUDA only)."""
    fsdp_double_buffer: bool = False
    """Reuse two fixed unsharded buckets per dtype instead of allocating per unit."""
    fsdp_all_gather_in_start_param_sync: bool = True
    """Upstream: all-gather in the first parameter sync. Here ``start_param_sync``
    always all-gathers, so only ``True`` is meaningful."""
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """Upstream: fall back to persistent buffers when a bucket misses the double buffer (NCCL UB)."""
    outer_dp_sharding_strategy: Union[str, int] = "no_shard"
    """HSDP outer group: no_shard (replicate) or optim (HFSDP: shard optimizer state too)."""
    disable_symmetric_registration: bool = False
    """Upstream: NCCL user-buffer window registration switch (CUDA only)."""
    fsdp_manual_registration: bool = False
    """Upstream: register NCCL user buffers manually (CUDA only)."""
    megatron_fsdp_main_params_dtype: DtypeLike = torch.float32
    megatron_fsdp_main_grads_dtype: DtypeLike = None
    megatron_fsdp_grad_comm_dtype: DtypeLike = None
    megatron_fsdp_use_decoupled_grad: bool = False
    """Upstream: hand main gradients to precision-aware optimizers as ``decoupled_grad``."""
    megatron_fsdp_cuda_graph_mode: bool = False
    """Upstream: CUDA-graph-safe gradient references."""
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    """Gather each parameter-owning module on its own (more, smaller all-gathers);
    the same as ``fully_shard_model(enable_fine_grained_param_gather=True)``."""
    megatron_fsdp_max_pool_double_buffer: bool = False
    """Upstream: a max-size recycled double-buffer pool for asymmetric units."""

    # -- this engine's own fields -------------------------------------------------------
    num_distributed_optimizer_instances: int = 1
    """Megatron's name for the outer (replica) group size under HFSDP."""
    use_megatron_fsdp: bool = True
    use_distributed_optimizer: bool = True
    grad_reduce_in_fp32: bool = False
    """Deprecated alias of ``megatron_fsdp_main_grads_dtype='fp32'``."""
    preserve_fp32_weights: bool = True
    """Deprecated alias: ``False`` means ``megatron_fsdp_main_params_dtype='auto'``."""
    prefetch_depth: int = 1
    """How many units ahead the all-gather pipeline prefetches."""
    max_inflight_grad_reductions: int = 1
    """Asynchronous gradient reductions in flight at once (bounds temporary memory)."""
    collective_timeout_s: Optional[float] = None
    """Seconds a collective may block before it fails (None: the process group's)."""

    def __post_init__(self) -> None:
        check_unimplemented(self, UNIMPLEMENTED_OPTIONS, where="DistributedDataParallelConfig")
        warn_performance_only(self, PERFORMANCE_ONLY_OPTIONS, where="DistributedDataParallelConfig")
        self.sharding_strategy = ShardingStrategy.parse(
            self.data_parallel_sharding_strategy, arg_name="data_parallel_sharding_strategy"
        )
        self.outer_sharding_strategy = ShardingStrategy.parse(
            self.outer_dp_sharding_strategy,
            arg_name="outer_dp_sharding_strategy",
            allowed=(ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM),
        )
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError(
                f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances} must be >= 1"
            )
        if self.max_inflight_grad_reductions < 1:
            raise ValueError(
                f"max_inflight_grad_reductions={self.max_inflight_grad_reductions} must be >= 1"
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be >= 0 (0 disables prefetching)")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"bucket_size={self.bucket_size} must be a positive number of elements (or None)")
        if self.suggested_communication_unit_size is not None and self.suggested_communication_unit_size <= 0:
            raise ValueError(
                f"suggested_communication_unit_size={self.suggested_communication_unit_size} must be positive"
            )
        self.mixed_precision_policy()  # validate the dtype fields now, not at first use

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The single mapping from Megatron's dtype flags to ``MixedPrecisionPolicy``."""
        return mixed_precision_policy_from(self)


UNIMPLEMENTED_OPTIONS: dict[str, tuple[Any, str]] = {
    # name: (the only accepted value, why)
    "fsdp_all_gather_in_start_param_sync": (True, "start_param_sync always all-gathers here"),
    "megatron_fsdp_use_decoupled_grad": (False, "decoupled (precision-aware optimizer) gradients are not implemented"),
    "megatron_fsdp_cuda_graph_mode": (False, "CUDA graph capture of the step is not implemented"),
}

_NCCL_UB = ("NCCL user-buffer registration (zero-copy collectives from an NCCL memory pool) is not "
            "implemented: buckets are ordinary allocations")
PERFORMANCE_ONLY_OPTIONS: dict[str, str] = {
    # name: what this engine does instead. Upstream's allocation and registration
    # choices for NCCL: they change where buckets live and how NCCL reaches them, never
    # a value, so upstream's launch scripts (Megatron-FSDP's Llama-3 example sets
    # --use-nccl-ub --fsdp-manual-registration) run here unchanged, with one warning.
    "nccl_ub": _NCCL_UB,
    "fsdp_manual_registration": _NCCL_UB,
    "disable_symmetric_registration": _NCCL_UB,
    "fsdp_db_use_persist_buf_on_alloc_fail": "the double buffer never falls back to persistent buffers (no NCCL "
                                             "user buffers to run out of)",
    "megatron_fsdp_max_pool_double_buffer": "fsdp_double_buffer's slot pools serve every unit",
}


def warn_performance_only(obj: Any, options: dict[str, str], *, where: str) -> None:
    """One warning per upstream allocation/registration option that is on: accepted, no
    effect here, the same numbers (read as attributes or dict keys)."""
    for name, instead in options.items():
        value = obj.get(name, False) if isinstance(obj, dict) else getattr(obj, name, False)
        if value:
            warnings.warn(f"{where}: {name}={value!r} has no effect in megatron_fsdp ({instead}); the training "
                          "numbers are the same", stacklevel=4)  # the caller of DistributedDataParallelConfig(...)


def check_unimplemented(obj: Any, options: dict[str, tuple[Any, str]], *, where: str) -> None:
    """Raise ``NotImplementedError`` naming the first upstream option set away
    from the one value this engine supports (read as attributes or dict keys)."""
    for name, (accepted, why) in options.items():
        value = obj.get(name, accepted) if isinstance(obj, dict) else getattr(obj, name, accepted)
        if value is not accepted and value != accepted:
            raise NotImplementedError(
                f"{where}: {name}={value!r} is not implemented in this version of megatron_fsdp ({why}); "
                f"leave it at {accepted!r}"
            )


def mixed_precision_policy_from(cfg: Any) -> MixedPrecisionPolicy:
    """Build the policy from any object with Megatron's field names (ours or
    Megatron-core's ``DistributedDataParallelConfig``)."""
    main_params = parse_dtype(
        getattr(cfg, "megatron_fsdp_main_params_dtype", torch.float32), arg_name="megatron_fsdp_main_params_dtype"
    )
    if not getattr(cfg, "preserve_fp32_weights", True):
        main_params = None
    main_grads = parse_dtype(
        getattr(cfg, "megatron_fsdp_main_grads_dtype", None), arg_name="megatron_fsdp_main_grads_dtype"
    )
    if main_grads is None and getattr(cfg, "grad_reduce_in_fp32", False):
        main_grads = torch.float32
    grad_comm = parse_dtype(getattr(cfg, "megatron_fsdp_grad_comm_dtype", None), arg_name="megatron_fsdp_grad_comm_dtype")
    return MixedPrecisionPolicy(main_params_dtype=main_params, main_grads_dtype=main_grads, grad_comm_dtype=grad_comm)
