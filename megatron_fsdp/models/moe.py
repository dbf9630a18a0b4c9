"""Mixture of experts: top-k routed MLP experts with megatron-core's ``MoELayer``
semantics (dropless, unless a capacity is set). The router -- gating, score functions,
group-limited routing, expert bias, Sinkhorn, balancing losses, token dropping -- lives in
``router.py``; spreading the experts over expert-parallel ranks in ``expert_parallel.py``.

[Note: expert parameters] Every expert's parameters carry Megatron's mark
``param.allreduce = False``. megatron_fsdp reads that mark
(``megatron_fsdp.param_marks.is_expert_param``) and keeps those parameters in their
own buffers on the expert data-parallel group of ``expt_device_mesh``; pass one
when wrapping (``expert_device_mesh()`` builds it for expert-parallel size 1,
where every rank holds every expert; expert_parallel.py shows the mesh for EP > 1). The attribute is Megatron's public
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

With context parallelism (``set_context_parallel_group``) the gradient handed to the aux
loss is ``aux_loss_scale`` x CP, megatron-core's schedule factor; the training loop keeps
setting the factor of its language-model loss (see router.py, [Note: balancing losses under
context parallelism]).

[Note: the routed picks] A forward turns the (n, k) picks into rows grouped by expert: the
kept picks (all of them when dropless; [Note: expert capacity] in router.py) are stably
sorted by expert, so each expert's rows are its tokens in token order, exactly the rows the
per-expert loop of expert-parallel size 1 always fed it. Every local expert runs on its
block of rows (on zero rows if need be: its gradient is then an explicit zero rather than
missing, the same on every rank) with the routing weights as ``per_token_scale``, and one
``index_add`` in that order sums each token's picks, expert by expert. Where the experts live
is the dispatcher's business (``ExpertDispatch``): none, all experts local; under expert
parallelism, ``expert_parallel.AllToAllDispatcher`` sends the rows to the ranks holding their
experts and brings the outputs back in the same order.

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

import dataclasses
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ..param_marks import is_expert_param
from .config import GPTConfig, MoELoadBalancing, ScoreFunction
from .layers import MLP, SharedExpertGate
from .losses import AttachLossGradient
from .router import (  # noqa: F401  (re-exported: the routing API's former home)
    ExpertCapacity,
    TopKRouter,
    balancing_scores,
    expert_counts,
    group_size,
    route,
    sequence_load_balancing_loss,
    sequence_loss,
    sinkhorn_route,
    sum_over_group,
    switch_load_balancing_loss,
    switch_loss,
)

RunExperts = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""rows (m, hidden) grouped by local expert, their routing weights (m,), rows per local
expert -> the weighted expert outputs (m, hidden), same order (``MoELayer.run_experts``)."""


class ExpertDispatch(Protocol):
    """Brings the rows of this rank's picks to the experts that own them and their outputs
    back (``expert_parallel.AllToAllDispatcher``); see [Note: the routed picks]."""

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                 run_experts: RunExperts) -> torch.Tensor:
        """rows (m, hidden) grouped by global expert, weights (m,), counts (E,) int64 rows per
        global expert -> the weighted outputs (m, hidden) of those rows, in the same order."""


@dataclasses.dataclass(frozen=True)
class RoutedPicks:
    """The kept (token, expert) picks of one forward, grouped by expert ([Note: the routed picks])."""

    flat: torch.Tensor
    """(m,) int64: each row's index into the flattened (n * k) picks."""
    token: torch.Tensor
    """(m,) int64: each row's token."""
    counts: torch.Tensor
    """(E,) int64: rows per expert."""


def group_by_expert(indices: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int) -> RoutedPicks:
    """indices (n, k), keep (n, k) bool or None (all) -> the kept picks stably sorted by expert."""
    experts = indices.reshape(-1)  # (n * k,)
    flat = torch.arange(experts.numel(), device=indices.device)
    if keep is not None:
        flat = flat[keep.reshape(-1)]
        experts = experts[flat]
    order = torch.argsort(experts, stable=True)
    flat = flat[order]
    return RoutedPicks(flat=flat, token=flat // indices.shape[1],
                       counts=torch.bincount(experts, minlength=num_experts))


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
    the probability-weighted sum of their outputs. Dropless unless a capacity is set
    (``expert_parallel.set_expert_capacity``); the experts may be spread over ranks
    (``expert_parallel.apply_expert_parallel``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.topk = cfg.moe_router_topk
        self.num_experts = cfg.num_moe_experts
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
        """This layer's aux loss of the latest training forward, detached (for logging); under
        context parallelism this rank's share (the CP group's shares add up to the loss)."""
        self.dispatcher: Optional[ExpertDispatch] = None
        """None: ``experts`` holds every expert. Set by ``apply_expert_parallel``."""
        self.capacity: Optional[ExpertCapacity] = None
        """None: dropless. Set by ``expert_parallel.set_expert_capacity``."""
        self.context_parallel_group: Optional[dist.ProcessGroup] = None
        """The ranks sharing each sequence; see ``set_context_parallel_group``."""

    def set_context_parallel_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """The context-parallel group (``context_parallel.apply_context_parallel`` calls it): the
        balancing losses then count the tokens per expert of the whole sequences and their
        gradient carries the CP factor (router.py, [Note: balancing losses under context
        parallelism]). None: no context parallelism."""
        self.context_parallel_group = group

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
        keep = None if self.capacity is None else self.capacity.keep(probs, indices, self.num_experts, x.shape[0])
        if self.router.local_tokens_per_expert is not None:  # expert bias: tokens per expert, after the drop
            self.router.count_routed(expert_counts(indices, self.num_experts) if self.capacity is None
                                     else self.capacity.routed_counts(indices, keep, self.num_experts))
        out = self._routed_output(tokens, probs, indices, keep)  # (n, hidden)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(tokens)
        out = out.view_as(x)  # (b, t, hidden)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux_loss = self._balancing_loss(logits, x.shape[0])
            self.last_aux_loss = aux_loss.detach()
            scale = self.aux_loss_scale * group_size(self.context_parallel_group)
            out = AttachLossGradient.apply(out, aux_loss, scale)
        return out

    def _routed_output(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                       keep: Optional[torch.Tensor]) -> torch.Tensor:
        """The weighted sum of each token's kept picks (n, hidden); [Note: the routed picks]."""
        picks = group_by_expert(indices, keep, self.num_experts)
        rows = tokens.index_select(0, picks.token)  # (m, hidden)
        weights = probs.reshape(-1).index_select(0, picks.flat)  # (m,), the router dtype
        if self.dispatcher is None:
            outputs = self.run_experts(rows, weights, picks.counts.tolist())
        else:
            outputs = self.dispatcher(rows, weights, picks.counts, self.run_experts)
        # Summed in the experts' output dtype, which autocast may make differ from the tokens'.
        return outputs.new_zeros(tokens.shape).index_add(0, picks.token, outputs)

    def run_experts(self, rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every local expert on its block of ``rows`` (``RunExperts``), zero rows included."""
        experts = list(self.experts)
        if len(counts) != len(experts):
            raise ValueError(f"{len(counts)} row counts for {len(experts)} local experts")
        blocks = zip(experts, rows.split(counts), weights.split(counts))
        return torch.cat([expert(block, per_token_scale=w) for expert, block, w in blocks])  # (m, hidden)

    def _balancing_loss(self, logits: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """The configured balancing loss. As megatron-core, its top-k is taken on the
        balancing scores over all experts (no expert bias, no group limit, no drop), not the
        routing's; its counts are reduced as router.py's [Note: where the counts are reduced]."""
        scores = balancing_scores(logits, self.score_function)  # (n, E), fp32
        indices = scores.topk(self.topk, dim=-1).indices  # (n, k)
        cp_group = self.context_parallel_group
        if self.balancing is MoELoadBalancing.GLOBAL_AUX_LOSS:
            return self.router.global_load_balancing_loss(scores, indices, self.aux_loss_coeff)
        if self.balancing is MoELoadBalancing.SEQ_AUX_LOSS:
            return sequence_loss(scores, indices, self.aux_loss_coeff, num_sequences, group=cp_group)
        counts = sum_over_group(expert_counts(indices, scores.shape[-1]), cp_group, "aux_loss_counts")
        return switch_loss(scores, counts, scores.shape[0] * group_size(cp_group), self.topk, self.aux_loss_coeff)
