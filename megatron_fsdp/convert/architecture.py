"""The model a checkpoint holds: its ``GPTConfig`` (and Hugging Face family), read from the
checkpoint itself.

- ``hf``: ``config.json`` (``gpt_config_from_hf``).
- ``torch_dist``: the configuration ``save_torch_dist`` keeps in ``common.pt``.
- ``fsdp_dtensor`` / ``torch``: the configuration the converter keeps there (``CONFIG_KEY``, as in
  ``common.pt``), else the launcher's flags the checkpoint keeps (``args``: the plain-valued ones in
  ``extra_state_rank0.pt``, Megatron-LM's ``args`` in ``model_optim_rng.pt``), through the
  launcher's own ``gpt_config_from_args``.

A checkpoint without any of these (one Megatron-LM wrote in ``torch_dist``, or an older one)
takes the launcher's model flags instead (``--model-flags``).

[Note: saved args and the launcher's defaults] Saved args written by the launcher hold every
flag, derived values included (``padded_vocab_size``). Megatron-LM's own ``args`` (or an older
launcher's) may lack flags the launcher added; those take the launcher's defaults, which are
Megatron-LM's behaviour where it has no flag, and the filled architecture flags are logged. The
sizes (``_SIZES``) never come from defaults: without them the checkpoint does not say its model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import shlex
from typing import Any, Optional

import torch

from megatron_fsdp.interop.hf_config import HFFamily, gpt_config_from_hf, read_hf_config
from megatron_fsdp.interop.torch_dist import CONFIG_KEY
from megatron_fsdp.interop.torch_dist_io import common_state
from megatron_fsdp.models.gpt import GPTConfig
from megatron_fsdp.state import EXTRA_STATE_FILE
from megatron_fsdp.training.args.arguments import parse_args
from megatron_fsdp.training.checkpoint.torch_checkpoint import model_file, plain_args
from megatron_fsdp.training.model_setup import MODEL_FLAG_FIELDS, gpt_config_from_args

from .formats import CheckpointFormat, Located

__all__ = ["ArchitectureError", "Source", "read_source"]


logger = logging.getLogger(__name__)

_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
          "max_position_embeddings")
"""The saved args every conversion needs ([Note: saved args and the launcher's defaults])."""
_DATA_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1", "--train-iters", "1",
               "--lr", "0"]
"""What ``parse_args`` needs besides the model (a data source, a schedule): placeholders."""


class ArchitectureError(ValueError):
    """The checkpoint does not say which model it holds, or no Hugging Face family fits it."""


@dataclasses.dataclass(frozen=True)
class Source:
    """What was read about the input checkpoint's model."""

    config: GPTConfig
    family: Optional[HFFamily]
    """The Hugging Face family (``hf`` input), else None (``hf_family_for`` picks one for ``hf`` output)."""
    hf_config: Optional[dict]
    """The input's ``config.json`` (its other fields are kept when writing ``hf``)."""
    args: dict[str, Any]
    """Plain-valued launcher flags describing the model (kept in the Megatron-style outputs)."""


def _from_flags(flags: str) -> tuple[GPTConfig, dict[str, Any]]:
    """The launcher's model flags (a data source is needed to parse: mock data stands in)."""
    argv = shlex.split(flags)
    if "--vocab-size" not in argv and "--mock-data" not in argv:
        raise ArchitectureError("--model-flags must give the vocabulary (--vocab-size N, as the checkpoint's "
                                "padded vocabulary) besides the architecture flags")
    args = parse_args(argv + _DATA_FLAGS + ["--make-vocab-size-divisible-by", "1"], world_size=1)
    return gpt_config_from_args(args), plain_args(args)


def _saved_state(located: Located) -> dict[str, Any]:
    """What a Megatron-style checkpoint keeps besides the tensors: the fsdp_dtensor extra
    state, the torch file's entries (its model too: memory-mapped), torch_dist's common.pt."""
    if located.format is CheckpointFormat.FSDP_DTENSOR:
        extra = torch.load(os.path.join(located.data_dir, EXTRA_STATE_FILE.format(rank=0)), weights_only=True)
        return extra if isinstance(extra, dict) else {}
    if located.format is CheckpointFormat.TORCH:
        return torch.load(model_file(located.root, located.iteration), weights_only=False, mmap=True)
    return common_state(located.data_dir)


def _saved_args(saved: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The launcher flags a Megatron-style checkpoint keeps, or None."""
    args = saved.get("args")
    if isinstance(args, argparse.Namespace):
        return plain_args(args)
    return args if isinstance(args, dict) and args else None


@functools.lru_cache(maxsize=1)
def _launcher_defaults() -> tuple[tuple[str, Any], ...]:
    """Every plain-valued flag at the launcher's default (the sizes are placeholders, never used)."""
    sizes = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--seq-length", "8",
             "--max-position-embeddings", "8", "--vocab-size", "8"]
    return tuple(plain_args(parse_args(sizes + _DATA_FLAGS, world_size=1)).items())


def _completed_args(located: Located, args: dict[str, Any]) -> argparse.Namespace:
    """The saved args with the launcher's defaults for flags they lack ([Note: saved args and
    the launcher's defaults])."""
    absent = [name for name in _SIZES if args.get(name) is None]
    if absent:
        raise ArchitectureError(f"{located.data_dir}: the saved args lack {absent}; give the model with "
                                "--model-flags '...' (the launcher's architecture flags)")
    defaults = dict(_launcher_defaults())
    filled = sorted({f.dest for f in MODEL_FLAG_FIELDS} - set(args))
    if filled:
        logger.info("%s: the saved args lack %s; the launcher's defaults stand in %s", located.data_dir, filled,
                    {name: defaults.get(name) for name in filled})
    return argparse.Namespace(**{**defaults, **args})


def _megatron_config(located: Located, saved: dict[str, Any], args: Optional[dict[str, Any]]) -> Optional[GPTConfig]:
    if saved.get(CONFIG_KEY):
        return GPTConfig(**saved[CONFIG_KEY])
    if args is None:
        return None
    return gpt_config_from_args(_completed_args(located, args))


def read_source(located: Located, model_flags: Optional[str] = None) -> Source:
    """The input's model: from ``model_flags`` when given, else from the checkpoint."""
    if located.format is CheckpointFormat.HF:
        hf_config = read_hf_config(located.data_dir)
        config, family = gpt_config_from_hf(hf_config)
        return Source(config, family, hf_config, {})
    if model_flags:
        config, args = _from_flags(model_flags)
        return Source(config, None, None, args)
    saved = _saved_state(located)
    args = _saved_args(saved)
    config = _megatron_config(located, saved, args)
    if config is None:
        raise ArchitectureError(
            f"{located.data_dir} ({located.format.value}) does not record its model (no launcher args or "
            "configuration in it: Megatron-LM wrote it, or an older version); give it with --model-flags "
            "'--num-layers ... --hidden-size ... --vocab-size ...' (the launcher's flags)")
    return Source(config, None, None, args or {})
