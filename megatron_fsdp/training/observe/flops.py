"""Model FLOPs of one global batch, counted by Megatron-LM's rule (its
``num_floating_point_operations``), so that the launcher's TFLOP/s column reads as Megatron-LM's.

[Note: Megatron-LM's FLOPs rule] Every GEMM counts 2 FLOPs per multiply-add and runs three
times (forward, weight gradient, input gradient): 6 per weight per token. The rule counts, per
token:
- attention projections: h x (q + k + v (+ gate)) and q x h, with q = heads x kv_channels and
  k = v = groups x kv_channels (GQA), or MLA's low-rank projections;
- core attention: 6 x q x s per token (QK^T and its product with V, halved by the causal
  mask), s the sequence length;
- MLPs: h x ffn x (3 with SwiGLU, else 2) per dense layer; per MoE layer the top-k routed
  experts (not all of them) and the shared expert;
- multi-token prediction: its layers counted as transformer layers (MoE if the last layer
  is), plus its norms and projection, and one more output layer per depth;
- the output layer over the padded vocabulary.
Recomputation is not counted (model FLOPs, not hardware FLOPs), nor are norms, softmax,
embeddings or the router. ``tests/test_launcher_flops.py`` checks the figures against numbers
recorded from Megatron-LM's own function for a dense, a GQA, an MoE and an MLA configuration.
"""

from __future__ import annotations

from argparse import Namespace

GEMM = 3 * 2
"""Forward, weight-gradient and input-gradient GEMMs, 2 FLOPs per multiply-add each."""


def num_floating_point_operations(args: Namespace, batch_size: int) -> float:
    """FLOPs of ``batch_size`` sequences of ``args.seq_length`` tokens through the model the
    launcher's flags describe (after validation: ``ffn_hidden_size``, ``kv_channels`` and
    ``padded_vocab_size`` set, ``moe_layer_freq`` parsed)."""
    tokens = batch_size * args.seq_length
    dense_layers, moe_layers, mtp = _layer_counts(args)
    layers = args.num_layers + mtp
    linear_attention, core_attention = _attention_terms(args)
    per_token = (
        _mlp_term(args, dense_layers, moe_layers)
        + linear_attention * layers
        + GEMM * mtp * (3 * args.hidden_size + 2 * args.hidden_size * args.hidden_size)
        + GEMM * args.hidden_size * args.padded_vocab_size * (mtp + 1)
    )
    return float(tokens * per_token + tokens * args.seq_length * core_attention * layers)


def _layer_counts(args: Namespace) -> tuple[int, int, int]:
    """(dense MLP layers, MoE layers, MTP depths); MTP layers are MoE when the last layer is."""
    mtp = args.mtp_num_layers or 0
    if args.num_experts is None:
        return args.num_layers + mtp, 0, mtp
    freq = args.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(args.num_layers)] if isinstance(freq, int) else list(freq)
    if len(pattern) != args.num_layers:
        raise ValueError(f"--moe-layer-freq gives {len(pattern)} layers for --num-layers {args.num_layers}")
    moe = sum(pattern) + pattern[-1] * mtp
    return args.num_layers + mtp - moe, moe, mtp


def _mlp_term(args: Namespace, dense_layers: int, moe_layers: int) -> float:
    """Per-token FLOPs of every layer's MLP: dense layers, the top-k routed experts and the shared expert."""
    expansion = 3 if args.swiglu else 2
    moe_ffn = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    shared = args.moe_shared_expert_intermediate_size or 0
    routed = args.moe_router_topk if args.num_experts is not None else 0
    latent = getattr(args, "moe_latent_size", None)
    if latent is None:
        experts = moe_ffn * routed * expansion
    else:  # routed experts run on the latent width, plus its up and down projections
        experts = moe_ffn * routed * expansion * latent / args.hidden_size + 2 * latent
    widths = args.ffn_hidden_size * expansion * dense_layers + (experts + shared * expansion) * moe_layers
    return GEMM * args.hidden_size * widths


def _attention_terms(args: Namespace) -> tuple[float, float]:
    """(per-token FLOPs of one layer's projections, per token-squared FLOPs of its core attention)."""
    heads, hidden = args.num_attention_heads, args.hidden_size
    if args.multi_latent_attention:
        return _mla_terms(args)
    groups = args.num_query_groups if args.group_query_attention else heads
    q = args.kv_channels * heads
    kv = args.kv_channels * groups
    gate = q if getattr(args, "attention_output_gate", False) else 0
    linear = GEMM * (hidden * (q + 2 * kv + gate) + q * hidden)
    core = GEMM * q  # QK^T and softmax(QK^T) V, each halved by the causal mask
    return linear, core


def _mla_terms(args: Namespace) -> tuple[float, float]:
    """Multi-latent attention's projections (low-rank query and key/value paths, the rotary
    part, the output) and core attention."""
    heads, hidden = args.num_attention_heads, args.hidden_size
    qk, rope, v = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
    if args.q_lora_rank is None:
        query = hidden * heads * (qk + rope)
    else:
        query = args.q_lora_rank * (hidden + heads * (qk + rope) + 1)
    key_value = args.kv_lora_rank * (hidden + heads * (qk + v) + 1) + hidden * rope
    linear = GEMM * (query + key_value + heads * v * hidden)
    core = GEMM * (heads * (qk + rope) / 2 + heads * v / 2)
    return linear, core
