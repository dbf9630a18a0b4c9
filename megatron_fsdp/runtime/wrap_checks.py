"""What ``MegatronFSDP`` refuses to wrap, checked before any buffer or process group
is touched, each refusal naming the remedy."""

from __future__ import annotations

import torch
import torch.nn as nn

from .owners import WRAPPED, is_managed


def _is_wrapper(module: nn.Module, wrapper_types: tuple) -> bool:
    if isinstance(module, (*wrapper_types, torch.nn.parallel.DistributedDataParallel)):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch
        return False
    return isinstance(module, FSDPModule)


def check_module(module: nn.Module, device: torch.device, *, allow_meta: bool = False, wrapper_types: tuple = ()) -> None:
    """Refuse, before any buffer exists, what megatron_fsdp cannot wrap: not a
    module, a data-parallel wrapper inside, a model wrapped already, no parameters,
    parameters on another device, lazy (uninitialised)
    parameters. ``wrapper_types``: the caller's own wrapper classes."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"megatron_fsdp wraps a torch.nn.Module, got {type(module).__name__} ({module!r:.80}); "
            "pass the model itself (e.g. fully_shard_model(model, ...))"
        )
    for name, sub in module.named_modules():
        if _is_wrapper(sub, wrapper_types):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(
                f"cannot wrap {type(module).__name__}: {where} is already a data-parallel wrapper "
                f"({type(sub).__name__}); wrap the plain model once, with one of megatron_fsdp, FSDP or DDP"
            )
    wrapped = [p for p in module.parameters() if is_managed(p)] or ([module] if module in WRAPPED else [])
    if wrapped:
        raise ValueError(
            f"{type(module).__name__} (or a submodule of it) is already wrapped by megatron_fsdp: its parameters "
            "live in that wrapper's buffers, and a second wrapper would train a stale copy. Wrap the plain model "
            "once and keep using the first wrapper (fully_shard_model returns it)"
        )
    params = list(module.named_parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters; there is nothing for megatron_fsdp to shard")
    for name, p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is not initialised yet (a lazy module such as nn.LazyLinear), so it has no "
                "shape to shard; run one forward on a dummy batch before wrapping, as DDP and FSDP require"
            )
        if p.device != device and not (allow_meta and p.device.type == "meta"):
            raise ValueError(
                f"parameter {name!r} is on {p.device} but megatron_fsdp was given device={device}; "
                f"move the model first (module.to({str(device)!r})) or pass device={str(p.device)!r}"
            )
        # DTensor parameters: a tensor-parallel model's are admitted, any other refused,
        # by buffers/tensor_parallel.py's check_tensor_parallel (run before this).
