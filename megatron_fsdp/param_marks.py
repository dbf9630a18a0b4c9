"""User marks on parameters, kept in registries rather than patched onto them.

* ``fsdp_no_shard(module_or_param)``: keep these parameters replicated inside an
  otherwise sharded model: no all-gather, no unshard/reshard hooks on modules
  whose parameters are all marked; their gradients are still all-reduced.
* Expert parameters follow Megatron's convention (``param.allreduce = False``),
  which Megatron itself sets; we only read it.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

_NO_SHARD = WeakIdKeyDictionary()


def fsdp_no_shard(module_or_param: Union[nn.Module, torch.Tensor]) -> Union[nn.Module, torch.Tensor]:
    """Mark a module's parameters (or one parameter) to stay replicated under FSDP.

    Use it for small or frozen sub-modules (a frozen vision tower, a projector)
    whose all-gathers cost more than the memory they would save. Returns its
    argument, so it can wrap a constructor call."""
    if isinstance(module_or_param, nn.Module):
        params = list(module_or_param.parameters())
        if not params:
            raise ValueError(f"fsdp_no_shard: {type(module_or_param).__name__} has no parameters to mark")
    elif isinstance(module_or_param, torch.Tensor):
        params = [module_or_param]
    else:
        raise TypeError(
            f"fsdp_no_shard takes an nn.Module or a parameter, got {type(module_or_param).__name__}"
        )
    for p in params:
        _NO_SHARD[p] = True
    return module_or_param


def is_fsdp_no_shard(param: torch.Tensor) -> bool:
    return param in _NO_SHARD


def pop_marks(param: torch.Tensor) -> bool:
    """Remove ``param``'s marks (and the registry's weak reference to it); returns
    whether it was marked. ``torch.utils.swap_tensors`` refuses weakly referenced tensors."""
    return _NO_SHARD.pop(param, False)


def restore_marks(param: torch.Tensor, marked: bool) -> None:
    if marked:
        _NO_SHARD[param] = True


def is_expert_param(param: torch.Tensor) -> bool:
    """Megatron marks expert (MoE) parameters with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)
