"""Validation of ``--optimizer muon`` and the ``--muon-*`` flags, called by
``validation.py``: problems (a sentence naming the value and the fix each) before any
process group, and warnings for Muon flags given without Muon -- which Megatron-LM
ignores without a word.

Megatron-LM's own rules for emerging optimizers (megatron/training/arguments.py and
megatron/core/optimizer/__init__.py) say so; the rest are limits of this launcher.
Value sets (--muon-scale-mode, --muon-coefficient-type, ...) are the argument table's.
Pure argument handling, no torch.
"""

from __future__ import annotations

import argparse
from typing import Mapping

MUON_ONLY_FLAGS = ("--muon-momentum", "--muon-nesterov", "--muon-no-split-qkv", "--muon-scale-mode",
                   "--muon-extra-scale-factor", "--muon-num-ns-steps", "--muon-coefficient-type",
                   "--muon-fp32-matmul-prec", "--muon-scalar-optimizer", "--muon-tp-mode", "--muon-use-syrk",
                   "--no-use-layer-wise-param-layout")


def _given(args: argparse.Namespace) -> Mapping:
    return getattr(args, "given_flags", {})


def muon_problems(args: argparse.Namespace) -> list[str]:
    if args.optimizer != "muon":
        return []
    problems = []
    # -- Megatron-LM's rules for emerging optimizers ------------------------------------------
    if args.use_megatron_fsdp:
        problems.append("--optimizer muon with --use-megatron-fsdp: Megatron-LM does not support emerging optimizers "
                        "with Megatron-FSDP; use --use-distributed-optimizer (Muon's momentum sharded, each matrix "
                        "orthogonalised whole on one rank) or drop --use-megatron-fsdp")
    if args.use_torch_fsdp2:
        problems.append("--optimizer muon with --use-torch-fsdp2: Megatron-LM does not support emerging optimizers "
                        "with Torch-FSDP2; drop --use-torch-fsdp2 (--use-distributed-optimizer shards Muon's state)")
    if args.fp16:
        problems.append("--optimizer muon with --fp16: Megatron-LM does not support emerging optimizers with fp16; "
                        "use --bf16")
    if args.ckpt_format not in ("torch", "torch_dist"):
        problems.append(f"--optimizer muon with --ckpt-format {args.ckpt_format}: Megatron-LM's emerging optimizers "
                        "save torch and torch_dist checkpoints only; use --ckpt-format torch_dist")
    if args.muon_num_ns_steps < 1:
        problems.append(f"--muon-num-ns-steps={args.muon_num_ns_steps} must be at least 1 (Megatron-LM's rule)")
    # -- limits of this launcher ------------------------------------------------------------------
    if args.num_distributed_optimizer_instances > 1:
        problems.append(f"--optimizer muon with --num-distributed-optimizer-instances="
                        f"{args.num_distributed_optimizer_instances}: the sharded Muon step is implemented for one "
                        "optimizer instance (Megatron-LM's default layer-wise layout refuses more too); drop the flag")
    return problems


def muon_warnings(args: argparse.Namespace) -> list[str]:
    if args.optimizer == "muon":
        return []
    return [f"{flag} has no effect without --optimizer muon (as in Megatron-LM); add --optimizer muon or drop it"
            for flag in MUON_ONLY_FLAGS if flag in _given(args)]
