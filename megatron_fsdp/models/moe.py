"""Mixture of experts: a top-k router over MLP experts, with the switch-transformer
load-balancing loss, following Megatron-core's ``TopKRouter`` / ``MoELayer``
semantics (dropless, softmax score function, ``aux_loss`` balancing).

[Note: expert parameters] Every expert's parameters carry Megatron's mark
``param.allreduce = False``. megatron_fsdp reads that mark
(``megatron_fsdp.marks.is_expert_param``) and keeps those parameters in their
own buffers on the expert data-parallel group of ``expt_device_mesh``; pass one
when wrapping (``expert_device_mesh()`` builds it for expert-parallel size 1,
where every rank holds every expert). The attribute is Megatron's public
convention, set where the experts are built, as Megatron's own layers do.

[Note: attaching the aux loss] The load-balancing loss is not added to the
language-model loss the caller computes. As in Megatron-core
(``MoEAuxLossAutoScaler``), it rides on the layer's output: forward is the
identity, backward also hands ``aux_loss_scale`` to the aux loss as its
gradient. The gradient is therefore that of ``lm_loss + sum(aux losses)`` when
``lm_loss`` is the mean over the tokens of one forward and the scale is 1, and
it flows back through the block's output, so megatron_fsdp's per-unit
pre-backward gather and activation recomputation see nothing unusual. When the
training loop divides the loss (gradient accumulation over N micro-batches,
loss scaling), set the same factor with ``GPT.set_moe_aux_loss_scale``.

[Note: router dtype] ``GPTConfig.moe_router_dtype`` (Megatron's
``--moe-router-dtype``) follows Megatron-core's ``router_gating_linear``: the
tokens and the router weight are cast to that dtype for the gating GEMM, so the
logits -- and with them the top-k choice, the softmax and the balancing loss --
are computed in it (under a bf16 model, an fp32 router picks the experts an fp32
model would, where bf16 logits would tie or swap near-equal experts). Autocast is
switched off for that GEMM, or the DDP path's bf16 autocast would undo the cast.
The backward of the casts hands the gradients back in the tokens' and the weight's
own dtypes, as Megatron's custom backward does. The routing weights stay in the
router dtype until they scale an expert's activation inside its MLP (Megatron-core's
``per_token_scale``): the product is taken in the wider dtype and rounded once to
the activation's dtype; expert outputs are then summed in the tokens' dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..marks import is_expert_param
from .config import GPTConfig, MoELoadBalancing, RouterDtype
from .layers import MLP

_ROUTER_DTYPES = {RouterDtype.FP32: torch.float32, RouterDtype.FP64: torch.float64}


def mark_expert_parameters(module: nn.Module) -> None:
    """Mark ``module``'s parameters as expert parameters (Megatron's ``allreduce=False``)."""
    for param in module.parameters():
        param.allreduce = False


def has_expert_parameters(module: nn.Module) -> bool:
    return any(is_expert_param(p) for p in module.parameters())


def expert_device_mesh(device_type: str):
    """The expert data-parallel mesh for expert-parallel size 1: the same ranks and
    dimension names as megatron_fsdp's default mesh, so ``fully_shard(...,
    expt_device_mesh=expert_device_mesh("cpu"))`` puts the experts on it."""
    from ..distributed_index import build_default_mesh

    return build_default_mesh(device_type)


def route(logits: torch.Tensor, topk: int, pre_softmax: bool = False,
          scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, E) -> probs (n, k), expert indices (n, k).

    Megatron's default: pick the k largest logits, softmax over those k (each token's
    weights sum to 1). ``pre_softmax``: softmax over all E, then pick the k largest
    probabilities without renormalising. The choice is made in the logits' dtype (the
    router dtype); softmax and ``scaling_factor`` in fp32, then probs in the logits'
    dtype -- Megatron-core's order, so a bf16 router rounds the scaled weight once."""
    if pre_softmax:
        probs, indices = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(topk, dim=-1)
    else:
        top_logits, indices = logits.topk(topk, dim=-1)
        probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs.type_as(logits), indices


def switch_load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, coeff: float) -> torch.Tensor:
    """Switch-transformer balancing loss of one layer on the tokens of one forward:

        coeff * E * sum_i f_i * P_i,  f_i = (tokens routed to i) / (T * k),  P_i = mean_x softmax(logits_x)_i

    (Megatron-core's ``switch_load_balancing_loss_func``). It is 1 * coeff when
    routing is uniform and grows as tokens pile onto few experts. Only P carries a
    gradient (the counts are not differentiable)."""
    return sequence_load_balancing_loss(logits, indices, coeff, num_sequences=1)


def sequence_load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, coeff: float,
                                 num_sequences: int) -> torch.Tensor:
    """``--moe-router-load-balancing-type seq_aux_loss``: the Switch loss of each
    sequence's tokens on their own (counts and mean scores per sequence), averaged over
    the sequences -- what Megatron-core gets by folding the batch into the expert axis
    (one sequence: ``switch_load_balancing_loss``).
    ``logits`` (b * t, E) in batch-major token order (b sequences of t tokens)."""
    num_tokens, num_experts = logits.shape
    topk = indices.shape[-1]
    length = num_tokens // num_sequences
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32).view(num_sequences, length, num_experts)
    picks = indices.reshape(num_sequences, length * topk)
    counts = torch.zeros(num_sequences, num_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=scores.dtype))  # (b, E)
    scale = num_experts * coeff / (topk * length * length)
    return (scores.sum(dim=1) * counts).sum() * scale / num_sequences


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``activation``; in backward, ``scale`` is the aux loss's gradient.
    See [Note: attaching the aux loss]."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class TopKRouter(nn.Module):
    """Scores every token against every expert: logits = x W^T + b, W ~ N(0, std), in
    ``cfg.moe_router_dtype`` when set (see [Note: router dtype]). As Megatron-core's
    router, it has a bias exactly when the model's linear layers do
    (``add_bias_linear``), drawn from the same N(0, std) as the weight, not zeroed."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.std = cfg.init_method_std
        self.router_dtype: torch.dtype | None = _ROUTER_DTYPES.get(cfg.moe_router_dtype)
        """Dtype of the gating GEMM and of everything routed from its logits; None: the tokens'."""
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))  # (E, hidden)
        self.bias = nn.Parameter(torch.empty(cfg.num_moe_experts)) if cfg.add_bias_linear else None  # (E,)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.normal_(self.bias, mean=0.0, std=self.std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.router_dtype is None:
            return F.linear(tokens, self.weight, self.bias)  # (n, hidden) -> (n, E), the tokens' compute dtype
        bias = None if self.bias is None else self.bias.to(self.router_dtype)
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            return F.linear(tokens.to(self.router_dtype), self.weight.to(self.router_dtype), bias)  # (n, E)


class MoELayer(nn.Module):
    """Replaces a block's MLP: each token goes to its top-k experts and comes back as
    the probability-weighted sum of their outputs. Dropless (no capacity limit)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.topk = cfg.moe_router_topk
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.balancing = cfg.moe_router_load_balancing_type
        # Megatron-core computes no balancing loss for type "none", whatever the coefficient.
        self.aux_loss_coeff = 0.0 if self.balancing is MoELoadBalancing.NONE else cfg.moe_aux_loss_coeff
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.router = TopKRouter(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_ffn_hidden_size) for _ in range(cfg.num_moe_experts))
        mark_expert_parameters(self.experts)
        if cfg.moe_shared_expert_intermediate_size is not None:
            # Every token's; replicated like any dense weight (no expert mark).
            self.shared_experts = MLP(cfg, cfg.moe_shared_expert_intermediate_size)
        self.aux_loss_scale = 1.0
        """Gradient handed to the aux loss in backward; see [Note: attaching the aux loss]."""
        self.last_aux_loss: torch.Tensor | None = None
        """This layer's aux loss of the latest training forward, detached (for logging)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (n, hidden), n = b * t
        logits = self.router(tokens)  # (n, E), in the router dtype
        probs, indices = route(logits, self.topk, self.pre_softmax, self.scaling_factor)  # (n, k), (n, k)
        out = None
        for e, expert in enumerate(self.experts):
            # Every expert runs, on zero tokens if need be: its gradient is then an
            # explicit zero rather than missing, the same on every rank.
            rows, slot = (indices == e).nonzero(as_tuple=True)  # tokens routed to e, and which of their k picks
            routed = expert(tokens[rows], per_token_scale=probs[rows, slot])  # (m, hidden), weighted
            if out is None:  # summed in the experts' output dtype, which autocast may make differ from x's
                out = tokens.new_zeros(tokens.shape, dtype=routed.dtype)
            out = out.index_add(0, rows, routed)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(tokens)
        out = out.view_as(x)  # (b, t, hidden)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            if self.balancing is MoELoadBalancing.SEQ_AUX_LOSS:
                aux_loss = sequence_load_balancing_loss(logits, indices, self.aux_loss_coeff, x.shape[0])
            else:
                aux_loss = switch_load_balancing_loss(logits, indices, self.aux_loss_coeff)
            self.last_aux_loss = aux_loss.detach()
            out = _AttachAuxLoss.apply(out, aux_loss, self.aux_loss_scale)
        return out
