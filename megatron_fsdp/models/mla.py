"""Multi-latent attention (DeepSeek-V2/V3 MLA), computing what megatron-core 0.16.1's
``MLASelfAttention`` computes (Megatron's ``--multi-latent-attention``).

Shapes: b = batch, t = time, h = heads, c = qk_head_dim (content channels),
r = qk_pos_emb_head_dim (rotary channels), v = v_head_dim, Lq / Lkv = the ranks.

    x (b, t, hidden)
      queries:  [linear_q_down_proj -> q_layernorm (Lq) ->] linear_q_up_proj / linear_q_proj
                -> (b, t, h, c + r) = [content | rotary]
      keys/values: linear_kv_down_proj -> [latent (Lkv) | k_rot (r)]
                latent -> kv_layernorm -> linear_kv_up_proj -> (b, t, h, c + v) = [k content | value]
                k_rot is ONE rotary key per token, shared by every head
      RoPE/YaRN on q's and k's rotary channels; key = [k content | k_rot], query = [q content | q_rot]
      causal softmax(q k^T * scale) v -> (b, t, h * v) -> proj -> (b, t, hidden)

The down projections compress the hidden state to small latents (only the kv latent
and k_rot would need caching at inference); the norms on the latents are Megatron's
``--qk-layernorm`` (identity without it). No projection takes a bias except the output
one (``add_bias_linear``), as in megatron-core.

[Note: MLA rotary layout] megatron-core reads the rotary channels of MLA as interleaved
pairs (DeepSeek's checkpoints store them so): channels (0, 1), (2, 3), ... are
regrouped to [evens | odds] and then turned by the usual rotate-half RoPE. The result
stays in the regrouped order (the key and query are regrouped alike, so the scores are
those of interleaved RoPE). With rope_type='rope' and rotary_percent < 1 only the first
``mla_rotary_dim`` channels are regrouped and turned; the rest pass through.

[Note: MLA softmax scale] scores are scaled by m^2 / sqrt(c + r), with
m = yarn_mscale(rotary_scaling_factor, mscale_all_dim) -- for rope_type='rope' too,
as megatron-core (m = 1 unless the factor is above 1 and mscale_all_dim is non-zero).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig, RecomputeGranularity, RopeType
from .layers import InitLinear, build_norm, scaled_init_std
from .rope import rope_angles
from .yarn import concentration, yarn_angles, yarn_mscale

SequenceGather = Callable[[torch.Tensor, int], torch.Tensor]
"""(x with this rank's tokens along ``seq_dim``, seq_dim) -> x of the whole sequence in position
order, its backward handing back the gradient of this rank's tokens: what both attentions need
from a context-parallel layout (transformer.py, [Note: attention under context parallelism];
implemented by ``context_parallel.KeyValueGather``). Here, the lower of the two modules."""


def causal_mask(positions: Optional[torch.Tensor], t: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """(t, num_keys) bool: query i may attend to key j when j <= positions[i]; the keys are the
    whole sequence 0 .. num_keys - 1 and ``positions`` (t,) the queries' places in it (None: 0 .. t-1)."""
    queries = torch.arange(t, device=device) if positions is None else positions
    return queries[:, None] >= torch.arange(num_keys, device=device)[None, :]


def mla_rope_angles(cfg: GPTConfig, seq_len: int, device: torch.device,
                    positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float]:
    """((seq_len, mla_rotary_dim) fp32 angles, factor on cos/sin) of MLA's rotary embedding, at
    ``positions`` (seq_len,) (None: 0 .. seq_len - 1)."""
    if cfg.rope_type is RopeType.ROPE:
        return rope_angles(seq_len, cfg.mla_rotary_dim, cfg.rotary_base, device, positions=positions), 1.0
    angles = yarn_angles(seq_len, cfg.qk_pos_emb_head_dim, cfg.rotary_base, cfg.rotary_scaling_factor,
                         cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow, device,
                         positions=positions)
    return angles, concentration(cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim)


def apply_mla_rope(x: torch.Tensor, angles: torch.Tensor, scale: float) -> torch.Tensor:
    """x (b, t, heads, r), angles (t, rot) -> x with its first rot channels regrouped
    [evens | odds] and rotated ([Note: MLA rotary layout]); cos/sin carry ``scale``."""
    rot = angles.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = torch.cat((x_rot[..., 0::2], x_rot[..., 1::2]), dim=-1)
    cos = (angles.cos() * scale).to(x.dtype)[:, None, :]  # (t, 1, rot): broadcast over batch and heads
    sin = (angles.sin() * scale).to(x.dtype)[:, None, :]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def mla_softmax_scale(cfg: GPTConfig) -> float:
    """[Note: MLA softmax scale]."""
    m = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    return m * m / math.sqrt(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)


class MultiLatentAttention(nn.Module):
    """Causal self-attention through low-rank latents (module docstring). Parameter
    names follow megatron-core's ``MLASelfAttention`` (``proj`` is its ``linear_proj``,
    named as in ``CausalSelfAttention``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, std = cfg.num_attention_heads, cfg.init_method_std
        self.heads, self.q_head_dim = h, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        if cfg.q_lora_rank is None:
            self.linear_q_proj = InitLinear(cfg.hidden_size, h * self.q_head_dim, bias=False, std=std)
        else:
            self.linear_q_down_proj = InitLinear(cfg.hidden_size, cfg.q_lora_rank, bias=False, std=std)
            self.q_layernorm = build_norm(cfg, cfg.q_lora_rank) if cfg.qk_layernorm else nn.Identity()
            self.linear_q_up_proj = InitLinear(cfg.q_lora_rank, h * self.q_head_dim, bias=False, std=std)
        self.linear_kv_down_proj = InitLinear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim,
                                              bias=False, std=std)
        self.kv_layernorm = build_norm(cfg, cfg.kv_lora_rank) if cfg.qk_layernorm else nn.Identity()
        self.linear_kv_up_proj = InitLinear(cfg.kv_lora_rank, h * (cfg.qk_head_dim + cfg.v_head_dim), bias=False,
                                            std=std)
        self.proj = InitLinear(h * cfg.v_head_dim, cfg.hidden_size, bias=cfg.add_bias_linear, std=scaled_init_std(cfg))
        self.softmax_scale = mla_softmax_scale(cfg)
        self.dropout = cfg.attention_dropout
        self.recompute_core = cfg.recompute_granularity is RecomputeGranularity.SELECTIVE
        self.context_parallel: Optional[SequenceGather] = None
        """Set by ``apply_context_parallel`` (transformer.py, [Note: attention under context parallelism])."""

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (b, t, hidden), positions (t,) the tokens' global positions (None: 0 .. t-1)."""
        cfg, h = self.cfg, self.heads
        b, t, _ = x.shape
        if cfg.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        q_content, q_rot = q.view(b, t, h, self.q_head_dim).split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], -1)
        latent, k_rot = self.linear_kv_down_proj(x).split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], -1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(b, t, h, cfg.qk_head_dim + cfg.v_head_dim)
        k_content, v = kv.split([cfg.qk_head_dim, cfg.v_head_dim], -1)  # (b, t, h, c), (b, t, h, v)

        angles, scale = mla_rope_angles(cfg, t, x.device, positions)
        q_rot = apply_mla_rope(q_rot, angles, scale)  # (b, t, h, r)
        k_rot = apply_mla_rope(k_rot.unsqueeze(2), angles, scale)  # (b, t, 1, r)
        mask = None
        if self.context_parallel is not None:
            k_content, v, k_rot = self._gather_keys_values(k_content, v, k_rot)  # t -> T tokens
            mask = causal_mask(positions, t, k_rot.shape[1], x.device)  # (t, T)
        q = torch.cat((q_content, q_rot), dim=-1).transpose(1, 2)  # (b, h, t, c + r)
        k = torch.cat((k_content, k_rot.expand(-1, -1, h, -1)), dim=-1).transpose(1, 2)  # (b, h, t or T, c + r)
        v = v.transpose(1, 2)  # (b, h, t or T, v)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self._core_attention, q, k, v, mask, use_reentrant=False)  # as CausalSelfAttention
        else:
            y = self._core_attention(q, k, v, mask)  # (b, h, t, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, h * cfg.v_head_dim))  # (b, t, hidden)

    def _gather_keys_values(self, k_content: torch.Tensor, v: torch.Tensor,
                            k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, t, h, c), (b, t, h, v), (b, t, 1, r) of this rank's tokens -> the same of all T
        tokens, in one exchange of [k content | v | the shared rotary key] per token."""
        b, t, h, _ = k_content.shape
        widths = [h * self.cfg.qk_head_dim, h * self.cfg.v_head_dim, self.cfg.qk_pos_emb_head_dim]
        packed = torch.cat((k_content.reshape(b, t, -1), v.reshape(b, t, -1), k_rot.reshape(b, t, -1)), dim=-1)
        k_content, v, k_rot = self.context_parallel(packed, 1).split(widths, dim=-1)  # (b, T, width) each
        return k_content.unflatten(-1, (h, -1)), v.unflatten(-1, (h, -1)), k_rot.unsqueeze(2)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask`` (t, T) under context parallelism, else causal over t."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=self.softmax_scale,
                                              dropout_p=self.dropout if self.training else 0.0)
