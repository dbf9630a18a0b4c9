"""Leaf layers of the embedded GPT: initialised linears and embeddings, norms.

Every module initialises its own parameters in ``reset_parameters()``, so a model
built on the meta device and materialised module by module (megatron_fsdp's
``init_model_with_meta_device``) gets the same numbers as an eager build under
the same seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig, Normalization


def scaled_init_std(cfg: GPTConfig) -> float:
    """Megatron's init for the projections that feed the residual stream (attention
    output, MLP output): std / sqrt(2 * num_layers), so the residual's variance does
    not grow with depth."""
    return cfg.init_method_std / math.sqrt(2 * cfg.num_layers)


class InitLinear(nn.Linear):
    """Linear with Megatron/GPT-2 initialisation: weight ~ N(0, std), bias = 0."""

    def __init__(self, *args, std: float = 0.02, **kwargs) -> None:
        self.std = std  # set before nn.Linear.__init__, which calls reset_parameters
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, bias_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``bias_scale`` (n, 1): x W^T + bias * bias_scale (an MoE expert's routing
        weight on its bias), rounded once to the GEMM's dtype. Computed here, inside
        the module's own call, so that module hooks (FSDP units that gather this
        layer's weights) run around every read of its parameters."""
        if bias_scale is None or self.bias is None:
            return super().forward(x)
        out = F.linear(x, self.weight)
        return (out + self.bias * bias_scale).to(out.dtype)


class SharedExpertGate(nn.Module):
    """sigmoid(x . w) per token, w a (1, hidden) weight ~ N(0, std) without bias: the gate
    of an MoE shared expert (megatron-core's ``SharedExpertMLP.gate_weight``; see
    ``moe.SharedExpertMLP``). Computed in the input's dtype, as megatron-core; the weight
    is 2-D, so weight decay applies to it as to megatron-core's."""

    def __init__(self, hidden_size: int, *, std: float) -> None:
        super().__init__()
        self.std = std
        self.weight = nn.Parameter(torch.empty(1, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, 1)
        return torch.sigmoid(F.linear(x, self.weight))


class InitEmbedding(nn.Embedding):
    """Embedding table ~ N(0, std)."""

    def __init__(self, *args, std: float = 0.02, **kwargs) -> None:
        self.std = std
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class ZeroCenteredNorm(nn.Module):
    """LayerNorm or RMSNorm whose scale is (1 + weight), weight starting at zero
    (Megatron's ``--apply-layernorm-1p``): weight decay then pulls the scale towards
    1 rather than 0. Same function as the plain norm at initialisation."""

    def __init__(self, size: int, eps: float, kind: Normalization) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.empty(size))
        self.bias = nn.Parameter(torch.empty(size)) if kind is Normalization.LAYER_NORM else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight + 1
        if self.kind is Normalization.LAYER_NORM:
            return F.layer_norm(x, scale.shape, scale, self.bias, self.eps)
        return F.rms_norm(x, scale.shape, scale, self.eps)


def build_norm(cfg: GPTConfig, size: int) -> nn.Module:
    """The configured norm over the last ``size`` channels. LayerNorm keeps its bias
    even with ``add_bias_linear=False``, as in Megatron; RMSNorm has none."""
    if cfg.apply_layernorm_1p:
        return ZeroCenteredNorm(size, cfg.norm_epsilon, cfg.normalization)
    if cfg.normalization is Normalization.RMS_NORM:
        return nn.RMSNorm(size, eps=cfg.norm_epsilon)
    return nn.LayerNorm(size, eps=cfg.norm_epsilon)


class MLP(nn.Module):
    """The feed-forward branch: GELU (GPT), gated SiLU (``swiglu``, Llama) or relu^2
    (``squared_relu``).

    With swiglu, ``fc`` produces [gate | up] side by side (Megatron's
    ``linear_fc1`` layout) and the output is proj(silu(gate) * up)."""

    def __init__(self, cfg: GPTConfig, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        ffn = ffn_hidden_size or cfg.ffn_hidden_size
        self.swiglu, self.squared_relu = cfg.swiglu, cfg.squared_relu
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        self.fc = InitLinear(cfg.hidden_size, 2 * ffn if cfg.swiglu else ffn, bias=cfg.add_bias_linear,
                             std=cfg.init_method_std)
        self.proj = InitLinear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear, std=scaled_init_std(cfg))

    def forward(self, x: torch.Tensor, per_token_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``per_token_scale`` (n,): an MoE expert's routing weights for the n rows of
        ``x``; the output is then scale * MLP(x), computed as Megatron-core's experts do
        (the scale multiplies the activation before ``proj`` and the bias after it), so
        a wider-dtype weight (``moe_router_dtype``) is applied in that dtype and rounded
        once to the activation's dtype."""
        h = self.fc(x)  # (..., ffn) or (..., 2 * ffn)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up  # (..., ffn)
        elif self.squared_relu:
            h = F.relu(h).pow(2)
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        if per_token_scale is None:
            return self.proj(h)  # (..., hidden)
        scale = per_token_scale.unsqueeze(-1)  # (n, 1)
        h = (h * scale).to(h.dtype)
        return self.proj(h, bias_scale=scale)  # (n, hidden)
