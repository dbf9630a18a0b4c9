"""Validation of the multi-token prediction flags (``--mtp-num-layers``,
``--mtp-loss-scaling-factor``), called by ``validation.py``: problems (a sentence naming
the value and the fix each) before any process group, and warnings for what has no effect.
Rules that mirror Megatron-LM or megatron-core say so. No torch beyond ``models.mcore``'s
import-free probe of the installed megatron-core.
"""

from __future__ import annotations

import argparse
import math

from .arg_types import recompute_granularity


def mtp_enabled(args: argparse.Namespace) -> bool:
    """Megatron-LM builds MTP layers for a positive ``--mtp-num-layers`` only (0: none, nothing logged)."""
    return bool(args.mtp_num_layers)


def mtp_problems(args: argparse.Namespace) -> list[str]:
    depths = args.mtp_num_layers
    if depths is None or depths == 0:
        return []
    if depths < 0:
        return [f"--mtp-num-layers={depths} must be a positive number of prediction depths (0 or none: no MTP)"]
    problems = []
    if args.position_embedding_type not in ("rope", "none"):  # Megatron-LM's validate_args asserts this
        problems.append(f"--mtp-num-layers with --position-embedding-type {args.position_embedding_type}: Megatron-LM "
                        "refuses multi-token prediction without rotary (or no) position embeddings; pass "
                        "--position-embedding-type rope")
    factor = args.mtp_loss_scaling_factor
    if factor is None or not math.isfinite(factor) or factor < 0:
        problems.append(f"--mtp-loss-scaling-factor={factor} must be a finite number >= 0 (Megatron-LM's default 0.1)")
    granularity = recompute_granularity(args)
    if granularity == "full" and args.recompute_method == "uniform" and args.recompute_num_layers not in (None, 1):
        # megatron-core checkpoints each MTP layer on its own and asserts one layer per chunk.
        problems.append(f"--mtp-num-layers with --recompute-method uniform --recompute-num-layers "
                        f"{args.recompute_num_layers}: megatron-core refuses MTP recomputation unless "
                        "--recompute-num-layers is 1; pass --recompute-num-layers 1 or --recompute-method block")
    if args.use_mcore_models:
        from ...models.mcore_specs import per_token_rolled_count_problem

        problem = per_token_rolled_count_problem(depths, args.calculate_per_token_loss)
        if problem:
            problems.append(problem)
    return problems


def mtp_warnings(args: argparse.Namespace) -> list[str]:
    given = getattr(args, "given_flags", {})
    if not mtp_enabled(args):
        if "--mtp-loss-scaling-factor" in given:
            return [f"--mtp-loss-scaling-factor {args.mtp_loss_scaling_factor}: no effect without a positive "
                    "--mtp-num-layers (Megatron-LM reads it for MTP only)"]
        return []
    granularity = recompute_granularity(args)
    if granularity == "full" and args.recompute_method == "block":
        return ["--mtp-num-layers with --recompute-method block: the MTP layers are not recomputed (megatron-core "
                "skips them with a warning too); the numbers are the same, the memory is that of no recomputation "
                "for those layers"]
    return []
