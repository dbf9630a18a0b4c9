"""Configurations of record: named ``GPTConfig`` presets for the model families
Megatron-LM's example scripts train, at their real sizes (for GPUs) and as tiny
versions of the same architecture (seconds on a CPU).

    from megatron_fsdp.models import GPT, presets
    model = GPT(presets.config("llama3-tiny", vocab_size=512))

Presets are data (``PRESETS``: name -> GPTConfig keyword arguments); the
launcher's YAML configs say the same things as Megatron-LM flags, and
``megatron_flags`` spells a preset that way.

Sources: Llama-3-8B is Meta's published shape (rope base 500000; Megatron-LM's
``examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh`` uses rope base 1e6,
init std 0.0134 and ``--apply-layernorm-1p``, which overrides can reproduce).
GPT-3 175B follows Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh``
(init std 0.006, Megatron's 0.1 dropouts) with the GPT-2 BPE vocabulary (50257)
padded to a multiple of 128; 1.3B and 6.7B are the GPT-3 paper's XL and 6.7B
shapes. Mixtral-8x7B follows
``examples/mixtral/train_mixtral_8x7b_distributed.sh``.
"""

from __future__ import annotations

from typing import Any

from .config import GPTConfig, PositionEmbeddingType, RecomputeGranularity, vocab_size_with_padding

_GPT2_VOCAB = vocab_size_with_padding(50257, 128)  # 50304

_LLAMA = dict(  # what makes a model Llama-shaped
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
_GPT3 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm")

PRESETS: dict[str, dict[str, Any]] = {
    # -- real sizes (GPUs) ---------------------------------------------------------------
    "llama3-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, kv_channels=128, seq_length=8192, vocab_size=128256,
                      rotary_base=500000, norm_epsilon=1e-5, init_method_std=0.02),
    "gpt3-175b": dict(_GPT3, num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                      vocab_size=_GPT2_VOCAB, init_method_std=0.006, hidden_dropout=0.1, attention_dropout=0.1,
                      openai_gelu=False),
    "gpt3-6.7b": dict(_GPT3, num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                      vocab_size=_GPT2_VOCAB, init_method_std=0.01, hidden_dropout=0.1, attention_dropout=0.1,
                      openai_gelu=False),
    "gpt3-1.3b": dict(_GPT3, num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                      vocab_size=_GPT2_VOCAB, init_method_std=0.02, hidden_dropout=0.1, attention_dropout=0.1,
                      openai_gelu=False),
    "mixtral-8x7b": dict(_LLAMA, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_query_groups=8, kv_channels=128, seq_length=4096, vocab_size=32000, rotary_base=1000000,
                         num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2),
    # -- tiny CPU versions of the same architectures (dropout 0: runs compare exactly) ---
    "llama3-tiny": dict(_LLAMA, num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                        num_query_groups=2, seq_length=64, vocab_size=256, rotary_base=500000),
    "gpt3-tiny": dict(_GPT3, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256,
                      openai_gelu=False),
    "mixtral-tiny": dict(_LLAMA, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                         num_query_groups=2, seq_length=64, vocab_size=256, rotary_base=1000000,
                         num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2),
}


def config(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` as a validated ``GPTConfig``; ``overrides`` replace fields
    (e.g. ``vocab_size`` from the tokenizer, ``num_layers`` for a shallower run)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return GPTConfig(**{**PRESETS[name], **overrides})


def megatron_flags(cfg: GPTConfig) -> dict[str, Any]:
    """``cfg`` as Megatron-LM arguments (``{"--num-layers": 32, "--swiglu": True, ...}``):
    what a launch script or a YAML ``MODEL_ARGS`` block says for this model. Switches
    appear only when on; ``--group-query-attention`` when query groups < heads. The
    GELU flavour is spelt as Megatron-LM decides it (``--no-bias-gelu-fusion`` for the
    exact GELU with biases; see ``training.model_setup.megatron_gelu_is_tanh``)."""
    if not cfg.swiglu and not cfg.add_bias_linear and cfg.openai_gelu:
        raise ValueError("a tanh-GELU MLP without biases (openai_gelu=True, add_bias_linear=False) has no Megatron-LM "
                         "flags: without biases Megatron-LM always uses the exact GELU; set openai_gelu=False")
    flags: dict[str, Any] = {
        "--num-layers": cfg.num_layers,
        "--hidden-size": cfg.hidden_size,
        "--ffn-hidden-size": cfg.ffn_hidden_size,
        "--num-attention-heads": cfg.num_attention_heads,
        "--kv-channels": cfg.kv_channels,
        "--seq-length": cfg.seq_length,
        "--max-position-embeddings": cfg.seq_length,
        "--normalization": cfg.normalization.value,
        "--norm-epsilon": cfg.norm_epsilon,
        "--position-embedding-type": cfg.position_embedding_type.value,
        "--hidden-dropout": cfg.hidden_dropout,
        "--attention-dropout": cfg.attention_dropout,
        "--init-method-std": cfg.init_method_std,
    }
    if cfg.position_embedding_type is PositionEmbeddingType.ROPE:
        flags.update({"--rotary-base": cfg.rotary_base, "--rotary-percent": cfg.rotary_percent})
    if cfg.num_query_groups != cfg.num_attention_heads:
        flags.update({"--group-query-attention": True, "--num-query-groups": cfg.num_query_groups})
    switches = {
        "--swiglu": cfg.swiglu,
        "--untie-embeddings-and-output-weights": cfg.untie_embeddings_and_output_weights,
        "--disable-bias-linear": not cfg.add_bias_linear,
        "--qk-layernorm": cfg.qk_layernorm,
        "--apply-layernorm-1p": cfg.apply_layernorm_1p,
        "--no-bias-gelu-fusion": not cfg.swiglu and cfg.add_bias_linear and not cfg.openai_gelu,
        "--moe-router-pre-softmax": cfg.num_moe_experts is not None and cfg.moe_router_pre_softmax,
    }
    flags.update({flag: True for flag, on in switches.items() if on})
    if cfg.recompute_granularity is not None:
        flags["--recompute-granularity"] = cfg.recompute_granularity.value
    if cfg.recompute_granularity is RecomputeGranularity.FULL:
        method, layers = cfg.recompute_plan
        flags.update({"--recompute-method": method.value, "--recompute-num-layers": layers})
    if cfg.num_moe_experts is not None:
        flags.update({"--num-experts": cfg.num_moe_experts, "--moe-router-topk": cfg.moe_router_topk,
                      "--moe-ffn-hidden-size": cfg.moe_ffn_hidden_size,
                      "--moe-aux-loss-coeff": cfg.moe_aux_loss_coeff})
        optional = {"--moe-shared-expert-intermediate-size": cfg.moe_shared_expert_intermediate_size,
                    "--moe-router-topk-scaling-factor": cfg.moe_router_topk_scaling_factor}
        flags.update({flag: value for flag, value in optional.items() if value is not None})
    return flags


def describe(name: str) -> str:
    """One line: the preset's shape and parameter count (counted on the meta device)."""
    import torch

    from .gpt import GPT

    cfg = config(name)
    with torch.device("meta"):
        params = GPT(cfg).num_parameters()
    kind = "MoE" if cfg.num_moe_experts else "dense"
    return (f"{name}: {kind}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
            f"({cfg.num_query_groups} kv), ffn {cfg.ffn_hidden_size}, vocab {cfg.vocab_size}, "
            f"{params / 1e6:,.1f}M parameters")


__all__ = ["PRESETS", "config", "describe", "megatron_flags"]
