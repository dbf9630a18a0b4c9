"""``UnsyncedGrad``: what a distributed parameter's ``.grad`` is while its gradient
sync is deferred.

[Note: deferred gradient sync] With auto-sync off (``MegatronFSDP``'s default
``sync_model_each_microbatch=False``, as upstream's; ``set_model_auto_sync(False)``)
or inside ``model.no_sync()``, a backward accumulates gradients in the
main-gradient buffers but does not reduce them; the reduced gradients reach the
distributed parameters at ``model.finish_grad_sync()``, which the step of any
optimizer over the model's parameters calls first (optimizer.py [Note: plain
optimizers]). Until then ``.grad`` holds none of the new gradients: it was ``None``
(then ``clip_grad_norm_`` silently saw a norm of 0) or the previous step's values. So
after such a backward every trainable distributed parameter's ``.grad`` is an
``UnsyncedGrad``: any operation on it (a norm, clipping, logging, ``zero_()``)
raises with the remedy. Setting it to ``None`` (``optimizer.zero_grad()``)
discards the deferred gradients, as zeroing does in DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

UNSYNCED_MESSAGE = (
    "{op} on the gradient of a megatron_fsdp parameter whose gradient sync is still deferred "
    "(MegatronFSDP(sync_model_each_microbatch=False), its default as upstream's; set_model_auto_sync(False); "
    "or no_sync()): the backward accumulated local, unreduced gradients, and "
    "the reduced ones only reach .grad at model.finish_grad_sync(). Call model.finish_grad_sync() before "
    "reading gradients (clip_grad_norm_, norms, logging); an optimizer's step() over the model's parameters "
    "calls it itself. "
    "To discard them instead, set the gradients to None (optimizer.zero_grad())"
)


class UnsyncedGrad(torch.Tensor):
    """A placeholder with the parameter's shape, dtype and device that refuses every
    operation ([Note: deferred gradient sync])."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> "UnsyncedGrad":
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise RuntimeError(UNSYNCED_MESSAGE.format(op=func))

    def __repr__(self) -> str:  # printing a gradient must not raise
        return f"UnsyncedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: call model.finish_grad_sync())"


def unsynced_grad(param: torch.Tensor) -> torch.Tensor:
    """The placeholder ``.grad`` of ``param``. For a DTensor parameter it is a DTensor
    (same spec) whose local tensor is an ``UnsyncedGrad``: a plain placeholder next
    to DTensors would fail first in DTensor's own dispatch ("mixed torch.Tensor and
    DTensor", e.g. in a plain optimizer's step), without the remedy."""
    if isinstance(param, DTensor):
        local = UnsyncedGrad(param.to_local())
        return DTensor(local, param._spec, requires_grad=False)
    return UnsyncedGrad(param)

