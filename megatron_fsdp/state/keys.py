"""State-dict keys: the names a sharded model's entries are saved under.

One set of rules for every state dict this package writes (sharded, full, legacy
one-file): ``torch_key`` (the key ``nn.Module.state_dict()`` gives a name),
``alias_names`` (tied weights under every name), ``persistent_buffers`` and
``extra_states`` (what ``state_dict()`` saves besides parameters).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from .sharded_model import ShardedModel


CHECKPOINT_WRAPPER_SEGMENT = "_checkpoint_wrapped_module."
"""The attribute torch's ``checkpoint_wrapper`` keeps its inner module under."""


def torch_key(name: str) -> str:
    """The key ``nn.Module.state_dict()`` gives the parameter or buffer ``name``.

    [Note: checkpoint_wrapper keys] torch's ``checkpoint_wrapper`` registers
    state-dict hooks that drop its ``_checkpoint_wrapped_module.`` segment, so a
    plain model, FSDP2 and DSD (which refuses keys that keep it) all key
    ``layers.0.weight``, not ``layers.0._checkpoint_wrapped_module.weight``. We
    build our state dicts from parameter names, not through those hooks, so we drop
    the segment ourselves; loading accepts either form."""
    return name.replace(CHECKPOINT_WRAPPER_SEGMENT, "")


EXTRA_STATE = "_extra_state"


def extra_states(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(key, submodule)`` for every submodule with extra state (one that overrides
    ``get_extra_state``, e.g. TransformerEngine's), keyed as ``nn.Module.state_dict()``
    keys it (``<name>._extra_state``, ``torch_key`` form)."""
    for name, sub in module.named_modules():
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            yield torch_key(f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE), sub


def alias_names(model: ShardedModel) -> dict[str, str]:
    """Every state-dict name of a parameter (tied weights have several, as in
    ``nn.Module.state_dict()``; ``torch_key`` form) -> the name the buffer files it under."""
    names = model.param_and_grad_buffer.param_names
    return {torch_key(name): names[p] for name, p in model.module.named_parameters(remove_duplicate=False)}


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for every persistent buffer of ``module`` (what ``state_dict()`` saves)."""
    for name, value in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr not in owner._non_persistent_buffers_set:
            yield name, value
