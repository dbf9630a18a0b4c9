"""``python -m megatron_fsdp.convert`` (the ``megatron-fsdp-convert`` command).

    python -m megatron_fsdp.convert --input hf_llama/ --output ckpt/ --output-format fsdp_dtensor
    torchrun --nproc-per-node 8 -m megatron_fsdp.convert --input ckpt/ --output out/ --output-format hf

The input format is detected (``--input-format`` checks it instead), the model read from the
checkpoint (``--model-flags`` when it does not say). One process holds the whole model;
under ``torchrun`` each rank holds and reads a ZeRO-3 share. An hf output takes its family from
``--family``, else ``--hf-config`` / the input's ``config.json``, else the architecture
(``hf_family_for``). Weights only: optimizer state is not converted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fsdp.interop.hf_checkpoint import HFCheckpointError
from megatron_fsdp.interop.hf_config import (
    HFConfigMismatch, HFConfigUnsupported, HFFamily, hf_config_from_gpt, hf_family_for, read_hf_config,
)
from megatron_fsdp.interop.torch_dist import TorchDistMismatchError
from megatron_fsdp.interop.torch_dist_keys import check_supported
from megatron_fsdp.models import vocab_size_with_padding

from .architecture import ArchitectureError, Source, read_source
from .formats import CheckpointFormat, Located, UnknownFormatError, locate
from .model_io import build_model, read_into, write_from

__all__ = ["ConversionError", "check_target", "convert", "main", "parse"]

logger = logging.getLogger("megatron_fsdp.convert")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FORMATS = [f.value for f in CheckpointFormat]


class ConversionError(ValueError):
    """A request the converter refuses before reading anything (the remedy is in the message)."""


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-fsdp-convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="checkpoint directory (a Megatron-LM root, iter_*, or HF)")
    p.add_argument("--output", required=True, help="directory to write (empty or absent unless --overwrite)")
    p.add_argument("--output-format", required=True, choices=_FORMATS)
    p.add_argument("--input-format", choices=_FORMATS, help="check the detected format is this one")
    p.add_argument("--iteration", type=int, help="which iter_* of a Megatron-LM root (default: the tracker's)")
    p.add_argument("--family", choices=[f.value for f in HFFamily],
                   help="Hugging Face family of an hf output (default: --hf-config's, the input's, else inferred "
                        "from the architecture)")
    p.add_argument("--hf-config", help="config.json (or its directory) an hf output starts from: its family, "
                                       "unpadded vocabulary and token ids are kept")
    p.add_argument("--model-flags", help="the launcher's architecture flags, for a checkpoint that records none")
    p.add_argument("--tokenizer-dir", help="tokenizer files copied into an hf output (default: an hf input's)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="dtype of an hf output's tensors (default: kept)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
    p.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="pad an hf input's vocabulary to a multiple of this in a Megatron-format output, as the "
                        "launcher's flag of that name pads it (default: kept as it is)")
    return p.parse_args(argv)


def _check_request(args: argparse.Namespace) -> None:
    if os.path.isdir(args.output) and os.listdir(args.output) and not args.overwrite:
        raise ConversionError(f"--output {args.output} exists and is not empty; give an empty directory or add "
                              "--overwrite")
    if os.path.abspath(args.output) == os.path.abspath(args.input):
        raise ConversionError("--output is --input; write the conversion to another directory")
    if args.dtype and args.output_format != CheckpointFormat.HF.value:
        raise ConversionError(f"--dtype applies to --output-format hf (safetensors); {args.output_format} keeps the "
                              "fp32 weights the launcher trains")
    if args.hf_config and args.output_format != CheckpointFormat.HF.value:
        raise ConversionError(f"--hf-config applies to --output-format hf; drop it for {args.output_format}")
    if args.hf_config and not os.path.exists(args.hf_config):
        raise ConversionError(f"--hf-config {args.hf_config}: no such file or directory; give a config.json or "
                              "the Hugging Face directory holding one")


def _join_process_group() -> bool:
    """Join torchrun's group, or a one-rank gloo group for a plain run; True when created here."""
    if dist.is_initialized():
        return False
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return True


def _hf_target(args: argparse.Namespace, source: Source) -> tuple[HFFamily, Optional[dict]]:
    """The family and ``config.json`` an hf output is written with, checked to hold the model
    before anything is read ([Note: refuse before reading])."""
    hf_config = read_hf_config(args.hf_config) if args.hf_config else source.hf_config
    if args.family:
        family = HFFamily(args.family)
    elif hf_config is not None:
        family = HFFamily.from_hf_config(hf_config)
    else:
        family = hf_family_for(source.config)
    vocab = hf_config.get("vocab_size") if hf_config else None
    hf_config_from_gpt(source.config, family, vocab_size=vocab)  # raises HFConfigMismatch naming the fields
    return family, hf_config


def _padded(source: Source, located: Located, args: argparse.Namespace) -> Source:
    """``--make-vocab-size-divisible-by``: an hf input's vocabulary padded as the launcher pads
    it, so that a run with the same flag loads the Megatron-format output (the reader pads)."""
    multiple = args.make_vocab_size_divisible_by
    if multiple is None:
        return source
    if located.format is not CheckpointFormat.HF or args.output_format == CheckpointFormat.HF.value or multiple <= 0:
        raise ConversionError(f"--make-vocab-size-divisible-by {multiple} pads the vocabulary of an hf input in a "
                              "Megatron-format output (a positive multiple); drop it for this conversion")
    vocab = vocab_size_with_padding(source.hf_config["vocab_size"], multiple)
    return dataclasses.replace(source, config=dataclasses.replace(source.config, vocab_size=vocab))


def check_target(out_format: CheckpointFormat, source: Source) -> None:
    """[Note: refuse before reading] What the output format cannot carry is refused from the
    configuration alone, so a failed conversion leaves no half-written output behind."""
    if out_format is CheckpointFormat.TORCH_DIST:
        try:
            check_supported(source.config)
        except ValueError as exc:
            raise ConversionError(f"--output-format torch_dist cannot hold this model: {exc}") from None


def convert(args: argparse.Namespace) -> str:
    """Read ``--input`` and write ``--output``; returns a one-line summary."""
    _check_request(args)
    expected = CheckpointFormat(args.input_format) if args.input_format else None
    located = locate(args.input, iteration=args.iteration, expected=expected)
    source = _padded(read_source(located, args.model_flags), located, args)
    out_format = CheckpointFormat(args.output_format)
    family, hf_config = None, source.hf_config
    if out_format is CheckpointFormat.HF:
        family, hf_config = _hf_target(args, source)
    check_target(out_format, source)
    tokenizer_dir = args.tokenizer_dir or (located.data_dir if located.format is CheckpointFormat.HF else None)
    model = build_model(source)
    read_into(model, located, source)
    write_from(model, args.output, out_format, located, dataclasses.replace(source, hf_config=hf_config),
               family=family, tokenizer_dir=tokenizer_dir, dtype=_DTYPES.get(args.dtype))
    return (f"converted {located.format.value} {located.data_dir} (iteration {located.iteration}) -> "
            f"{out_format.value} {args.output} on {dist.get_world_size()} rank(s)")


_REFUSALS = (ConversionError, UnknownFormatError, ArchitectureError, HFConfigMismatch, HFConfigUnsupported,
             HFCheckpointError, TorchDistMismatchError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    created = _join_process_group()
    try:
        summary = convert(args)
    except _REFUSALS as exc:
        if dist.get_rank() == 0:
            print(f"megatron-fsdp-convert: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if created:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary)
    return 0
