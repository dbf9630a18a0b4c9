"""Upstream's module path ``megatron_fsdp.param_and_grad_buffer``, where Megatron-LM imports
``make_fsdp_dtensor`` and the buffer classes from. The buffers live in
``buffers/param_and_grad_buffer.py``; ``make_fsdp_dtensor`` in ``utils.py``."""

from .buffers.param_and_grad_buffer import ParamAndGradBuffer, ParameterGroup  # noqa: F401
from .utils import make_fsdp_dtensor  # noqa: F401

__all__ = ["ParamAndGradBuffer", "ParameterGroup", "make_fsdp_dtensor"]
