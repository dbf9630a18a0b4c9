"""Mixture of experts: top-k routed MLP experts with megatron-core's ``MoELayer``
semantics (dropless). The router -- gating, score functions, group-limited routing,
expert bias, Sinkhorn, balancing losses -- lives in ``router.py``.

[Note: expert parameters] Every expert's parameters carry Megatron's mark
``param.allreduce = False``. megatron_fsdp reads that mark
(``megatron_fsdp.param_marks.is_expert_param``) and keeps those parameters in their
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

from ..param_marks import is_expert_param
from .config import GPTConfig, MoELoadBalancing, ScoreFunction
from .layers import MLP, SharedExpertGate
from .losses import AttachLossGradient
from .router import (  # noqa: F401  (re-exported: the routing API's former home)
    TopKRouter,
    balancing_scores,
    expert_counts,
    route,
    sequence_load_balancing_loss,
    sequence_loss,
    sinkhorn_route,
    switch_load_balancing_loss,
    switch_loss,
)


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
    from ..comm.distributed_index import build_default_mesh

    return build_default_mesh(device_type)


class SharedExpertMLP(MLP):
    """The shared expert: a dense MLP every token passes through, its output added to
    the routed experts'. With ``moe_shared_expert_gate`` the output is first scaled per
    token by ``gate(x)`` = sigmoid(x . w) (megatron-core's ``SharedExpertMLP``); the
    gate is a child built after ``fc`` and ``proj``, so a meta-device build draws their
    initial values in the same order as an eager one."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg, cfg.moe_shared_expert_intermediate_size)
        if cfg.moe_shared_expert_gate:
            self.gate = SharedExpertGate(cfg.hidden_size, std=cfg.init_method_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, hidden)
        out = super().forward(x)
        if hasattr(self, "gate"):
            out = out * self.gate(x)  # (n, hidden) * (n, 1)
        return out


class MoELayer(nn.Module):
    """Replaces a block's MLP: each token goes to its top-k experts and comes back as
    the probability-weighted sum of their outputs. Dropless (no capacity limit)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.topk = cfg.moe_router_topk
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.score_function: ScoreFunction = cfg.moe_router_score_function
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.balancing = cfg.moe_router_load_balancing_type
        # Megatron-core computes no balancing loss for type "none", whatever the coefficient.
        self.aux_loss_coeff = 0.0 if self.balancing is MoELoadBalancing.NONE else cfg.moe_aux_loss_coeff
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.router = TopKRouter(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_ffn_hidden_size) for _ in range(cfg.num_moe_experts))
        mark_expert_parameters(self.experts)
        if cfg.moe_shared_expert_intermediate_size is not None:
            # Every token's; replicated like any dense weight (no expert mark).
            self.shared_experts = SharedExpertMLP(cfg)
        self.aux_loss_scale = 1.0
        """Gradient handed to the aux loss in backward; see [Note: attaching the aux loss]."""
        self.last_aux_loss: torch.Tensor | None = None
        """This layer's aux loss of the latest training forward, detached (for logging)."""

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (n, E) -> routing weights (n, k), expert indices (n, k), per the config."""
        if self.balancing is MoELoadBalancing.SINKHORN:
            return sinkhorn_route(logits, self.topk, self.training)
        return route(logits, self.topk, self.pre_softmax, self.scaling_factor, score_function=self.score_function,
                     expert_bias=self.router.expert_bias, num_groups=self.num_groups, group_topk=self.group_topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (n, hidden), n = b * t
        logits = self.router(tokens, sequences=x.shape[0])  # (n, E), in the router dtype
        probs, indices = self.routing(logits)  # (n, k), (n, k)
        self.router.count_routed(indices)  # expert bias: tokens per expert of training forwards
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
            aux_loss = self._balancing_loss(logits, x.shape[0])
            self.last_aux_loss = aux_loss.detach()
            out = AttachLossGradient.apply(out, aux_loss, self.aux_loss_scale)
        return out

    def _balancing_loss(self, logits: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """The configured balancing loss. As megatron-core, its top-k is taken on the
        balancing scores over all experts (no expert bias, no group limit), not the routing's."""
        scores = balancing_scores(logits, self.score_function)  # (n, E), fp32
        indices = scores.topk(self.topk, dim=-1).indices  # (n, k)
        if self.balancing is MoELoadBalancing.GLOBAL_AUX_LOSS:
            return self.router.global_load_balancing_loss(scores, indices, self.aux_loss_coeff)
        if self.balancing is MoELoadBalancing.SEQ_AUX_LOSS:
            return sequence_loss(scores, indices, self.aux_loss_coeff, num_sequences)
        counts = expert_counts(indices, scores.shape[-1])
        return switch_loss(scores, counts, scores.shape[0], self.topk, self.aux_loss_coeff)
