"""Self-attention and the transformer block (the FSDP unit of the embedded GPT).

Shapes: b = batch, t = time, h = query heads, g = key/value groups, d = kv_channels
(the width of one head), n = b * t tokens; under context parallelism t is this rank's
tokens and T the whole sequence's (models/context_parallel.py).

[Note: attention under context parallelism] Both attentions take the global positions of
their tokens (``positions``, (t,); ``None``: 0 .. t-1) and may hold a ``context_parallel``
gather: a callable (x, seq_dim) -> x of the whole sequence, in position order, whose
backward hands each rank the gradient of its own tokens. Set (by ``apply_context_parallel``),
the keys and values of every rank are gathered in one call after RoPE and the q/k norms
(both per token) and the local queries attend to all T keys under the causal mask of their
global positions (``causal_mask``). Unset, nothing changes: ``is_causal`` attention over t.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig, PositionEmbeddingType, RecomputeGranularity
from .layers import MLP, InitLinear, build_norm, scaled_init_std
from .mla import MultiLatentAttention, SequenceGather, causal_mask  # shared with MLA, the lower module
from .moe import MoELayer
from .rope import apply_rope, rope_angles


class CausalSelfAttention(nn.Module):
    """Multi-head, or group-query when num_query_groups < heads: each of the g
    key/value heads serves h/g consecutive query heads (Megatron's grouping).

    ``qkv`` projects to [q (h*d) | k (g*d) | v (g*d)]; with g = h and d = hidden/h
    that is the classic fused (3 * hidden, hidden) projection. With
    ``attention_output_gate`` it also yields a gate (h*d) after v: see
    [Note: attention output gate]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        self.q_size, self.kv_size = self.heads * self.head_dim, self.groups * self.head_dim
        self.gate_size = self.q_size if cfg.attention_output_gate else 0
        self.qkv = InitLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size + self.gate_size,
                              bias=cfg.add_bias_linear or cfg.add_qkv_bias, std=cfg.init_method_std)
        self.proj = InitLinear(self.q_size, cfg.hidden_size, bias=cfg.add_bias_linear, std=scaled_init_std(cfg))
        if cfg.qk_layernorm:
            self.q_layernorm = build_norm(cfg, self.head_dim)
            self.k_layernorm = build_norm(cfg, self.head_dim)
        self.qk_layernorm = cfg.qk_layernorm
        self.rope = cfg.position_embedding_type is PositionEmbeddingType.ROPE
        self.rotary_dim, self.rotary_base = cfg.rotary_dim, cfg.rotary_base
        self.rotary_interleaved = cfg.rotary_interleaved
        self.dropout = cfg.attention_dropout
        self.recompute_core = cfg.recompute_granularity is RecomputeGranularity.SELECTIVE
        self.context_parallel: Optional[SequenceGather] = None
        """Set by ``apply_context_parallel``: see [Note: attention under context parallelism]."""

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (b, t, hidden), positions (t,) the tokens' global positions (None: 0 .. t-1)."""
        b, t, _ = x.shape
        fused = self.qkv(x)  # (b, t, h*d + 2*g*d (+ h*d)), or this TP rank's share of it
        # Under the tensor-parallel plan the projection hands this rank 1/TP of every section
        # (models/tensor_parallel.py, [Note: fused projections]): its own heads and groups.
        share = (self.q_size + 2 * self.kv_size + self.gate_size) // fused.shape[-1]
        heads, groups = self.heads // share, self.groups // share
        q, k, v, gate = fused.split([heads * self.head_dim, groups * self.head_dim, groups * self.head_dim,
                                     self.gate_size // share], dim=2)
        q = q.view(b, t, heads, self.head_dim).transpose(1, 2)  # (b, h, t, d)
        k = k.view(b, t, groups, self.head_dim).transpose(1, 2)  # (b, g, t, d)
        v = v.view(b, t, groups, self.head_dim).transpose(1, 2)  # (b, g, t, d)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rope:
            angles = rope_angles(t, self.rotary_dim, self.rotary_base, x.device,
                                 interleaved=self.rotary_interleaved, positions=positions)  # (t, rotary_dim)
            q = apply_rope(q, angles, interleaved=self.rotary_interleaved)
            k = apply_rope(k, angles, interleaved=self.rotary_interleaved)
        mask = None
        if self.context_parallel is not None:
            # One exchange for both: [k | v] (b, g, t, 2d) -> (b, g, T, 2d)
            k, v = self.context_parallel(torch.cat((k, v), dim=-1), 2).chunk(2, dim=-1)
            mask = causal_mask(positions, t, k.shape[2], x.device)  # (t, T)
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=1)  # (b, h, t, d)
            v = v.repeat_interleave(heads // groups, dim=1)  # (b, h, t, d)
        if self.recompute_core and torch.is_grad_enabled():
            # Selective recompute: keep q, k, v; recompute softmax(QK^T)V in backward
            # (the RNG state is replayed, so attention dropout draws the same mask).
            y = checkpoint(self._core_attention, q, k, v, mask, use_reentrant=False)
        else:
            y = self._core_attention(q, k, v, mask)  # (b, h, t, d)
        y = y.transpose(1, 2).reshape(b, t, heads * self.head_dim)  # (b, t, h*d), head-major as the gate
        if self.gate_size:
            y = apply_output_gate(y, gate)
        return self.proj(y)  # (b, t, hidden)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (b, h, t, d), k and v (b, h, t or T, d); ``mask`` (t, T) under context parallelism,
        else causal over t. Scale 1/sqrt(d), as Megatron's default (no query-key layer scaling)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=self.dropout if self.training else 0.0)


def apply_output_gate(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[Note: attention output gate] Gated attention (Megatron's ``--attention-output-gate``):
    every channel of every head's attention output y (b, t, h*d) is multiplied by
    sigmoid of its own gate channel, projected from the block input by the fused QKV
    linear. As megatron-core, the sigmoid and the product run in fp32 and the result is
    rounded once to y's dtype (a bf16 sigmoid would round twice: different bf16 numbers).

    megatron-core lays the gate rows out per key/value group, [q | gate | k | v] for each
    group; here they follow v as one (h*d) block, in query-head order, so a model without
    the gate keeps its layout. ``mcore.to_mcore_state_dict`` converts."""
    return (y * torch.sigmoid(gate.float())).to(y.dtype)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the FSDP unit of this model.

    ``layer_number`` (0-based) picks a dense MLP or an MoE layer per ``moe_layer_freq``."""

    def __init__(self, cfg: GPTConfig, layer_number: int = 0) -> None:
        super().__init__()
        self.ln_1 = build_norm(cfg, cfg.hidden_size)
        self.attn = MultiLatentAttention(cfg) if cfg.multi_latent_attention else CausalSelfAttention(cfg)
        self.ln_2 = build_norm(cfg, cfg.hidden_size)
        self.mlp = MoELayer(cfg) if cfg.is_moe_layer(layer_number) else MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (b, t, hidden) -> (b, t, hidden); ``positions`` (t,): the tokens' global positions
        (None: 0 .. t-1), for RoPE and context parallelism's causal mask."""
        x = x + self._dropout(self.attn(self.ln_1(x), positions))
        return x + self._dropout(self.mlp(self.ln_2(x)))

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout == 0.0 or not self.training:
            return branch
        return F.dropout(branch, self.hidden_dropout, training=True)
