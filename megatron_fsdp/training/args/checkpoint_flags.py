"""Validation of the checkpoint flags (``--save``, ``--load``, ``--pretrained-checkpoint``,
``--ckpt-format``, ``--async-save``, ``--save-retain-interval``, ``--export-hf-dir``), called by
``validation.py``: a sentence per problem, naming the value and the fix, before any process
group. The formats' own rules live beside their code (``checkpoint/torch_checkpoint.py``,
``checkpoint/hf_weights.py``)."""

from __future__ import annotations

import argparse


def checkpoint_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.save is not None and (args.save_interval is None or args.save_interval <= 0):  # Megatron-LM rule
        problems.append(f"--save {args.save!r} needs a positive --save-interval")
    if args.ckpt_step is not None and args.load is None:
        problems.append(f"--ckpt-step={args.ckpt_step} needs --load DIR (the checkpoint root to read it from)")
    if args.finetune and args.load is None and args.pretrained_checkpoint is None:
        problems.append("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if args.async_save and args.save is None:
        problems.append("--async-save needs --save DIR")
    from ..checkpoint.torch_checkpoint import option_problems as torch_format_problems

    problems += torch_format_problems(args)  # --ckpt-format torch's rules (Megatron-LM's and this launcher's)
    from ..checkpoint.hf_weights import hf_problems

    problems += hf_problems(args)  # Hugging Face directories in and out
    retain = args.save_retain_interval
    if retain is not None and args.save is not None and args.save_interval:  # Megatron-LM's rules
        if retain <= 0 or retain % args.save_interval:
            problems.append(f"--save-retain-interval={retain} must be a positive multiple of "
                            f"--save-interval={args.save_interval}")
    if args.verify_integrity and args.ckpt_format != "torch_dist":  # Megatron-LM rule (training_config.py)
        problems.append(f"--verify-integrity is only supported with --ckpt-format torch_dist (Megatron-LM's rule), "
                        f"got {args.ckpt_format}; checkpoints here are always checksummed and verified anyway")
    return problems
