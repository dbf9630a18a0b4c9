"""Public entry points, argument-compatible with upstream Megatron-FSDP:
``fully_shard_model``, ``fully_shard_optimizer`` and ``fully_shard``."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import device as device_mod
from .config import DistributedDataParallelConfig
from .distributed_index import DEFAULT_DP_SHARD_DIM, DEFAULT_TP_DIM, FSDPDistributedIndex, build_default_mesh
from .enums import ShardingStrategy
from .megatron_fsdp import MegatronFSDP, owner_of
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
) -> MegatronFSDP:
    """Wrap ``module`` in ``MegatronFSDP``; see the README for the meaning of each argument."""
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
    """Make ``optimizer.step()`` / ``zero_grad()`` drive the model's gradient and
    weight synchronisation. The optimizer is otherwise left untouched: no state is
    created and no step is counted (its first real step is its first step)."""
    models = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            if owner is None:
                raise ValueError(
                    "fully_shard_optimizer: a parameter of the optimizer does not belong to a MegatronFSDP model; "
                    "build the optimizer from the wrapped model's parameters: opt = Opt(model.parameters())"
                )
            if owner not in models:
                models.append(owner)
    if not models:
        raise ValueError("fully_shard_optimizer: the optimizer has no parameters")

    base_step, base_zero_grad = optimizer.step, optimizer.zero_grad

    def step(*args: Any, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True, **kwargs: Any):
        if not any(model.backward_since_step for model in models):
            # Stale or zeroed gradients would still move weights (weight decay,
            # momentum); skipping leaves the state exactly as it was.
            warnings.warn(
                "optimizer.step() was called with no backward pass since the last step; the step is skipped. "
                "Call loss.backward() before optimizer.step().",
                stacklevel=2,
            )
            return None
        for model in models:
            if sync_grad_before_optimizer_step and not model.model_auto_sync:
                model.finish_grad_sync()
        with _on_local_tensors(optimizer):
            result = base_step(*args, **kwargs)
        for model in models:
            model.backward_since_step = False
            if install_optimized_model_weights:
                model.install_optimized_model_weights()
        return result

    def zero_grad(*args: Any, zero_grad_buffer: bool = True, **kwargs: Any):
        base_zero_grad(*args, **kwargs)
        if zero_grad_buffer:
            for model in models:
                model.zero_grad_buffer()

    # Instance attributes shadow the class methods; type(optimizer).step stays intact.
    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer.megatron_fsdp_models = models
    from .checkpoint import preprocess_optimizer_state_dict

    if preproc_state_dict_for_dcp_ckpt:
        optimizer.register_state_dict_post_hook(preprocess_optimizer_state_dict)
    return optimizer


@contextlib.contextmanager
def _on_local_tensors(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Run the optimizer's own step on the plain local pieces of DTensor parameters.

    An elementwise optimizer computes the same numbers on the local pieces, while a
    foreach op over DTensors dispatches every tensor through Python (tens of
    microseconds per tensor per op). Outside ``step()`` nothing changes: the param
    groups and the state hold DTensors, so norms, ``state_dict()`` and
    ``optimizer.state[param]`` keep their global meaning."""
    swapped: list[tuple[dict, list]] = []
    twins: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups:
        params = group["params"]
        if not any(isinstance(p, DTensor) for p in params):
            continue
        local_params = []
        for p in params:
            local = p
            if isinstance(p, DTensor):
                if p not in twins:
                    twins[p] = _local_twin(optimizer, p)
                local = twins[p]
            local_params.append(local)
        swapped.append((group, params))
        group["params"] = local_params
    try:
        yield
    finally:
        for group, params in swapped:
            group["params"] = params
        for p, local in twins.items():
            _restore_state(optimizer, p, local)
            local.grad = None


def _local_twin(optimizer: torch.optim.Optimizer, param: DTensor) -> torch.Tensor:
    local = param._local_tensor.detach()  # shares storage with the parameter's shard
    if param.grad is not None:
        local.grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
    state = optimizer.state.pop(param, None)
    if state is not None:
        optimizer.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
        optimizer.state[local]["__dtensor_state__"] = state  # the DTensors to hand back
    return local


def _restore_state(optimizer: torch.optim.Optimizer, param: DTensor, local: torch.Tensor) -> None:
    state = optimizer.state.pop(local, None)
    if state is None:
        return
    previous = state.pop("__dtensor_state__", {})
    restored = {}
    for key, value in state.items():
        old = previous.get(key)
        if isinstance(old, DTensor) and old._local_tensor is value:
            restored[key] = old  # updated in place: the same DTensor
        elif isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0:
            restored[key] = DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            restored[key] = value  # scalars such as Adam's step
    optimizer.state[param] = restored


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
    model = fully_shard_model(module, **kwargs)
    if isinstance(optimizer_or_factory, torch.optim.Optimizer):
        optimizer = _rebuild_optimizer(optimizer_or_factory, module, model)
    else:
        optimizer = optimizer_or_factory(model.parameters())
    return model, fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)


def _rebuild_optimizer(old: torch.optim.Optimizer, module: torch.nn.Module, model: MegatronFSDP) -> torch.optim.Optimizer:
    if old.state:
        raise ValueError(
            "fully_shard: the optimizer already holds state; build it before training, or pass a factory "
            "(lambda params: torch.optim.AdamW(params, ...))"
        )
    # Compute parameters were re-pointed into buffers but are the same objects.
    dist_of = {}
    for name, dist_param in model.named_parameters():
        dist_of[id(module.get_parameter(name))] = dist_param
    groups = []
    for group in old.param_groups:
        new_group = {k: v for k, v in group.items() if k != "params"}
        missing = [p for p in group["params"] if id(p) not in dist_of]
        if missing:
            raise ValueError("fully_shard: the optimizer holds parameters that are not in the module being sharded")
        new_group["params"] = [dist_of[id(p)] for p in group["params"]]
        groups.append(new_group)
    return type(old)(groups, **old.defaults)
