"""megatron-core's ``torch_dist`` distributed checkpoints written from and read into the
embedded GPT, plain or wrapped by this package at any world size and strategy.

``save_torch_dist`` hands megatron-core's ``dist_checkpointing.save`` the tensors of
megatron-core GPTModel's ``sharded_state_dict()``: the same keys, global shapes and layouts
(stacked layer axes, per-group QKV rows, experts on their own axis; torch_dist_keys.py),
each rank contributing only the blocks it holds (torch_dist_shards.py). Megatron-LM reads the
result as one of its own ``iter_XXXXXXX`` directories; ``load_torch_dist`` reads those back
through ``dist_checkpointing.load``, resharded to whatever layout the model has now.

What carries: every weight of a dense, GQA or MoE GPT (megatron-core's names for the ``te``
or ``local`` layer spec), of our embedded GPT or of megatron-core's own GPTModel wrapped by
``FullyShardedDataParallel``, and, with ``optimizer``, Adam's moments and fp32 main weights in
the model space of megatron-core's distributed optimizer's ``fully_reshardable`` layout
(torch_dist_optim.py). A checkpoint is independent of the layout that wrote it (world size,
ZeRO strategy, expert parallelism of the embedded GPT): each side reads the blocks it needs.
What does not: multi-token prediction and MLA layers (refused up front); megatron-core's own
GPTModel under expert parallelism (its ``local_experts`` numbering is per rank); Megatron-LM's
optimizer ``param_groups``, RNG and scheduler state (``common_state`` carries what the caller
puts there; Megatron-LM resumes our optimizer state only with its own param groups rebuilt).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..models import GPTConfig
from ..models.config import PositionEmbeddingType
from ..models.mcore import mcore_args
from .torch_dist_io import (
    check_readable, common_state, is_torch_dist_checkpoint, load_sharded, prepare_empty_dir,
    require_megatron_core, require_process_group, save_sharded, tensor_shapes,
)
from .torch_dist_keys import (
    McoreTarget, check_mcore_experts, check_spec, check_supported, extra_state_objects, mcore_target, our_name,
)
from .torch_dist_optim import (
    MAIN_PARAM_PREFIX, OptimizerPieces, check_optimizer_state, load_optimizer_state, optimizer_sharded_state,
)
from .torch_dist_shards import (
    LocalBlock, local_block, piece_values, plain_key_owners, put_piece, row_pieces, sharded_tensor,
)

__all__ = ["TorchDistMismatchError", "is_torch_dist_checkpoint", "load_torch_dist", "save_torch_dist"]

CONFIG_KEY = "megatron_fsdp_gpt_config"
"""``common.pt`` entry holding the saving model's ``GPTConfig`` as plain values."""


class TorchDistMismatchError(ValueError):
    """A torch_dist checkpoint does not fit the model (missing keys, shapes, architecture)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One of our state-dict tensors, where it goes, and this rank's block of it."""

    name: str
    target: McoreTarget
    block: LocalBlock


def _entries(state: dict[str, Any], cfg: GPTConfig, spec: str, *, loading: bool) -> list[Entry]:
    """Our state dict's tensors with their targets; a tied output layer only when loading
    (it reads the embedding's key)."""
    # Module extra states (TransformerEngine's FP8 metadata may be a tensor) are megatron-core's
    # ShardedObjects, written empty by _extra_states, never as weights.
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    check_mcore_experts([our_name(k) for k in tensors], cfg)
    owners = plain_key_owners(sorted(k for k, v in tensors.items() if not isinstance(v, DTensor)))
    entries = []
    for key, value in tensors.items():
        name = our_name(key)
        try:
            target = mcore_target(name, cfg, spec)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{key!r} has no megatron-core name ({exc}); torch_dist interop covers the embedded "
                             "GPT (megatron_fsdp.models.GPT) built from the config passed as config=") from exc
        if target is None and loading and name == "lm_head.weight":
            target = mcore_target("wte.weight", cfg, spec)
        if target is not None:
            entries.append(Entry(name, target, local_block(value, main_if_plain=owners.get(key, True), name=key)))
    return entries


def _sharded_model(entries: list[Entry], cfg: GPTConfig, *, loading: bool, prefix: str = "") -> dict[str, Any]:
    """``{piece id: ShardedTensor}`` of this rank's pieces (empty buffers when loading), keyed
    ``prefix + key`` in the checkpoint."""
    out = {}
    for entry in entries:
        for i, piece in enumerate(row_pieces(entry.target, entry.block, cfg)):
            values = None if loading else piece_values(entry.block.data, piece)
            out[f"{entry.name}/{i}"] = sharded_tensor(prefix + entry.target.key, entry.target, entry.block, piece,
                                                      values)
    return out


def _extra_states(cfg: GPTConfig, spec: str) -> dict[str, Any]:
    """megatron-core's per-module extra-state objects (empty: no FP8 metadata), from rank 0."""
    from megatron.core.dist_checkpointing import ShardedObject

    if dist.get_rank() != 0:
        return {}
    return {f"{o.key}/{'.'.join(map(str, o.offset))}": ShardedObject(o.key, None, o.shape, o.offset, replica_id=0)
            for o in extra_state_objects(cfg, spec)}


def plain_config(cfg: GPTConfig) -> dict[str, Any]:
    """``cfg`` as plain Python values (common.pt must unpickle without this package), which
    ``GPTConfig(**...)`` takes back."""
    return {f.name: (getattr(cfg, f.name).value if isinstance(getattr(cfg, f.name), enum.Enum)
                     else getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _default_args(cfg: GPTConfig) -> argparse.Namespace:
    """``cfg`` under Megatron-LM's argument names, for checkpoints saved without the caller's
    ``args``: the architecture fields Megatron-LM's ``check_checkpoint_args`` compares, at one
    tensor- and pipeline-parallel rank (a torch_dist checkpoint is independent of both)."""
    args = mcore_args(cfg)
    args.pipeline_model_parallel_size = 1
    args.add_position_embedding = cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE
    args.group_query_attention = cfg.num_query_groups != cfg.num_attention_heads
    return args


def save_torch_dist(model: nn.Module, ckpt_dir: str | os.PathLike, *, config: GPTConfig,
                    optimizer: Optional[torch.optim.Optimizer] = None, common_state: Optional[dict] = None,
                    spec: str = "te") -> None:
    """Write ``model`` (and ``optimizer``'s Adam state) to ``ckpt_dir`` as megatron-core's
    ``torch_dist`` checkpoint of a GPTModel with ``config``'s architecture and layer ``spec``
    (``"te"``: Megatron-LM's default TransformerEngine layers; ``"local"``). Collective: every
    rank calls it; each writes only the blocks it holds. ``common_state`` (picklable: Megatron-LM
    keeps ``args``, ``iteration``, ``rng_state``, ``opt_param_scheduler`` there) goes to
    ``common.pt``; ``args`` defaults to ``config`` under Megatron-LM's argument names."""
    require_megatron_core()
    require_process_group()
    check_spec(spec)
    check_supported(config)
    state = model.state_dict()
    entries = _entries(state, config, spec, loading=False)
    full: dict[str, Any] = {"model": {**_sharded_model(entries, config, loading=False), **_extra_states(config, spec)}}
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None:
        full["optimizer"] = optimizer_sharded_state(OptimizerPieces(model, optimizer, config, spec))
        # fully_reshardable's fp32 main weights: the model's own (this package keeps them fp32).
        full["optimizer"]["main_params"] = _sharded_model(entries, config, loading=False, prefix=MAIN_PARAM_PREFIX)
        content["distrib_optim_sharding_type"] = "fully_reshardable"
    common = dict(common_state or {})
    common.setdefault("args", _default_args(config))
    common.setdefault("checkpoint_version", 3.0)
    common[CONFIG_KEY] = plain_config(config)
    for key in common:
        if key in full:
            raise ValueError(f"common_state key {key!r} is reserved for the tensors; rename it")
    full.update(common)
    prepare_empty_dir(ckpt_dir)
    save_sharded(full, ckpt_dir, content)


# -- load ---------------------------------------------------------------------------------------
_ARCH_ARGS = {  # Megatron-LM argument -> GPTConfig field
    "num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size", "kv_channels": "kv_channels", "num_experts": "num_moe_experts",
    "padded_vocab_size": "vocab_size",
}


def _architecture_problems(common: dict[str, Any], cfg: GPTConfig) -> list[str]:
    """Fields where the checkpoint's saved architecture differs from ``cfg``."""
    saved = common.get(CONFIG_KEY)
    if isinstance(saved, dict):
        mine = plain_config(cfg)
        fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "kv_channels", "vocab_size", "num_moe_experts", "swiglu", "normalization",
                  "untie_embeddings_and_output_weights", "add_bias_linear", "qk_layernorm", "position_embedding_type")
        return [f"{f}: checkpoint {saved[f]!r}, model {mine[f]!r}" for f in fields
                if f in saved and saved[f] != mine[f]]
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        return []
    problems = [f"{arg} (GPTConfig.{field}): checkpoint {getattr(args, arg)!r}, model {getattr(cfg, field)!r}"
                for arg, field in _ARCH_ARGS.items()
                if getattr(args, arg, None) is not None and getattr(args, arg) != getattr(cfg, field)]
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", True) else None
    if groups is not None and groups != cfg.num_query_groups:
        problems.append(f"num_query_groups: checkpoint {groups!r}, model {cfg.num_query_groups!r}")
    return problems


def _check_fits(path, entries: list[Entry], common: dict[str, Any], cfg: GPTConfig) -> None:
    problems = _architecture_problems(common, cfg)
    if problems:
        raise TorchDistMismatchError(f"the torch_dist checkpoint {os.fspath(path)!r} was saved for another "
                                     "architecture: " + "; ".join(problems)
                                     + ". Build the model with the checkpoint's settings (config=)")
    stored = tensor_shapes(path)
    missing, shapes = [], []
    first: dict[str, Entry] = {}
    for e in entries:
        first.setdefault(e.target.key, e)  # one report per stored tensor (stacked layers share it)
    for entry in first.values():
        want = tuple(entry.target.counts) + entry.block.global_shape
        if entry.target.key not in stored:
            missing.append(f"{entry.target.key} (for {entry.name})")
        elif stored[entry.target.key] != want:
            shapes.append(f"{entry.target.key} (for {entry.name}): checkpoint {stored[entry.target.key]}, "
                          f"model {want}")
    if missing or shapes:
        raise TorchDistMismatchError(
            f"the torch_dist checkpoint {os.fspath(path)!r} does not fit the model: "
            + (f"missing {len(missing)} tensor(s): {', '.join(sorted(set(missing))[:8])}. " if missing else "")
            + (f"shape mismatch: {'; '.join(shapes[:8])}. " if shapes else "")
            + "Check config= against the run that wrote it (layers, heads, groups, experts, vocabulary padding, "
            "tied embeddings) and the layer spec (spec='te' or 'local')")


def load_torch_dist(model: nn.Module, ckpt_dir: str | os.PathLike, *, config: GPTConfig,
                    optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True,
                    spec: str = "te") -> dict[str, Any]:
    """Load a ``torch_dist`` checkpoint (Megatron-LM's or ``save_torch_dist``'s) into ``model``
    (and ``optimizer``), whatever layout either side has; returns the common state
    (``args``, ``iteration``, ...). Collective. Everything is checked (keys, shapes, the saved
    architecture, the optimizer state's presence) before any weight changes. ``strict=False``
    leaves the model's tensors the checkpoint lacks as they are instead of raising. ``spec``
    names the layer spec the checkpoint was written with (only an MoE layer's pre-MLP norm
    differs; the other spec's key is tried when the named one is absent)."""
    require_megatron_core()
    require_process_group()
    check_spec(spec)
    check_supported(config)
    check_readable(ckpt_dir)
    common = common_state(ckpt_dir)
    state = model.state_dict()
    entries = _entries(state, config, spec, loading=True)
    entries = _with_other_spec_names(entries, ckpt_dir, config, spec)
    if not strict:
        stored = tensor_shapes(ckpt_dir)
        entries = [e for e in entries if e.target.key in stored]
    _check_fits(ckpt_dir, entries, common, config)
    if optimizer is not None:
        check_optimizer_state(ckpt_dir, common)
        entries = _from_main_params(entries, ckpt_dir)
    request = {"model": _sharded_model(entries, config, loading=True)}
    pieces = OptimizerPieces(model, optimizer, config, spec) if optimizer is not None else None
    if pieces is not None:
        request["optimizer"] = {"param_state": pieces.sharded(loading=True)}
    loaded = load_sharded(request, ckpt_dir)
    for entry in entries:
        for i, piece in enumerate(row_pieces(entry.target, entry.block, config)):
            put_piece(entry.block.data, piece, loaded["model"][f"{entry.name}/{i}"])
    model.load_state_dict(state)
    if pieces is not None:
        load_optimizer_state(optimizer, pieces, loaded["optimizer"], common)
    return common


def _with_other_spec_names(entries: list[Entry], path, cfg: GPTConfig, spec: str) -> list[Entry]:
    """Entries whose key is absent under ``spec`` but present under the other spec's name."""
    stored = tensor_shapes(path)
    other = "local" if spec == "te" else "te"
    out = []
    for entry in entries:
        if entry.target.key not in stored:
            alternative = mcore_target(entry.name, cfg, other)
            if alternative is not None and alternative.key in stored:
                entry = dataclasses.replace(entry, target=alternative)
        out.append(entry)
    return out


def _from_main_params(entries: list[Entry], path) -> list[Entry]:
    """With the optimizer: each weight read from the checkpoint's fp32 main copy
    (``optimizer.state.param.<key>``) where it has one, as Megatron-LM resumes its
    distributed optimizer (its model tensors may be bf16 roundings of those)."""
    stored = tensor_shapes(path)
    out = []
    for entry in entries:
        main = MAIN_PARAM_PREFIX + entry.target.key
        if stored.get(main) == stored.get(entry.target.key):
            entry = dataclasses.replace(entry, target=dataclasses.replace(entry.target, key=main))
        out.append(entry)
    return out
