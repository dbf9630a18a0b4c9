"""A GPT in plain PyTorch (CPU or CUDA), nanoGPT-shaped, covering the GPT-2/3 and
Llama families that Megatron-LM's model flags describe (see ``config.py``).

    tokens (b, t) -> embedding [+ learned positions] -> dropout
                  -> num_layers x TransformerBlock (attention with RoPE/GQA, MLP/swiglu or MoE)
                  -> final norm -> output layer (tied to the embedding, or its own) -> logits (b, t, vocab)
                  [-> with mtp_num_layers and labels, in training: the multi-token prediction
                      depths (mtp.py), whose loss only adds gradients]

Under context parallelism (``context_parallel.apply_context_parallel``) ``tokens`` are this
rank's share of each sequence and the model threads their global positions to the learned
position table and every attention (RoPE, the causal mask).

Every module initialises its own parameters in ``reset_parameters()``, so the
model can be built on the meta device and materialised unit by unit with the same
numbers as an eager build under the same seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig, PositionEmbeddingType, RecomputeGranularity, RecomputeMethod
from .forced_routing import share_stream
from .layers import InitEmbedding, InitLinear, build_norm
from .moe import MoELayer
from .mtp import MultiTokenPrediction
from .transformer import TransformerBlock

# GPTConfig and TransformerBlock are imported from here by existing callers.
__all__ = ["GPT", "GPTConfig", "TransformerBlock", "gpt_loss"]


class SequenceSplit(Protocol):
    """What the model reads from a context-parallel layout (``context_parallel.ContextParallelLayout``)."""

    size: int
    """Ranks sharing each sequence."""

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """(local_length,) the global positions of this rank's tokens; ValueError for a length
        no shard of a valid sequence has."""


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        std = cfg.init_method_std
        self.wte = InitEmbedding(cfg.vocab_size, cfg.hidden_size, std=std)
        if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE:
            self.wpe = InitEmbedding(cfg.seq_length, cfg.hidden_size, std=std)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, layer_number=i) for i in range(cfg.num_layers))
        self.ln_f = build_norm(cfg, cfg.hidden_size)
        # The output layer has no bias in Megatron either; tied, it is the embedding matrix.
        self.lm_head = InitLinear(cfg.hidden_size, cfg.vocab_size, bias=False, std=std)
        if not cfg.untie_embeddings_and_output_weights:
            self.lm_head.weight = self.wte.weight
        # Built before the routers share their noise stream: MTP MoE routers draw from it too.
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_num_layers else None
        # megatron-core's mark (LanguageModule), read by --decoupled-lr's grouping.
        self.wte.weight.is_embedding_or_output_parameter = True
        self.lm_head.weight.is_embedding_or_output_parameter = True
        # --moe-router-force-load-balancing: one noise stream for all routers, as megatron-core's.
        self.forced_routing = share_stream([layer.router for layer in self.moe_layers()])
        self.context_parallel: Optional[SequenceSplit] = None
        """Set by ``apply_context_parallel``: the forward then takes this rank's share of the tokens."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (batch, time) int64 -> logits (batch, time, vocab). ``labels`` (batch, time):
        the next tokens, read only by multi-token prediction (training forwards with gradients)."""
        positions = self._positions(tokens)  # (t,)
        x = self._embed(tokens, positions)  # (b, t, hidden)
        for start, end, recompute in self._block_chunks():
            if recompute and torch.is_grad_enabled():
                x = checkpoint(self._run_blocks, x, start, end, positions, use_reentrant=False,
                               context_fn=self._recompute_contexts)
            else:
                x = self._run_blocks(x, start, end, positions)
        x = self.ln_f(x)
        if labels is not None and self.mtp is not None and self.training and torch.is_grad_enabled():
            x = self.mtp(x, tokens, labels, embed=self._embed, output=self.lm_head,
                         context_fn=self._recompute_contexts)
        return self.lm_head(x)

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """(t,) the global positions of the tokens (b, t): 0 .. t-1, or under context
        parallelism those of this rank's share of sequences CP times as long."""
        t, split = tokens.shape[1], self.context_parallel
        whole = t if split is None else t * split.size
        if whole > self.config.seq_length:
            shard = "" if split is None else f" ({t} on each of {split.size} context-parallel ranks)"
            raise ValueError(f"sequence of {whole} tokens{shard} exceeds seq_length={self.config.seq_length}")
        if split is None:
            return torch.arange(t, device=tokens.device)
        return split.positions(t, tokens.device)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (b, t), positions (t,) or (b, t) -> embeddings (b, t, hidden), learned positions
        added and Megatron's embedding dropout applied; the MTP depths embed through it too."""
        cfg = self.config
        x = self.wte(tokens)
        if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE:
            x = x + self.wpe(positions)
        if cfg.hidden_dropout and self.training:
            x = F.dropout(x, cfg.hidden_dropout, training=True)  # Megatron's embedding dropout
        return x

    def _run_blocks(self, x: torch.Tensor, start: int, end: int, positions: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[start:end]:
            # By keyword: a tensor-parallel plan's input hook on a block reads the positional inputs.
            x = block(x, positions=positions)
        return x

    def _recompute_contexts(self):
        """The recomputation replays the forced-routing noise of the first forward
        (forced_routing.py, [Note: forced routing under recomputation])."""
        if self.forced_routing is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return self.forced_routing.checkpoint_contexts()

    def _block_chunks(self) -> list[tuple[int, int, bool]]:
        """(first block, end, checkpointed?) runs of blocks, per the recompute settings."""
        cfg, layers = self.config, self.config.num_layers
        if cfg.recompute_granularity is not RecomputeGranularity.FULL:
            return [(0, layers, False)]
        method, n = cfg.recompute_plan
        if method is RecomputeMethod.UNIFORM:
            return [(i, min(i + n, layers), True) for i in range(0, layers, n)]
        return [(i, i + 1, True) for i in range(n)] + ([(n, layers, False)] if n < layers else [])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- mixture of experts --------------------------------------------------------------
    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """The gradient every MoE layer hands its load-balancing loss in backward: the
        factor the training loop applies to the language-model loss of one forward
        (e.g. 1 / micro-batches, times the loss scale). See moe.py's
        [Note: attaching the aux loss]."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = float(scale)

    def set_moe_data_parallel_group(self, group) -> None:
        """The data-parallel group the global aux loss sums its expert counts over in
        forward (router.py, [Note: global aux loss]); None, the default: the default group."""
        for layer in self.moe_layers():
            layer.router.data_parallel_group = group

    def moe_load_balancing_loss(self) -> torch.Tensor | None:
        """What Megatron-LM logs as ``load_balancing_loss`` for the latest training
        forward: each MoE layer's switch balancing loss *without* its coefficient
        (1.0 for perfectly even routing), averaged over the MoE layers, detached, on
        the model's device (no host copy: the launcher reads it once per iteration).
        ``None`` when nothing is recorded: a dense model, ``moe_aux_loss_coeff=0``, or a
        balancing type without a loss (megatron-core's tracker then has no entry, and
        Megatron-LM logs no such field)."""
        layers = self.moe_layers()
        coeff = self.config.moe_aux_loss_coeff
        losses = [layer.last_aux_loss for layer in layers if layer.last_aux_loss is not None]
        if not layers or coeff == 0 or not losses:
            return None
        return torch.stack(losses).sum().float().detach() / (coeff * len(layers))

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum over MoE layers of the load-balancing loss of the latest training
        forward, detached (for logging; its gradient is already attached). ``None``
        for a dense model or with ``moe_aux_loss_coeff=0``."""
        losses = [layer.last_aux_loss for layer in self.moe_layers() if layer.last_aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    # -- multi-token prediction ----------------------------------------------------------
    def set_mtp_loss_settings(self, **changes) -> None:
        """Fields of ``mtp.MTPLossSettings`` (the MTP loss's gradient factor, per-token
        mode, bf16 logits gradient); nothing without multi-token prediction."""
        if self.mtp is not None:
            self.mtp.settings = dataclasses.replace(self.mtp.settings, **changes)

    def mtp_losses(self) -> torch.Tensor | None:
        """Each MTP depth's token-mean loss (D,) of the latest training forward, detached, on
        the model's device (Megatron-LM logs them as ``mtp_1 loss`` ...); None without MTP."""
        return self.mtp.last_losses if self.mtp is not None else None


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (b, t, vocab), targets (b, t)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
