"""What backward will reach from a module's output: where the pre-backward hooks of
both engines (hooks.py, experimental/module.py) go."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that backward will reach: through pytree
    containers (tuples, lists, dicts, namedtuples) and, as DDP finds them, through
    dataclass fields. A dataclass output was missed, so ZeRO-3 never re-gathered the
    unit for backward ('setStorage ... storage of size 0')."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += grad_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def refuse_hidden_grad_tensors(output: Any, where: str) -> None:
    """An output whose tensors hide in an object we cannot look into (not a pytree
    container or dataclass) would get no backward hook, and backward would meet
    released weights: refuse it in forward, naming the type."""
    for leaf in tree_flatten(output)[0]:
        state = getattr(leaf, "__dict__", None)
        if isinstance(leaf, torch.Tensor) or not isinstance(state, dict):
            continue
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in state.values()):
            raise RuntimeError(
                f"{where} returned an object of type {type(leaf).__name__} holding tensors that megatron_fsdp "
                "cannot find, so backward would meet released weights; return them in tuples, lists, dicts, "
                "namedtuples or dataclasses, or register the type with torch.utils._pytree"
            )
