"""Adam's state in a ``torch_dist`` checkpoint, in the model space megatron-core's distributed
optimizer uses for its ``fully_reshardable`` layout.

[Note: which optimizer layout] megatron-core 0.16's ``DistributedOptimizer`` checkpoints its
state in one of three layouts (``metadata['distrib_optim_sharding_type']``):
``dp_reshardable`` (Megatron-LM's default: its flat gradient-buffer shards as they lie, only
readable by the same bucket layout), ``fully_sharded_model_space`` (flattened per-parameter
ranges; 0.16's ``ShardedTensor`` refuses ``flattened_range``, so it no longer saves) and
``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): per parameter, tensors of the
parameter's shape under ``optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>``, the
parameter's own global shape and sharding. The last is the one a different layout can
read, so it is the one written and read here: each rank writes the blocks of its Adam moments
(and fp32 main weights) exactly where the model's blocks go.

What does not carry to Megatron-LM: its ``param_groups`` (numbered by its own gradient-buffer
order, with learning rates its scheduler restores), so Megatron-LM resumes our checkpoints with
``--no-load-optim`` or re-derives them; the Adam step is kept in ``common.pt`` under
``STEP_KEY`` (and read from Megatron-LM's ``param_groups`` when loading its checkpoints). Only
``fully_reshardable`` optimizer state is read; anything else is refused before any change.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from ..models import GPTConfig
from ..state import materialize_optimizer_state, parameter_names
from .torch_dist_io import tensor_shapes
from .torch_dist_keys import mcore_target, our_name
from .torch_dist_shards import local_block, piece_values, put_piece, row_pieces, sharded_tensor

STEP_KEY = "megatron_fsdp_adam_step"
MOMENTS = ("exp_avg", "exp_avg_sq")
_PREFIX = "optimizer.state."
MAIN_PARAM_PREFIX = _PREFIX + "param."
"""fully_reshardable's fp32 main weights: ``optimizer.state.param.<parameter key>``."""


class OptimizerPieces:
    """The optimizer's standard state dict and, per moment of each parameter, this rank's block."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: GPTConfig, spec: str) -> None:
        materialize_optimizer_state(optimizer)
        self.state_dict = optimizer.state_dict()
        self.cfg = cfg
        self.items = []  # (index, moment, target, block)
        for index, name in enumerate(our_name(n) for n in parameter_names(model, optimizer)):
            target = mcore_target(name, cfg, spec)
            state = self.state_dict["state"].get(index)
            if target is None or not state:
                continue
            for moment in MOMENTS:
                if moment not in state:
                    raise ValueError(f"optimizer state of {name} has no {moment!r}: torch_dist optimizer state is "
                                     "Adam's (exp_avg, exp_avg_sq); save without optimizer= for other optimizers")
                self.items.append((index, moment, target, local_block(state[moment], main_if_plain=True, name=name)))

    def sharded(self, *, loading: bool) -> dict[str, Any]:
        out = {}
        for index, moment, target, block in self.items:
            for i, piece in enumerate(row_pieces(target, block, self.cfg)):
                values = None if loading else piece_values(block.data, piece)
                out[f"{index}/{moment}/{i}"] = sharded_tensor(_PREFIX + moment + "." + target.key, target, block,
                                                              piece, values)
        return out

    def step(self) -> float:
        steps = {float(s["step"]) for s in self.state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"the optimizer's parameters are at different Adam steps {sorted(steps)}; torch_dist "
                             "keeps one step (as Megatron-LM's param_groups do)")
        return steps.pop() if steps else 0.0


def optimizer_sharded_state(pieces: OptimizerPieces) -> dict[str, Any]:
    """The ``optimizer`` part of a checkpoint being saved: the moments' ShardedTensors, the
    layout name and the Adam step (common values)."""
    return {"param_state": pieces.sharded(loading=False), "param_state_sharding_type": "fully_reshardable",
            STEP_KEY: pieces.step()}


def check_optimizer_state(path: str | os.PathLike, common: dict[str, Any]) -> None:
    """Refuse, before anything changes, a checkpoint without readable Adam state."""
    saved = common.get("optimizer")
    layout = saved.get("param_state_sharding_type") if isinstance(saved, dict) else None
    if layout != "fully_reshardable":
        found = ("no optimizer state" if saved is None else
                 f"optimizer state in another layout (param_state_sharding_type={layout!r}; a chained "
                 "dense+expert optimizer or dp_reshardable, Megatron-LM's default)")
        raise ValueError(f"{os.fspath(path)!r} holds {found}; load_torch_dist reads Adam state in megatron-core's "
                         "'fully_reshardable' layout (Megatron-LM: --dist-ckpt-optim-fully-reshardable). Load the "
                         "model only (optimizer=None) and start the optimizer afresh, or re-save it in that layout")
    if not any(key.startswith(_PREFIX + MOMENTS[0]) for key in tensor_shapes(path)):
        raise ValueError(f"{os.fspath(path)!r} names the fully_reshardable layout but stores no {_PREFIX}exp_avg.* "
                         "tensors; load with optimizer=None")


def _saved_step(saved: dict[str, Any]) -> float:
    if STEP_KEY in saved:
        return float(saved[STEP_KEY])
    groups = (saved.get("optimizer") or {}).get("param_groups", [])  # Megatron-LM's
    steps = {float(g["step"]) for g in groups if "step" in g}
    if len(steps) != 1:
        raise ValueError(f"cannot tell the Adam step from the checkpoint's param_groups (steps {sorted(steps)}); "
                         "load with optimizer=None")
    return steps.pop()


def load_optimizer_state(optimizer: torch.optim.Optimizer, pieces: OptimizerPieces, loaded: dict[str, Any],
                         common: dict[str, Any]) -> None:
    """Write the loaded moments into the optimizer (its own param_groups kept) and its step."""
    for index, moment, target, block in pieces.items:
        for i, piece in enumerate(row_pieces(target, block, pieces.cfg)):
            put_piece(block.data, piece, loaded["param_state"][f"{index}/{moment}/{i}"])
    step = _saved_step(common["optimizer"])
    for state in pieces.state_dict["state"].values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device) if torch.is_tensor(old) else step
    optimizer.load_state_dict(pieces.state_dict)
