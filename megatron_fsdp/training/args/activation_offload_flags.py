"""Validation of Megatron-LM's fine-grained activation offloading flags
(``--fine-grained-activation-offloading``, ``--offload-modules`` and their tuning knobs),
called by ``validation.py``.

Offloading copies the saved inputs of the chosen modules to host memory during the
forward pass and back before their backward: every value is the same, only device
memory and copy traffic change, so the launcher accepts the flags without acting on
them (the table's ``noop`` rows warn once). What Megatron-LM or megatron-core refuse
is refused here too, so a command line that would fail there does not train here.
"""

from __future__ import annotations

import argparse

from .arg_types import recompute_granularity

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "fused_group_mlp", "gdp_qkv")
"""megatron-core's accepted ``--offload-modules`` names, as of the Megatron-LM commit the flag
list follows (flag_data/megatron_lm_flags.csv); the pip release 0.16.1 knows the first seven."""
_INSIDE_MOE = ("moe_act", "expert_fc1", "fused_group_mlp")


def offload_problems(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's and megatron-core's rules on the offloading flags (a sentence each)."""
    if not args.fine_grained_activation_offloading:
        return []
    problems = []
    if args.transformer_impl != "transformer_engine":  # Megatron-LM's validate_args
        problems.append(f"--fine-grained-activation-offloading with --transformer-impl {args.transformer_impl}: "
                        "Megatron-LM offloads through TransformerEngine layers only; pass --transformer-impl "
                        "transformer_engine (its default) or drop the offloading flags")
    modules = list(args.offload_modules or [])
    if not modules:
        problems.append("--fine-grained-activation-offloading needs --offload-modules (megatron-core refuses an "
                        f"empty list); name some of: {' '.join(OFFLOAD_MODULES)}")
    unknown = [m for m in modules if m not in OFFLOAD_MODULES]
    if unknown:
        problems.append(f"--offload-modules {' '.join(unknown)}: not a module megatron-core offloads; choose from "
                        f"{' '.join(OFFLOAD_MODULES)}")
    if "attn_proj" in modules and "core_attn" not in modules:  # megatron-core: core_attn's backward needs it
        problems.append("--offload-modules attn_proj without core_attn: megatron-core refuses it (the projection's "
                        "input is the attention output that core_attn's backward still needs); add core_attn")
    recompute_moe = "moe" in (args.recompute_modules or []) and recompute_granularity(args) == "selective"
    inside = [m for m in modules if m in _INSIDE_MOE]
    if recompute_moe and inside:
        problems.append(f"--offload-modules {' '.join(inside)} with --recompute-modules moe: megatron-core refuses "
                        "offloading inside a MoE layer that is recomputed whole; drop one of the two")
    if "fused_group_mlp" in modules:
        if not args.use_transformer_engine_op_fuser:
            problems.append("--offload-modules fused_group_mlp needs --use-transformer-engine-op-fuser "
                            "(megatron-core's rule)")
        partial = [m for m in modules if m in ("expert_fc1", "moe_act")]
        if partial:
            problems.append(f"--offload-modules fused_group_mlp with {' '.join(partial)}: the fused group already "
                            "covers them (megatron-core refuses the mix); keep one")
    if args.min_offloaded_tensor_size < 0:
        problems.append(f"--min-offloaded-tensor-size={args.min_offloaded_tensor_size} must be >= 0")
    if not 0.0 <= args.activation_offload_fraction <= 1.0:
        problems.append(f"--activation-offload-fraction={args.activation_offload_fraction} must be in [0, 1]")
    if args.delta_offload_bytes_across_pp_ranks < 0:
        problems.append(f"--delta-offload-bytes-across-pp-ranks={args.delta_offload_bytes_across_pp_ranks} must be "
                        ">= 0")
    return problems
