"""Mixed-precision policy: which dtype the main weights, main gradients and the
gradient collectives use. Parsing of user-facing dtype values lives here too."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_DTYPE_NAMES = {
    "fp64": torch.float64,
    "float64": torch.float64,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(value: "torch.dtype | str | None", *, arg_name: str) -> Optional[torch.dtype]:
    """Map any floating ``torch.dtype`` (as upstream, e.g. ``torch.float64``) or
    ``'fp64'`` / ``'fp32'`` / ``'bf16'`` / ``'fp16'`` / ``'auto'`` / ``None`` to a
    floating dtype (``'auto'`` and ``None`` mean "follow the default")."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("auto", "none"):
            return None
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"{arg_name}={value!r} is not a supported dtype; use one of "
                f"'fp64', 'fp32', 'bf16', 'fp16', 'auto' or a torch floating dtype"
            )
        return _DTYPE_NAMES[key]
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(
                f"{arg_name}={value} is not a floating dtype; use e.g. torch.float32, torch.bfloat16 or torch.float64"
            )
        return value
    raise ValueError(f"{arg_name}={value!r} must be a torch dtype or one of 'fp64', 'fp32', 'bf16', 'fp16', 'auto'")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Precision of the state Megatron-FSDP keeps beside the compute weights."""

    main_params_dtype: Optional[torch.dtype] = torch.float32
    """Dtype of the sharded main weights that the optimizer updates and checkpoints
    hold. ``None``: the compute weights (model weight buffer) are the main weights."""

    main_grads_dtype: Optional[torch.dtype] = None
    """Dtype of the main gradient buffer that accumulates across microbatches.
    ``None``: the compute parameter dtype."""

    grad_comm_dtype: Optional[torch.dtype] = None
    """Dtype on the wire for the gradient all-reduce / reduce-scatter.
    ``None``: the main gradient dtype (no extra buffer)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, parse_dtype(value, arg_name=field.name))

    def grads_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.main_grads_dtype or param_dtype

    def comm_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.grad_comm_dtype or self.grads_dtype_for(param_dtype)
