"""Validation of the multi-latent attention flags (``--multi-latent-attention`` and the
flags only it reads), called by ``validation.py``: problems (a sentence naming the
value and the fix each) before any process group, and warnings for flags that have
no effect in the combination given -- which Megatron-LM ignores silently.

Rules that mirror Megatron-LM or megatron-core say so; the rest keep the flags from
being ignored without a word. Pure argument handling, no torch.
"""

from __future__ import annotations

import argparse
import importlib.util

from ...models.yarn import yarn_mscale

# Flags that only multi-latent attention reads (Megatron-LM's "mla" group and --rope-type).
MLA_ONLY_FLAGS = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
                  "--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--rope-type")


def _given(args: argparse.Namespace) -> dict:
    return getattr(args, "given_flags", {})


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def effective_rope_type(args: argparse.Namespace) -> str:
    """MLA's rotary embedding: --rope-type, else megatron-core's MLA default (yarn)."""
    return args.rope_type or "yarn"


def mla_problems(args: argparse.Namespace) -> list[str]:
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":  # Megatron-LM's core_transformer_config_from_args asserts this
            return ["--rope-type yarn without --multi-latent-attention: Megatron-LM's common attention only supports "
                    "rope_type rope (YaRN is MLA's here); add --multi-latent-attention or drop --rope-type"]
        return []
    problems = []
    if args.group_query_attention:  # Megatron-LM's validate_args asserts this
        problems.append("--group-query-attention with --multi-latent-attention: Megatron-LM refuses the two together "
                        "(MLA has one key/value per query head, from its shared latent); drop --group-query-attention")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    if args.q_lora_rank is not None and args.q_lora_rank <= 0:
        problems.append(f"--q-lora-rank={args.q_lora_rank} must be a positive integer (leave it out for no query "
                        "compression)")
    rot = args.qk_pos_emb_head_dim
    if effective_rope_type(args) == "rope" and args.rotary_percent < 1.0:
        rot = int(rot * args.rotary_percent)
    if args.qk_pos_emb_head_dim > 0 and (rot % 2 or rot == 0):
        problems.append(f"--qk-pos-emb-head-dim={args.qk_pos_emb_head_dim} (x --rotary-percent with --rope-type rope) "
                        f"gives {rot} rotary channels; RoPE turns channel pairs: choose an even, non-zero number")
    if args.rotary_scaling_factor <= 0:
        problems.append(f"--rotary-scaling-factor={args.rotary_scaling_factor} must be positive")
    else:
        for name in ("mscale", "mscale_all_dim"):
            if yarn_mscale(args.rotary_scaling_factor, getattr(args, name)) <= 0:
                problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} with --rotary-scaling-factor="
                                f"{args.rotary_scaling_factor}: YaRN's scale 0.1 x {name} x ln(factor) + 1 is <= 0; "
                                "use a larger value")
    if args.use_mcore_models and not transformer_engine_installed():
        problems.append("--use-mcore-models --multi-latent-attention needs TransformerEngine installed: megatron-core "
                        "0.16.1 cannot build its MLA without it (models/mcore_mla.py, [Note: MLA without "
                        "TransformerEngine]); install transformer_engine or drop --use-mcore-models (the embedded "
                        "GPT's MLA computes the same)")
    return problems


def mla_warnings(args: argparse.Namespace) -> list[str]:
    given = _given(args)
    if not args.multi_latent_attention:
        return [f"{flag}: no effect without --multi-latent-attention (Megatron-LM reads it for MLA only)"
                for flag in MLA_ONLY_FLAGS if flag in given]
    warnings = []
    if "--kv-channels" in given:
        warnings.append(f"--kv-channels {args.kv_channels}: no effect with --multi-latent-attention (its heads are "
                        "--qk-head-dim + --qk-pos-emb-head-dim wide for queries and keys, --v-head-dim for values), "
                        "as in Megatron-LM")
    if "--num-query-groups" in given:
        warnings.append(f"--num-query-groups {args.num_query_groups}: no effect with --multi-latent-attention (one "
                        "key/value per query head), as in Megatron-LM")
    rope_type = effective_rope_type(args)
    if rope_type == "yarn" and args.rotary_percent != 1.0:
        warnings.append(f"--rotary-percent {args.rotary_percent}: no effect with MLA's YaRN (--rope-type yarn, the "
                        "default): megatron-core's YaRN turns every --qk-pos-emb-head-dim channel; --rope-type rope "
                        "uses it")
    if rope_type == "rope" and "--mscale" in given:
        warnings.append(f"--mscale {args.mscale}: no effect with --rope-type rope (it scales YaRN's cos/sin only)")
    if rope_type == "rope" and args.apply_rope_fusion and args.position_embedding_type == "rope":
        warnings.append("--multi-latent-attention --rope-type rope with RoPE fusion on (no --no-rope-fusion): "
                        "Megatron-LM refuses this (megatron-core: 'apply_rope_fusion for MLA only works with YARN "
                        "RoPE'); here RoPE is never fused, so the numbers are those of Megatron-LM with "
                        "--no-rope-fusion. Add --no-rope-fusion to run the same command there")
    return warnings
