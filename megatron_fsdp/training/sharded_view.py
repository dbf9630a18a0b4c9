"""What the per-module sharding paths (``--use-torch-fsdp2``, ``--megatron-fsdp-version 2``) share:
the launcher's view of a model sharded in place, and the parameter marks that sharding drops.

Both shard the model itself (``fully_shard`` turns its modules into FSDP modules and its
parameters into DTensors), so the launcher's wrapper only gives it the interface the training
loop reads (``module``, ``no_sync``) and keeps the model's own state-dict keys, so that
checkpoints read as every other path's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn as nn

__all__ = ["ShardedModelView", "parameter_marks", "restore_marks"]


class ShardedModelView(nn.Module):
    """``module`` is the model, sharded in place; the state dict is the model's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """An early micro batch of the step: nothing held back by default (every micro batch
        reduce-scatters its gradients, which add up sharded)."""
        yield

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def parameter_marks(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The attributes Megatron conventions set on each parameter, by name (before sharding)."""
    return {name: dict(vars(param)) for name, param in module.named_parameters()}


def restore_marks(module: nn.Module, marks: dict[str, dict[str, Any]]) -> None:
    """Sharding replaces every parameter with a DTensor parameter, dropping the attributes
    Megatron conventions set on them (``is_embedding_or_output_parameter`` for --decoupled-lr,
    megatron-core's tensor-parallel marks, ``allreduce`` on experts); Megatron-LM copies them
    over the same way (pytorch/pytorch#136929)."""
    for name, param in module.named_parameters():
        for key, value in marks.get(name, {}).items():
            setattr(param, key, value)
