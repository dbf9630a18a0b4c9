"""TransformerEngine modules, recognised without importing TransformerEngine.

A module (or tensor) is TE's when a class in its MRO lives under the
``transformer_engine`` package. Two TE features touch the sharded buffers:

* Quantized (FP8 / MXFP8) parameters, from ``fp8_model_init`` /
  ``quantized_model_init``: their storage is TE's own tensor subclass, which the
  ``param.data = view-into-bucket`` repointing would break. Not implemented yet:
  ``check_supported`` raises, naming the module and parameter, before any buffer
  exists. TE modules with ordinary bf16/fp32 weights (FP8 *compute* under
  ``fp8_autocast`` included) are supported.
* ``fuse_wgrad_accumulation=True``: TE's weight-gradient GEMM accumulates straight
  into ``param.main_grad`` (Megatron's convention) and sets
  ``param.grad_added_to_main_grad = True``, handing autograd only a dummy gradient.
  ``prepare_fused_wgrad`` gives each such weight a ``main_grad`` for the span of its
  module's backward (allocated by a backward pre-hook, in the main-grad dtype,
  zeroed) and ``take_grad`` hands its contents to the gradient pipeline in place of
  the dummy, then drops it: at most the weights of modules whose backward is
  running hold one, as with ordinary gradients.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

TE_PACKAGE = "transformer_engine"
_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}


def _from_te(cls: type) -> bool:
    return any((getattr(c, "__module__", "") or "").split(".")[0] == TE_PACKAGE for c in cls.__mro__)


def is_te_module(module: nn.Module) -> bool:
    return _from_te(type(module))


def is_quantized_param(param: torch.Tensor) -> bool:
    """TE's quantized tensor subclasses, or a float8 dtype."""
    return param.dtype in _FLOAT8 or (type(param) not in (nn.Parameter, torch.Tensor) and _from_te(type(param)))


def check_supported(module: nn.Module) -> None:
    """Raise before any buffer is built for parameters megatron_fsdp cannot shard."""
    for name, sub in module.named_modules():
        for pname, param in sub.named_parameters(recurse=False):
            quantized = is_quantized_param(param) or (is_te_module(sub) and getattr(sub, "primary_weights_in_fp8", False))
            if quantized:
                where = f"{name}.{pname}" if name else pname
                raise NotImplementedError(
                    f"parameter {where!r} of {type(sub).__module__}.{type(sub).__name__} is a quantized "
                    f"({type(param).__name__}, {param.dtype}) TransformerEngine parameter; megatron_fsdp does not "
                    "shard FP8/quantized parameters yet. Build the model without fp8_model_init / "
                    "quantized_model_init (bf16 weights; FP8 compute under fp8_autocast still works)"
                )


def fused_wgrad_params(module: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """TE modules with ``fuse_wgrad_accumulation=True`` and their trainable weights."""
    out: dict[nn.Module, list[nn.Parameter]] = {}
    for sub in module.modules():
        if is_te_module(sub) and getattr(sub, "fuse_wgrad_accumulation", False):
            params = [p for p in sub.parameters(recurse=False) if p.requires_grad]
            if params:
                out[sub] = params
    return out


def prepare_fused_wgrad(module: nn.Module, grads_dtype_for: Callable[[torch.dtype], torch.dtype]) -> list:
    """Set Megatron's ``main_grad`` convention up on every fused TE weight; returns
    the hook handles. ``grads_dtype_for``: the main-grad dtype for a parameter dtype."""
    handles = []
    for sub, params in fused_wgrad_params(module).items():
        for p in params:
            p.main_grad = None  # Megatron convention, read by TE (STYLE.md principle 8's exception)
            p.grad_added_to_main_grad = False  # present: TE returns a dummy gradient, not None

        def allocate(mod, grad_output, params=params):
            for p in params:
                if p.main_grad is None:
                    p.main_grad = torch.zeros(p.shape, dtype=grads_dtype_for(p.dtype), device=p.device)

        handles.append(sub.register_full_backward_pre_hook(allocate))
    return handles


def take_grad(param: nn.Parameter, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient to reduce for ``param``: TE's fused ``main_grad`` when it wrote
    one (the autograd gradient is then a dummy), else ``grad``."""
    if not getattr(param, "grad_added_to_main_grad", False):
        return grad
    param.grad_added_to_main_grad = False
    fused, param.main_grad = param.main_grad, None
    return fused
