"""The optimizer's per-parameter state keyed by parameter name in the DCP checkpoints of
mixture-of-experts models (``save_checkpoint`` / ``load_checkpoint``).

[Note: optimizer state by parameter name] ``optimizer.state_dict()`` numbers the
parameters (torch's form, which the engine keeps: ``optimizer.state.<index>.exp_avg``).
Under expert parallelism the numbers mean different parameters on different ranks: EP
rank 0's parameter 14 is an expert of its block, EP rank 1's the same-shaped expert of
another block, so the ranks would write different tensors under one key (DCP keeps one
of them) and a run at another EP size would read its parameter 14 from the wrong
expert. Keyed by the model's parameter names instead (``optimizer.state.module.blocks.1.
mlp.experts.5.fc.weight.exp_avg``: global expert names, the model state dict's), every
expert's state has one key whatever the EP size, as Megatron-LM's distributed
checkpoints address optimizer state by parameter. ``param_groups`` keep their
hyper-parameters; on load each group's parameters are the loading optimizer's own (the
same groups in the same order: the launcher builds them by rule, whatever the layout).

Only where it matters: models with expert parameters save by name, so every other
checkpoint keeps torch's form; a load follows the checkpoint's form (an index-keyed
checkpoint loads as it was written). A save renames the state dict it hands DCP; a load
renames back through a ``load_state_dict`` pre-hook (torch's extension point) registered
for that one load, before the engine's own hooks.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Iterable, Iterator, Optional

import torch
import torch.nn as nn

from ..param_marks import is_expert_param

_INDEX_KEY = re.compile(r"optimizer\.state\.\d+\.")
_STATE_PREFIX = "optimizer.state."


def keys_by_name(model: nn.Module) -> bool:
    """Whether a save of ``model``'s optimizer keys its state by parameter name (MoE models)."""
    return any(is_expert_param(p) for p in model.parameters())


def checkpoint_keys_by_name(keys: Iterable[str]) -> bool:
    """Whether a checkpoint whose flattened keys are ``keys`` holds name-keyed optimizer state."""
    return any(k.startswith(_STATE_PREFIX) and not _INDEX_KEY.match(k) for k in keys)


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter in ``optimizer.state_dict()``'s numbering (first appearance
    over the param groups); ValueError for a parameter ``model`` does not own."""
    names = {id(p): name for name, p in model.named_parameters()}
    ordered: list[str] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in names:
                raise ValueError(f"the optimizer steps a parameter of shape {tuple(p.shape)} that the model does not "
                                 "own; build the optimizer from the checkpointed model's parameters")
            ordered.append(names[id(p)])
    return ordered


def _to_names(names: list[str], optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    out = dict(state_dict)
    out["state"] = {names[index]: value for index, value in state_dict["state"].items()}
    out["param_groups"] = [dict(group, params=[names[i] for i in group["params"]])
                           for group in state_dict["param_groups"]]
    return out


def _to_indices(names: list[str], optimizer: torch.optim.Optimizer, state_dict: dict) -> Optional[dict]:
    state = state_dict.get("state", {})
    if not any(isinstance(key, str) for key in state):
        return None  # torch's own numbering: nothing to translate
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(state) - set(index))
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state names parameters this model does not hold here: "
                         f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''}; load it into the same model")
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                         f"{len(optimizer.param_groups)}; resume with the same optimizer flags (--decoupled-lr, "
                         "--weight-decay ...)")
    own = _group_numbers(optimizer)
    out = dict(state_dict)
    out["state"] = {index[name]: value for name, value in state.items()}
    out["param_groups"] = [dict(group, params=mine) for group, mine in zip(groups, own)]
    return out


def _group_numbers(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Each param group's parameters in ``optimizer.state_dict()``'s numbering."""
    numbers: dict[int, int] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append([numbers.setdefault(id(p), len(numbers)) for p in group["params"]])
    return groups


def state_dict_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``optimizer``'s ``state_dict`` (torch's numbering) keyed by ``model``'s parameter names."""
    return _to_names(parameter_names(model, optimizer), optimizer, state_dict)


@contextlib.contextmanager
def loads_keyed_by_name(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], enabled: bool) -> Iterator[None]:
    """Within the block ``optimizer.load_state_dict()`` takes either form (see [Note:
    optimizer state by parameter name]); nothing changes when ``enabled`` is False or there
    is no optimizer."""
    if not enabled or optimizer is None:
        yield
        return
    names = parameter_names(model, optimizer)
    handles = [optimizer.register_load_state_dict_pre_hook(functools.partial(_to_indices, names), prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
