"""Public entry points, argument-compatible with upstream Megatron-FSDP:
``fully_shard_model``, ``fully_shard_optimizer`` and ``fully_shard``."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import device as device_mod
from .config import DistributedDataParallelConfig
from .distributed_index import DEFAULT_DP_SHARD_DIM, DEFAULT_TP_DIM, FSDPDistributedIndex, build_default_mesh
from .enums import ShardingStrategy
from .megatron_fsdp import MegatronFSDP, check_policy
from .optimizer import bind_optimizer, check_rebuildable, rebuild_optimizer
from .mixed_precision import MixedPrecisionPolicy

logger = logging.getLogger(__name__)


def fully_shard_model(
    module: torch.nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    dp_shard_dim: Optional[str] = None,
    dp_outer_dim: Optional[str] = None,
    tp_dim: Optional[str] = None,
    hybrid_fsdp_group: Optional[dist.ProcessGroup] = None,
    expt_device_mesh: Optional[DeviceMesh] = None,
    fsdp_unit_modules: Optional[Sequence[Any]] = None,
    zero_dp_strategy: str | int = 3,
    outer_dp_sharding_strategy: str | int = 0,
    device: Optional[torch.device] = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    enable_fine_grained_param_gather: bool = False,
    check_for_nan_in_grad: bool = False,
    suggested_communication_unit_size: Optional[int] = None,
    broadcast_buffers: bool = True,
    collective_timeout_s: Optional[float] = None,
) -> MegatronFSDP:
    """Wrap ``module`` in ``MegatronFSDP``; see the README for the meaning of each argument."""
    check_policy(mixed_precision_policy)
    strategy, outer = _parse_strategies(zero_dp_strategy, outer_dp_sharding_strategy, dp_outer_dim, hybrid_fsdp_group)
    resolved_device = device_mod.resolve_device(device)
    if device_mesh is None:
        dp_shard_dim = dp_shard_dim or DEFAULT_DP_SHARD_DIM
        tp_dim = tp_dim or DEFAULT_TP_DIM
        device_mesh = build_default_mesh(device_mod.mesh_device_type(resolved_device), dp_shard_dim, tp_dim)
    elif dp_shard_dim is None:
        raise ValueError("dp_shard_dim is required with a device_mesh: name the mesh dimension to shard over")

    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy.label,
        outer_dp_sharding_strategy=outer.label,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective,
        check_for_nan_in_grad=check_for_nan_in_grad,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
        suggested_communication_unit_size=suggested_communication_unit_size,
        megatron_fsdp_main_params_dtype=mixed_precision_policy.main_params_dtype,
        megatron_fsdp_main_grads_dtype=mixed_precision_policy.main_grads_dtype,
        megatron_fsdp_grad_comm_dtype=mixed_precision_policy.grad_comm_dtype,
        collective_timeout_s=collective_timeout_s,
    )
    dist_index = FSDPDistributedIndex(
        device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        hsdp_outer_dp_shard=outer is ShardingStrategy.OPTIM,
        expt_device_mesh=expt_device_mesh,
    )
    model = MegatronFSDP(
        module,
        dist_index=dist_index,
        ddp_config=ddp_config,
        mixed_precision_policy=mixed_precision_policy,
        fsdp_unit_modules=fsdp_unit_modules,
        disable_bucketing=disable_bucketing,
        device=resolved_device,
        calculate_per_token_loss=calculate_per_token_loss,
        init_model_with_meta_device=init_model_with_meta_device,
        sync_model_each_microbatch=sync_model_each_microbatch,
        enable_fine_grained_param_gather_hook=enable_fine_grained_param_gather,
        report_nan_in_param_grad=report_nan_in_param_grad,
        broadcast_buffers=broadcast_buffers,
    )
    model.preproc_state_dict_for_dcp_ckpt = preproc_state_dict_for_dcp_ckpt
    return model


def _parse_strategies(
    zero_dp_strategy: Any, outer_dp_sharding_strategy: Any, dp_outer_dim: Optional[str], hybrid_fsdp_group: Any
) -> tuple[ShardingStrategy, ShardingStrategy]:
    strategy = ShardingStrategy.parse(zero_dp_strategy, arg_name="zero_dp_strategy")
    outer = ShardingStrategy.parse(
        outer_dp_sharding_strategy,
        arg_name="outer_dp_sharding_strategy",
        allowed=(ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM),
    )
    if outer is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            f"outer_dp_sharding_strategy='optim' (HFSDP) needs zero_dp_strategy=3/'optim_grads_params', "
            f"got {strategy.label!r}: outer sharding builds on full inner sharding"
        )
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError(
            f"dp_outer_dim={dp_outer_dim!r} and hybrid_fsdp_group={hybrid_fsdp_group!r} go together for HSDP; "
            "pass both (HSDP) or neither (FSDP)"
        )
    return strategy, outer


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True
) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` drive the model's gradient and weight
    synchronisation (through step hooks: see optimizer.py), and create its state
    now, as its first step would (Adam: zero moments, step 0), so that
    ``dcp.load({"optimizer": optimizer.state_dict()})`` has tensors to fill. No step
    is taken and no parameter changes."""
    first = getattr(optimizer, "megatron_fsdp_binding", None) is None
    bind_optimizer(optimizer)
    from .checkpoint import preprocess_optimizer_state_dict

    if preproc_state_dict_for_dcp_ckpt and first:
        optimizer.register_state_dict_post_hook(preprocess_optimizer_state_dict)
    return optimizer


def fully_shard(
    module: torch.nn.Module, optimizer_or_factory: Any, **kwargs: Any
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """``fully_shard_model`` plus ``fully_shard_optimizer``.

    ``optimizer_or_factory`` is either a callable building the optimizer from the
    sharded parameters (``lambda params: AdamW(params, lr=1e-3)``) or an optimizer
    built on the *original* module, whose hyper-parameters and param-group layout
    are re-created over the sharded parameters.
    """
    preproc = kwargs.get("preproc_state_dict_for_dcp_ckpt", True)
    if isinstance(optimizer_or_factory, torch.optim.Optimizer):
        check_rebuildable(optimizer_or_factory)
    elif not callable(optimizer_or_factory):
        raise TypeError(
            f"fully_shard: optimizer_or_factory={optimizer_or_factory!r} is neither a torch.optim.Optimizer nor a "
            "callable building one from parameters (lambda params: torch.optim.AdamW(params, lr=1e-3))"
        )
    model = fully_shard_model(module, **kwargs)
    try:
        if isinstance(optimizer_or_factory, torch.optim.Optimizer):
            optimizer = rebuild_optimizer(optimizer_or_factory, module, model)
        else:
            optimizer = optimizer_or_factory(model.parameters())
        optimizer = fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)
    except BaseException:
        model.unshard_module()  # all or nothing: the module is left as it was given
        raise
    return model, optimizer
