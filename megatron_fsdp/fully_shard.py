"""Public entry points, argument-compatible with upstream Megatron-FSDP:
``fully_shard_model``, ``fully_shard_optimizer`` and ``fully_shard``."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import device as device_mod
from .config import UNIMPLEMENTED_OPTIONS, DistributedDataParallelConfig, check_unimplemented
from .comm.distributed_index import DEFAULT_DP_SHARD_DIM, DEFAULT_TP_DIM, FSDPDistributedIndex, build_default_mesh
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
    hybrid_fsdp_expt_group: Optional[dist.ProcessGroup] = None,
    expt_device_mesh: Optional[DeviceMesh] = None,
    fsdp_group_ag: Optional[dist.ProcessGroup] = None,
    expt_fsdp_group_ag: Optional[dist.ProcessGroup] = None,
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
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
    check_for_nan_in_grad: bool = False,
    suggested_communication_unit_size: Optional[int] = None,
    broadcast_buffers: bool = True,
    collective_timeout_s: Optional[float] = None,
) -> MegatronFSDP:
    """Wrap ``module`` in ``MegatronFSDP``; see the README for the meaning of each argument.

    The parameters are upstream megatron-fsdp's, in its order (the last four are
    ours). Upstream options this engine does not implement are accepted at their
    default and raise ``NotImplementedError`` naming them at any other value."""
    args = dict(locals())
    check_unimplemented(args, _UNIMPLEMENTED_MODEL_OPTIONS, where="fully_shard_model")
    check_policy(mixed_precision_policy)
    strategy, outer = _parse_strategies(zero_dp_strategy, outer_dp_sharding_strategy, dp_outer_dim, hybrid_fsdp_group)
    resolved_device = device_mod.resolve_device(device)
    ddp_config = _ddp_config(strategy, outer, args)  # validates before any process group is made
    dist_index = _distributed_index(args, outer, resolved_device)
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


def _distributed_index(args: dict[str, Any], outer: ShardingStrategy, device: torch.device) -> FSDPDistributedIndex:
    """The process groups of ``fully_shard_model``'s mesh arguments (``args``: its
    locals); without a ``device_mesh``, a default one over the whole world."""
    device_mesh, dp_shard_dim, tp_dim = args["device_mesh"], args["dp_shard_dim"], args["tp_dim"]
    if device_mesh is None:
        dp_shard_dim = dp_shard_dim or DEFAULT_DP_SHARD_DIM
        tp_dim = tp_dim or DEFAULT_TP_DIM
        device_mesh = build_default_mesh(device_mod.mesh_device_type(device), dp_shard_dim, tp_dim)
    elif dp_shard_dim is None:
        raise ValueError("dp_shard_dim is required with a device_mesh: name the mesh dimension to shard over")
    return FSDPDistributedIndex(
        device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=args["dp_outer_dim"],
        tp_dim=tp_dim,
        hybrid_fsdp_group=args["hybrid_fsdp_group"],
        hybrid_fsdp_expt_group=args["hybrid_fsdp_expt_group"],
        hsdp_outer_dp_shard=outer is ShardingStrategy.OPTIM,
        expt_device_mesh=args["expt_device_mesh"],
    )


def _ddp_config(
    strategy: ShardingStrategy, outer: ShardingStrategy, args: dict[str, Any]
) -> DistributedDataParallelConfig:
    """The config of ``fully_shard_model``'s keyword arguments (``args``: its locals),
    under the config's own (upstream's) field names."""
    policy = args["mixed_precision_policy"]
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy.label,
        outer_dp_sharding_strategy=outer.label,
        overlap_grad_reduce=args["overlap_grad_reduce"],
        overlap_param_gather=args["overlap_param_gather"],
        average_in_collective=args["average_in_collective"],
        check_for_nan_in_grad=args["check_for_nan_in_grad"],
        keep_fp8_transpose_cache=args["keep_fp8_transpose_cache"],
        nccl_ub=args["nccl_ub"],
        fsdp_double_buffer=args["fsdp_double_buffer"] or args["nccl_ub"],
        fsdp_db_use_persist_buf_on_alloc_fail=args["fsdp_db_use_persist_buf_on_alloc_fail"],
        disable_symmetric_registration=args["disable_symmetric_registration"],
        megatron_fsdp_use_decoupled_grad=args["use_decoupled_grad"],
        megatron_fsdp_cuda_graph_mode=args["cuda_graph_mode"],
        megatron_fsdp_max_pool_double_buffer=args["maxpool_double_buffer"],
        suggested_communication_unit_size=args["suggested_communication_unit_size"],
        megatron_fsdp_main_params_dtype=policy.main_params_dtype,
        megatron_fsdp_main_grads_dtype=policy.main_grads_dtype,
        megatron_fsdp_grad_comm_dtype=policy.grad_comm_dtype,
        collective_timeout_s=args["collective_timeout_s"],
    )


_UNIMPLEMENTED_MODEL_OPTIONS = {
    # fully_shard_model's names for upstream options this engine does not implement
    # (checked before anything is built, so no weight ever changes).
    "fsdp_group_ag": (None, "a separate all-gather group (AG/RS overlap on CUDA) is not implemented"),
    "expt_fsdp_group_ag": (None, "a separate expert all-gather group is not implemented"),
    "use_decoupled_grad": UNIMPLEMENTED_OPTIONS["megatron_fsdp_use_decoupled_grad"],
    "cuda_graph_mode": UNIMPLEMENTED_OPTIONS["megatron_fsdp_cuda_graph_mode"],
}


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
    is taken and no parameter changes. ``state_dict()`` always holds standard
    DTensors (optimizer_state_dict.py), which DCP needs no preprocessing for:
    ``preproc_state_dict_for_dcp_ckpt`` is accepted for upstream's signature."""
    bind_optimizer(optimizer)
    return optimizer


def fully_shard(
    module: torch.nn.Module, optimizer: Any, *args: Any, **kwargs: Any
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """``fully_shard_model`` plus ``fully_shard_optimizer``, with upstream's
    parameters: ``module``, ``optimizer``, then every ``fully_shard_model`` option.

    ``optimizer`` is an optimizer built on the *original* module (upstream's
    usage), whose hyper-parameters and param-group layout are re-created over the
    sharded parameters, or a callable building it from the sharded parameters
    (``lambda params: AdamW(params, lr=1e-3)``).
    """
    bound = _FULLY_SHARD_SIGNATURE.bind(module, optimizer, *args, **kwargs)  # TypeError on unknown names
    options = {k: v for k, v in bound.arguments.items() if k not in ("module", "optimizer")}
    if isinstance(optimizer, torch.optim.Optimizer):
        check_rebuildable(optimizer)
    elif not callable(optimizer):
        raise TypeError(
            f"fully_shard(optimizer={optimizer!r}): pass a torch.optim.Optimizer built on the module's parameters "
            "or a callable building one from the sharded parameters (lambda params: torch.optim.AdamW(params))"
        )
    model = fully_shard_model(module, **options)
    try:
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = rebuild_optimizer(optimizer, module, model)
        else:
            optimizer = optimizer(model.parameters())
        preproc = options.get("preproc_state_dict_for_dcp_ckpt", True)
        optimizer = fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)
    except BaseException:
        model.unshard_module()  # all or nothing: the module is left as it was given
        raise
    return model, optimizer


def _fully_shard_signature() -> inspect.Signature:
    """(module, optimizer, <fully_shard_model's options>): upstream's order."""
    model_params = list(inspect.signature(fully_shard_model).parameters.values())
    optimizer = inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Any)
    return inspect.Signature([model_params[0], optimizer, *model_params[1:]])


_FULLY_SHARD_SIGNATURE = _fully_shard_signature()
fully_shard.__signature__ = _FULLY_SHARD_SIGNATURE
