"""Multi-token prediction (DeepSeek-V3's MTP, Megatron's ``--mtp-num-layers``) for the
embedded GPT, with megatron-core's ``MultiTokenPredictionBlock`` semantics.

    h_0 = ln_f(decoder output)                                         (b, t, hidden)
    for depth k = 1 .. D:
        e_k = embedding(tokens << k, positions << k)    the main model's embedding, dropout included
        h_k = final_norm_k(block_k(eh_proj_k([enorm_k(e_k) ; hnorm_k(h_{k-1})])))
        loss_k = token-mean cross-entropy of output_layer(h_k) against labels << k
    MTP loss = mtp_loss_scaling_factor / D * sum_k loss_k

``x << k`` is [Note: shifting left]. ``block_k`` is a ``TransformerBlock`` of the last
decoder layer's kind (dense or MoE, as Megatron-LM's ``get_gpt_mtp_block_spec`` takes the
last layer's spec), and ``output_layer`` is the main model's (tied to the embedding or
not). Rotary embeddings inside ``block_k`` see positions 0 .. t-1, as the decoder's
(megatron-core hands every MTP layer the decoder's rotary table); learned absolute
positions are looked up at the shifted positions, as megatron-core rolls position ids.

The MTP loss changes no logit and no reported loss: it only adds its gradient
([Note: attaching the MTP loss]). It runs in training forwards given labels with
gradients on; evaluation and generation see the plain GPT.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig, RecomputeGranularity, RecomputeMethod
from .layers import InitLinear, build_norm
from .losses import AttachLossGradient, token_cross_entropy
from .transformer import TransformerBlock

# (tokens (b, t), positions (b, t)) -> embeddings (b, t, hidden): the GPT's shared embedding.
Embed = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """[Note: shifting left] ``x`` (b, t) moved ``n`` places left along time, the last
    ``n`` places filled with zeros: position i holds x[i + n]. megatron-core's
    ``roll_tensor`` (applied once per depth, so depth k sees a shift of k) does the
    same; the zero-filled tail holds token id 0 at position 0, and its labels are
    masked out of the loss."""
    t = x.shape[-1]
    if n >= t:
        return torch.zeros_like(x)
    return torch.cat([x[..., n:], x.new_zeros(*x.shape[:-1], n)], dim=-1)


def mtp_moe_layers(cfg: GPTConfig) -> int:
    """MoE layers among the MTP depths: all of them when the last decoder layer is MoE (their
    kind), else none. Megatron-LM averages its logged balancing loss over these too."""
    if not cfg.mtp_num_layers or cfg.num_moe_experts is None:
        return 0
    return cfg.mtp_num_layers if cfg.is_moe_layer(cfg.num_layers - 1) else 0


@dataclasses.dataclass(kw_only=True)
class MTPLossSettings:
    """How the MTP loss enters the gradient: set by the training loop, not the architecture."""

    backward_scale: float = 1.0
    """Gradient handed to the MTP loss in backward: the factor the training loop applies to
    the language-model loss of one forward (1 / micro batches times the loss scale; the loss
    scale alone with ``per_token``). See [Note: attaching the MTP loss]."""
    per_token: bool = False
    """``--calculate-per-token-loss``: see [Note: per-token MTP loss]."""
    bf16_logits_grad: bool = False
    """``--cross-entropy-loss-fusion``: the MTP logits' gradient rounded to bf16, as the main
    loss's (``losses.LogitsGradInBF16``); megatron-core computes both losses with one function."""


class MTPLayer(nn.Module):
    """One prediction depth (megatron-core's ``MultiTokenPredictionLayer``; state dict names
    ``enorm``, ``hnorm``, ``eh_proj``, ``block`` (a ``TransformerBlock``), ``final_norm``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = build_norm(cfg, h)
        self.hnorm = build_norm(cfg, h)
        # megatron-core: no bias whatever add_bias_linear says, init N(0, init_method_std).
        self.eh_proj = InitLinear(2 * h, h, bias=False, std=cfg.init_method_std)
        self.block = TransformerBlock(cfg, layer_number=cfg.num_layers - 1)  # the last decoder layer's kind
        self.final_norm = build_norm(cfg, h)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """hidden: the previous depth's output, embedded: the shifted tokens' embeddings,
        both (b, t, hidden) -> this depth's output (b, t, hidden)."""
        # [embedding ; hidden], megatron-core's order: (b, t, 2 * hidden) -> (b, t, hidden)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_norm(self.block(x))


class MultiTokenPrediction(nn.Module):
    """The D prediction depths and their loss (megatron-core's ``MultiTokenPredictionBlock``
    and the MTP part of ``GPTModel._postprocess``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.mtp_num_layers))
        self.scaling_factor = cfg.mtp_loss_scaling_factor
        # megatron-core checkpoints each depth under uniform full recomputation (config.py
        # requires one layer per chunk then) and skips MTP under block recomputation.
        self.recompute = cfg.recompute_granularity is RecomputeGranularity.FULL \
            and cfg.recompute_plan[0] is RecomputeMethod.UNIFORM
        self.settings = MTPLossSettings()
        self.last_losses: Optional[torch.Tensor] = None
        """(D,) each depth's token-mean loss of the latest training forward, detached (for
        Megatron-LM's ``mtp_k loss`` log fields); None before the first."""

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, *, embed: Embed,
                output: nn.Module, context_fn: Optional[Callable] = None) -> torch.Tensor:
        """hidden (b, t, hidden): the decoder's normed output; tokens, labels (b, t) ->
        ``hidden`` with the MTP loss attached. ``output``: the shared output layer;
        ``context_fn``: torch checkpoint's, for the recomputation of a depth."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        total = hidden.new_zeros((), dtype=torch.float32)
        logged = []
        h = hidden
        for k, layer in enumerate(self.layers, start=1):
            embedded = embed(shift_left(tokens, k), shift_left(positions, k))  # (b, t, hidden)
            if self.recompute and torch.is_grad_enabled():
                h = checkpoint(layer, h, embedded, use_reentrant=False,
                               **({"context_fn": context_fn} if context_fn is not None else {}))
            else:
                h = layer(h, embedded)
            losses = token_cross_entropy(output(h), shift_left(labels, k),
                                         bf16_logits_grad=self.settings.bf16_logits_grad)  # (b, t), fp32
            counted = b * max(t - k, 0)  # the tokens whose label lies inside the sequence
            loss_sum = losses[:, : max(t - k, 0)].sum()  # the shifted-in tail is masked out
            logged.append(loss_sum.detach() / max(counted, 1))
            total = total + loss_sum * self._weight(counted, b * t)
        self.last_losses = torch.stack(logged)
        # [Note: attaching the MTP loss] As megatron-core's ``MTPLossAutoScaler``: the main
        # logits (and so the reported LM loss) are untouched, while the backward from the LM
        # loss also runs the MTP loss's backward through the depths, the shared embedding and
        # output layer, into the decoder. With the LM loss's own factor as the scale, the
        # gradient is that of ``lm_loss + MTP loss``.
        return AttachLossGradient.apply(hidden, total, self.settings.backward_scale)

    def _weight(self, counted: int, tokens: int) -> float:
        """[Note: per-token MTP loss] Each depth's loss sum enters the objective divided by
        its own token count, times scaling_factor / D. In per-token mode the training loop
        divides every gradient by the global batch's token count afterwards, so the sum is
        multiplied by this micro batch's tokens instead (``tokens / counted``): the depth
        weighs as a token mean there too. That is the pinned Megatron-LM's
        ``process_mtp_loss``; megatron-core 0.16.1 leaves the ratio out (mcore_mtp.py)."""
        scale = self.scaling_factor / len(self.layers) / max(counted, 1)
        return scale * tokens if self.settings.per_token else scale
