"""A small GPT in plain PyTorch (CPU or CUDA), nanoGPT-shaped.

Every module initialises its own parameters in ``reset_parameters()``, so the
model can be built on the meta device and materialised unit by unit with the same
numbers as an eager build under the same seed.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02


@dataclasses.dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level by default: the embedded corpus needs no tokenizer."""
    seq_length: int = 64
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    """Defaults to 4 * hidden_size."""
    tie_embeddings: bool = True
    recompute: bool = False
    """Activation recomputation of every transformer block."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size


class InitLinear(nn.Linear):
    """Linear with GPT-2 initialisation (normal(0, std), zero bias)."""

    def __init__(self, *args, std: float = INIT_STD, **kwargs) -> None:
        self.std = std
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv = InitLinear(cfg.hidden_size, 3 * cfg.hidden_size)
        # Residual projections scaled down with depth (GPT-2).
        self.proj = InitLinear(cfg.hidden_size, cfg.hidden_size, std=INIT_STD / math.sqrt(2 * cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (batch, time, hidden)
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (b, h, t, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = InitLinear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.proj = InitLinear(cfg.ffn_hidden_size, cfg.hidden_size, std=INIT_STD / math.sqrt(2 * cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """The FSDP unit of this model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = InitEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = InitEmbedding(cfg.seq_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = InitLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (batch, time) int64 -> logits (batch, time, vocab)."""
        t = tokens.shape[1]
        if t > self.config.seq_length:
            raise ValueError(f"sequence of {t} tokens exceeds seq_length={self.config.seq_length}")
        pos = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            if self.config.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
