"""Hugging Face checkpoints into and out of a model: plain, or wrapped by this package
(``fully_shard_model`` / ``MegatronFSDP``, ``experimental.fully_shard``) at any world size.

``load_hf_checkpoint``: the model's own state dict says what each rank keeps (a whole tensor,
or the box of a DTensor: hf_slices.py, [Note: local boxes]); each rank reads just that box
from the memory-mapped files, builds a value of the same layout and hands it to the model's
``load_state_dict``. Everything is checked before the first byte is read and the model is
only touched by that final load, so a failure leaves it as it was.

``save_hf_checkpoint``: the state dict's values are gathered one of our tensors at a time
(``full_tensor()``, collective), cut into the checkpoint's tensors per the map and queued by
rank 0 into size-capped shards (safetensors_io.py); rank 0 writes ``config.json``,
``generation_config.json`` and the tokenizer's files.

[Note: dtype rule] A checkpoint tensor stored in another dtype than the model's state-dict
value is an error unless ``dtype=`` is given: then everything read is converted to ``dtype``
(and the model's own load casts to its storage). Saving writes the model's dtype, or
``dtype`` when given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..models.config import GPTConfig
from ..state import torch_key
from .hf_config import HFFamily, check_gpt_config_against_hf, hf_config_from_gpt, read_hf_config
from .hf_names import NameMap, gpt_name_map, identity_name_map
from .hf_slices import expected_hf_shape, hf_name_in, local_box, read_box
from .safetensors_io import ReadStats, SafetensorsReader, SafetensorsWriter

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
_WRAPPER_PREFIX = "module."


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint does not fit the model (missing, unused or misshapen tensors, dtype)."""


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What ``load_hf_checkpoint`` did on this rank."""

    loaded: tuple[str, ...]
    """Our state-dict names filled from the checkpoint (tied names included)."""
    kept: tuple[str, ...]
    """Our names left as they were: buffers the map does not cover, and (``strict=False``) parameters."""
    unused: tuple[str, ...]
    """Checkpoint tensors nothing read (``strict=False``, or the map's optional ones)."""
    padded_rows: int
    """Vocabulary padding rows set to zero on this rank."""
    read: ReadStats
    """Slices, rows and bytes this rank read from the files."""


# -- the model's state dict -------------------------------------------------------------------
def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model) if isinstance(getattr(model, "module", None), torch.nn.Module) else model


def _named_state(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, Any]]:
    """(our name -> the model's state-dict key, the state dict). Names drop the wrapper's
    ``module.`` prefix and torch's checkpoint-wrapper segment."""
    state = model.state_dict()
    strip = _inner(model) is not model and all(k.startswith(_WRAPPER_PREFIX) for k in state)
    return {torch_key(k[len(_WRAPPER_PREFIX):] if strip else k): k for k in state}, state


def _tied_groups(names: Mapping[str, str], state: Mapping[str, Any]) -> dict[str, str]:
    """Our name -> the first name holding the same value object (tied weights), for names
    that are not first."""
    first: dict[int, str] = {}
    tied = {}
    for name, key in names.items():
        owner = first.setdefault(id(state[key]), name)
        if owner != name:
            tied[name] = owner
    return tied


def _gpt_config(model: torch.nn.Module, config: Optional[GPTConfig]) -> Optional[GPTConfig]:
    if config is not None:
        return config
    found = getattr(_inner(model), "config", None)
    return found if isinstance(found, GPTConfig) else None


def _buffer_names(model: torch.nn.Module, names: Iterable[str] = ()) -> set[str]:
    """Our names that are no parameters: buffers and modules' extra state (kept as they are)."""
    extra = {n for n in names if n.endswith("_extra_state")}
    return {torch_key(n) for n, _ in _inner(model).named_buffers()} | extra


# -- load ---------------------------------------------------------------------------------------
def _resolve_load_map(model, hf_dir: str, name_map: Optional[NameMap], config: Optional[GPTConfig],
                      names: Mapping[str, str], state: Mapping[str, Any]) -> NameMap:
    hf = read_hf_config(hf_dir) if os.path.isfile(os.path.join(hf_dir, "config.json")) else None
    cfg = _gpt_config(model, config)
    if name_map is None and cfg is not None:
        if hf is None:
            raise HFCheckpointError(f"no config.json in {hf_dir!r}: the embedded GPT's map needs the checkpoint's "
                                    "family and vocabulary; pass name_map=gpt_name_map(cfg, family, vocab_size=...)")
        check_gpt_config_against_hf(cfg, hf)
        name_map = gpt_name_map(cfg, HFFamily.from_hf_config(hf), vocab_size=hf["vocab_size"])
    if name_map is None:
        buffers = _buffer_names(model, names)
        tied = _tied_groups(names, state)
        name_map = identity_name_map([n for n in names if n not in buffers], tied=tied)
    family = getattr(name_map, "family", None)
    if family is not None and hf is not None and HFFamily.from_hf_config(hf) is not family:
        raise HFCheckpointError(f"the name map is {family.value}'s, the checkpoint in {hf_dir!r} is "
                                f"{HFFamily.from_hf_config(hf).value}'s; build the map for the checkpoint's family")
    return name_map


def _check_dtype(name: str, stored: torch.dtype, ours: torch.dtype, dtype: Optional[torch.dtype]) -> Optional[str]:
    if dtype is None and stored != ours:
        return (f"{name} is stored as {stored}, the model holds {ours}; pass dtype={ours} to convert "
                "(load_hf_checkpoint never changes precision unasked)")
    return None


def _validate(reader: SafetensorsReader, name_map: NameMap, names: Mapping[str, str], state: Mapping[str, Any],
              dtype: Optional[torch.dtype], strict: bool, buffers: set[str]) -> tuple[list[str], list[str]]:
    """Every problem at once, before any read: (kept names, unused checkpoint tensors)."""
    problems, used = [], set()
    unknown = [n for n in name_map.entries if n not in names]
    if unknown:
        problems.append(f"the map names tensors the model does not have: {unknown[:8]}")
    for name in name_map.entries:
        if name not in names:
            continue
        value = state[names[name]]
        try:
            spans = name_map.spans(name, value.shape[0] if value.dim() else 1)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        for piece, first, last in spans:
            file_name = hf_name_in(reader, name_map, piece.hf_name)
            if file_name is None:
                problems.append(f"missing tensor {piece.hf_name} (for {name})")
                continue
            used.add(file_name)
            want = expected_hf_shape(last - first, piece.transposed, tuple(value.shape)) if value.dim() else ()
            if reader.shape(file_name) != want:
                problems.append(f"shape mismatch for {file_name}: checkpoint {reader.shape(file_name)}, "
                                f"the model's {name} needs {want}")
            dtype_problem = _check_dtype(file_name, reader.dtype(file_name), value.dtype, dtype)
            if dtype_problem:
                problems.append(dtype_problem)
    tied = {n for n in names if n in name_map.tied}
    kept = [n for n in names if n not in name_map.entries and n not in tied]
    uncovered = [n for n in kept if n not in buffers]
    optional = {hf_name_in(reader, name_map, n) for n in name_map.optional_hf}
    unused = [n for n in reader.keys() if n not in used and n not in optional]
    if strict and uncovered:
        problems.append(f"model tensors the map does not cover: {uncovered} (strict=False keeps their values)")
    if strict and unused:
        problems.append(f"checkpoint tensors the map leaves unused: {unused} (strict=False ignores them)")
    if problems:
        raise HFCheckpointError("cannot load the Hugging Face checkpoint (nothing was loaded): " + "; ".join(problems))
    return kept, unused + sorted(n for n in optional if n is not None)


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``value`` holds its data: a DTensor of the same mesh and placements, or a plain tensor."""
    if not isinstance(value, DTensor):
        return local.to(value.device)
    local = local.to(value.to_local().device)
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


@torch.no_grad()
def is_hf_directory(path: Optional[str | os.PathLike]) -> bool:
    """A ``transformers`` model directory: ``config.json`` and safetensors weights (one file,
    shards, or the index of a sharded one)."""
    if not path:
        return False
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, "config.json")) and (
        any(name.endswith(".safetensors") for name in os.listdir(path))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str | os.PathLike, *, name_map: Optional[NameMap] = None,
                       config: Optional[GPTConfig] = None, dtype: Optional[torch.dtype] = None,
                       strict: bool = True) -> LoadReport:
    """Load a Hugging Face directory into ``model`` (see the module docstring). The map is
    ``name_map``, else the embedded GPT's for ``config`` (or the model's own ``config``)
    checked against ``config.json``, else the identity (a wrapped ``transformers`` model).
    ``dtype``: convert what is read ([Note: dtype rule]). ``strict``: every model tensor
    covered and every checkpoint tensor used. Collective when the model is distributed."""
    hf_dir = os.fspath(hf_dir)
    names, state = _named_state(model)
    name_map = _resolve_load_map(model, hf_dir, name_map, config, names, state)
    buffers = _buffer_names(model, names)
    with SafetensorsReader(hf_dir) as reader:
        kept, unused = _validate(reader, name_map, names, state, dtype, strict, buffers)
        loaded, values, padded = [], {}, 0
        for name in name_map.entries:  # the same order on every rank (non-standard boxes are collective)
            value = state[names[name]]
            local, rows = read_box(reader, name_map, name, local_box(value), dtype or value.dtype)
            values[names[name]] = _like(value, local)
            loaded.append(name)
            padded += rows
        for name, target in name_map.tied.items():
            if name in names:
                values[names[name]] = values[names[target]]
                loaded.append(name)
        for name in kept:
            values[names[name]] = state[names[name]]
        model.load_state_dict(values, strict=True)
        stats = dataclasses.replace(reader.stats)
    if unused:
        logger.info("load_hf_checkpoint: checkpoint tensors not read: %s", unused)
    return LoadReport(loaded=tuple(loaded), kept=tuple(kept), unused=tuple(unused), padded_rows=padded, read=stats)


# -- save ---------------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a state-dict value (collective for a sharded DTensor)."""
    if not isinstance(value, DTensor):
        return value
    return value.full_tensor()


def _resolve_save(model, name_map, config, family, hf_config, names, state) -> tuple[NameMap, Optional[dict]]:
    """The map and the ``config.json`` to write (``None``: none known)."""
    cfg = _gpt_config(model, config)
    if cfg is not None and (family is not None or hf_config is not None):
        family = HFFamily(family) if family is not None else HFFamily.from_hf_config(hf_config)
        vocab = hf_config["vocab_size"] if hf_config and "vocab_size" in hf_config else cfg.vocab_size
        ours = hf_config_from_gpt(cfg, family, vocab_size=vocab)
        keep = {k: v for k, v in (hf_config or {}).items() if k not in ours and not k.startswith("_")}
        return name_map or gpt_name_map(cfg, family, vocab_size=vocab), {**keep, **ours}
    if cfg is not None and name_map is None:
        raise HFCheckpointError("saving the embedded GPT needs its Hugging Face family: pass family=HFFamily.LLAMA "
                                "(or another) or hf_config= (the config.json it was loaded from)")
    if name_map is None:
        buffers = _buffer_names(model, names)
        name_map = identity_name_map([n for n in names if n not in buffers], tied=_tied_groups(names, state))
    if hf_config is None:  # a transformers model knows its own
        own = getattr(_inner(model), "config", None)
        if hasattr(own, "to_dict"):
            hf_config = own.to_dict()
            hf_config["architectures"] = hf_config.get("architectures") or [_user_class(_inner(model)).__name__]
    return name_map, hf_config


def _user_class(module: torch.nn.Module) -> type:
    """The model's own class: ``experimental.fully_shard`` gives a sharded module a subclass
    of this package's (``ExperimentalFsdp<Name>``), which transformers would not know."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("megatron_fsdp"))


def _write_side_files(out_dir: str, hf_config: Optional[dict], dtype: Optional[torch.dtype],
                      tokenizer_dir: Optional[str]) -> None:
    if hf_config is not None:
        config = dict(hf_config)
        if dtype is not None:
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        tokens = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        if tokens:
            with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as handle:
                json.dump({**tokens, "_from_model_config": True}, handle, indent=2)
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            source = os.path.join(tokenizer_dir, file)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(out_dir, file))


@torch.no_grad()
def save_hf_checkpoint(model: torch.nn.Module, out_dir: str | os.PathLike, *, name_map: Optional[NameMap] = None,
                       config: Optional[GPTConfig] = None, family: Optional[HFFamily] = None,
                       hf_config: Optional[dict] = None, tokenizer_dir: Optional[str] = None,
                       max_shard_size: int | str = "5GB", dtype: Optional[torch.dtype] = None) -> list[str]:
    """Write ``model`` as a Hugging Face directory ``transformers`` loads (see the module
    docstring): for the embedded GPT pass ``family`` (or ``hf_config``, the ``config.json`` it
    came from, whose other fields are kept); a wrapped ``transformers`` model needs neither.
    ``dtype``: the dtype written (default the model's). Collective when the model is
    distributed; returns the shard files on rank 0 ([] elsewhere)."""
    out_dir = os.fspath(out_dir)
    names, state = _named_state(model)
    name_map, hf_out = _resolve_save(model, name_map, config, family, hf_config, names, state)
    missing = [n for n in name_map.entries if n not in names]
    if missing:
        raise HFCheckpointError(f"the map names tensors the model does not have: {missing[:8]}; build the map for "
                                "this model (gpt_name_map for its config, identity_name_map for its own names)")
    writing = _rank() == 0
    writer = SafetensorsWriter(out_dir, max_shard_size=max_shard_size) if writing else None
    written_dtype = dtype
    for name in name_map.entries:  # one of our tensors whole at a time, the same order on every rank
        value = _full(state[names[name]])
        written_dtype = written_dtype or value.dtype
        if writer is None:
            continue
        for piece, first, last in name_map.spans(name, value.shape[0] if value.dim() else 1):
            part = value[first:last] if value.dim() else value
            part = part.t() if piece.transposed else part
            writer.add(piece.hf_name, part.to(dtype) if dtype is not None else part)
        del value
    files: list[str] = []
    if writer is not None:
        files = writer.close()
        _write_side_files(out_dir, hf_out, written_dtype, tokenizer_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return files
