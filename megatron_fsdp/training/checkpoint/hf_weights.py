"""Hugging Face weights in the launcher: a ``transformers`` model directory read by ``--load``
(or Megatron-LM's ``--pretrained-checkpoint``) and written by ``--export-hf-dir``, through the
library's ``load_hf_checkpoint`` / ``save_hf_checkpoint`` (``megatron_fsdp.interop``).

Reading starts a fine-tune: the weights only, at iteration 0, with a fresh optimizer and
schedule (Megatron-LM's ``--finetune``, which its ``--pretrained-checkpoint`` implies). The
architecture flags are checked against ``config.json`` first (a mismatch names the field),
and each rank reads only the slices it keeps. Writing gathers one tensor at a time; rank 0
writes the shards, ``config.json`` (the one read, if the run started from one, else the
family's for the flags) and the tokenizer files of a ``HuggingFaceTokenizer`` run.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from megatron_fsdp.interop.hf_checkpoint import is_hf_directory, load_hf_checkpoint, save_hf_checkpoint
from megatron_fsdp.interop.hf_config import (
    HFFamily, check_gpt_config_against_hf, gpt_config_from_hf, hf_family_for, read_hf_config,
)
from megatron_fsdp.models.gpt import GPTConfig

__all__ = ["export_hf", "hf_problems", "is_hf_directory", "load_hf_weights"]

logger = logging.getLogger(__name__)


def hf_problems(args) -> list[str]:
    """What the Hugging Face paths cannot run with (validation, before any process group)."""
    problems = []
    sources = [p for p in (args.load, getattr(args, "pretrained_checkpoint", None)) if is_hf_directory(p)]
    for label, active in (("a Hugging Face directory as --load/--pretrained-checkpoint", bool(sources)),
                          ("--export-hf-dir", bool(args.export_hf_dir))):
        if not active:
            continue
        if args.use_mcore_models:
            problems.append(f"{label} with --use-mcore-models: the launcher maps Hugging Face names onto the embedded "
                            "GPT only; drop --use-mcore-models, or convert the directory with python -m "
                            "megatron_fsdp.convert --output-format torch_dist and load that")
        if args.expert_model_parallel_size > 1:
            problems.append(f"{label} with --expert-model-parallel-size {args.expert_model_parallel_size}: experts "
                            "split over expert-parallel ranks are not read or written from Hugging Face files here; "
                            "run at --expert-model-parallel-size 1, or convert with python -m megatron_fsdp.convert")
    if args.export_hf_family is not None and args.export_hf_family not in [f.value for f in HFFamily]:
        problems.append(f"--export-hf-family {args.export_hf_family!r} is not one of "
                        f"{', '.join(f.value for f in HFFamily)}")
    return problems


def load_hf_weights(model: nn.Module, hf_dir: str, config: GPTConfig) -> None:
    """Read ``hf_dir`` into ``model`` (plain or wrapped) after checking ``config`` against its
    ``config.json``; collective."""
    check_gpt_config_against_hf(config, read_hf_config(hf_dir))
    report = load_hf_checkpoint(model, hf_dir, config=config)
    logger.info("> loaded Hugging Face weights from %s (%d tensors, %d bytes read on this rank): iteration, "
                "optimizer and schedule start fresh, as with --finetune", hf_dir, len(report.loaded),
                report.read.bytes)


def export_hf(model: nn.Module, out_dir: str, config: GPTConfig, *, source: Optional[str],
              family: Optional[str], tokenizer_dir: Optional[str]) -> None:
    """Write ``model`` to ``out_dir`` as a ``transformers`` directory (collective). ``source``:
    the Hugging Face directory the run started from (its ``config.json`` and vocabulary are
    kept); ``family`` overrides the one inferred from the flags."""
    hf_config = read_hf_config(source) if is_hf_directory(source) else None
    if hf_config is not None:
        chosen = HFFamily(family) if family else gpt_config_from_hf(hf_config)[1]
    else:
        chosen = HFFamily(family) if family else hf_family_for(config)
    save_hf_checkpoint(model, out_dir, config=config, family=chosen, hf_config=hf_config,
                       tokenizer_dir=tokenizer_dir or (source if hf_config is not None else None))
    logger.info("> exported the model as a Hugging Face %s directory to %s", chosen.value, out_dir)
