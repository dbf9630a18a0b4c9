"""``python -m megatron_fsdp.convert`` (the ``megatron-fsdp-convert`` command).

    python -m megatron_fsdp.convert --input hf_llama/ --output ckpt/ --output-format fsdp_dtensor
    torchrun --nproc-per-node 8 -m megatron_fsdp.convert --input ckpt/ --output out/ --output-format hf

The input format is detected (``--input-format`` checks it instead), the model read from the
checkpoint (``--model-flags`` when it does not say). One process holds the whole model;
under ``torchrun`` each rank holds and reads a ZeRO-3 share.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fsdp.interop.hf_checkpoint import HFCheckpointError
from megatron_fsdp.interop.hf_config import HFConfigMismatch, HFConfigUnsupported, HFFamily, hf_family_for
from megatron_fsdp.interop.torch_dist import TorchDistMismatchError

from .architecture import ArchitectureError, read_source
from .formats import CheckpointFormat, UnknownFormatError, locate
from .model_io import build_model, read_into, write_from

__all__ = ["ConversionError", "main", "parse"]

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
                   help="Hugging Face family of an hf output (default: the input's, else inferred)")
    p.add_argument("--model-flags", help="the launcher's architecture flags, for a checkpoint that records none")
    p.add_argument("--tokenizer-dir", help="tokenizer files copied into an hf output (default: an hf input's)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="dtype of an hf output's tensors (default: kept)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
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


def _join_process_group() -> bool:
    """Join torchrun's group, or a one-rank gloo group for a plain run; True when created here."""
    if dist.is_initialized():
        return False
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return True


def convert(args: argparse.Namespace) -> str:
    """Read ``--input`` and write ``--output``; returns a one-line summary."""
    _check_request(args)
    expected = CheckpointFormat(args.input_format) if args.input_format else None
    located = locate(args.input, iteration=args.iteration, expected=expected)
    source = read_source(located, args.model_flags)
    out_format = CheckpointFormat(args.output_format)
    family = None
    if out_format is CheckpointFormat.HF:
        family = HFFamily(args.family) if args.family else source.family or hf_family_for(source.config)
    tokenizer_dir = args.tokenizer_dir or (located.data_dir if located.format is CheckpointFormat.HF else None)
    model = build_model(source)
    read_into(model, located, source)
    write_from(model, args.output, out_format, located, source, family=family, tokenizer_dir=tokenizer_dir,
               dtype=_DTYPES.get(args.dtype))
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
