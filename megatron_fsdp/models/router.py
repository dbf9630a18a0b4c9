"""MoE routing: the gating linear, the top-k choice (softmax or sigmoid scores,
group-limited, expert bias, Sinkhorn) and the balancing losses, with the semantics
of megatron-core's ``TopKRouter`` (``moe_utils.topk_routing_with_score_function``,
``switch_load_balancing_loss_func``, ``sinkhorn``); ``moe.py`` runs the experts.
With ``moe_router_force_load_balancing`` the router's logits are replaced by noise
(``forced_routing.py``) before anything below sees them.

Shapes: n tokens, E experts, k = topk, G groups of E / G experts.

[Note: routing precision] Scores are computed in fp32 (softmax with ``dtype=float32``,
``sigmoid(logits.float())``), the sigmoid normalisation and the scaling factor too,
and the routing weights are rounded once to the logits' dtype at the end. That is the
order of the pinned Megatron-LM commit; megatron-core 0.16.1 rounds the scores to the
logits' dtype first. The two agree bit for bit whenever the logits are fp32 (an fp32
model, or ``--moe-router-dtype fp32``).

[Note: expert bias] Aux-loss-free balancing (DeepSeek-V3,
``--moe-router-enable-expert-bias``): the router keeps ``expert_bias`` (E,), a
persistent fp32 buffer that checkpoints with the model (megatron-core's name, so it
maps onto ``decoder.layers.i.mlp.router.expert_bias``). It is added to the sigmoid
scores to *choose* the experts; the routing weights are the unbiased scores of the
chosen ones. Every training forward adds its tokens per expert to the
non-persistent ``local_tokens_per_expert``; once per global batch, after the last
micro batch's backward and before the optimizer step (megatron-core does it in
``finalize_model_grads``, so also in an iteration whose step is then skipped),
``finish_global_batch`` sums the counts over the data-parallel ranks and moves each
bias by ``rate * sign(mean count - count)``, then zeroes the counts. Every rank
applies the same update to the same bias, so the biases stay identical without a
broadcast.

[Note: global aux loss] ``--moe-router-load-balancing-type global_aux_loss``: the
Switch loss whose expert counts are those of the global batch. Each training forward
sums its counts over the data-parallel ranks (an all-reduce inside the forward) and
adds them to ``global_tokens_per_expert``; the loss of micro batch m uses the mean
of the counts of micro batches 1..m (a running mean: megatron-core's ``ga_steps``),
the local scores, and T = local tokens x data-parallel size, so each rank's value is
its share of one loss. Megatron-LM logs ``global_load_balancing_loss`` summed (not
averaged) over the ranks. ``finish_global_batch`` resets the counts.

[Note: counting under recomputation] Counting happens in training forwards only
(grad enabled, as megatron-core's ``torch.is_grad_enabled()`` test). Full
recomputation re-runs a block's forward inside the backward pass (torch's
non-reentrant checkpoint); that second forward must not count again, nor all-reduce
again: it is recognised by running inside a backward graph task, and reads the
running mean the first forward left (the backward of a micro batch runs before the
next micro batch's forward). megatron-core's reentrant checkpoint counts in the
recomputation instead of the first forward: the same counts.

[Note: expert capacity] Megatron-LM's ``--moe-expert-capacity-factor`` (``ExpertCapacity``,
set with ``expert_parallel.set_expert_capacity``): after the top-k choice, as megatron-core's
``apply_router_token_dropping``, each expert keeps at most C = ceil(n k / E x factor) of the
picks of one forward's n tokens -- the tokens this rank routes, so C is per rank and per micro
batch, whatever the expert-parallel size -- and the rest are dropped: the token gets nothing
from that expert (its other picks keep their weights, not renormalised). ``probs`` keeps each
expert's C picks of highest weight, ``position`` its C earliest tokens in megatron-core's
(sequence position, sequence) order. megatron-core ranks with ``topk`` along the tokens, whose
order among equal keys is unspecified; here equal keys go to the earlier pick. For ``probs``
the two then differ only on exact ties of routing weights; for ``position`` megatron-core's
``topk`` of its 0/1 routing map is all ties, and which of an over-full expert's tokens it keeps
is whatever the kernel returns (on CPU not the earliest): here it is the documented rule, the
earliest positions. The balancing losses ignore the drop (they take their own top-k of the
scores); the expert-bias counts see it (megatron-core counts the dropped routing map). Not
with Sinkhorn routing (megatron-core's rule).

[Note: balancing losses under context parallelism] With CP the tokens of each sequence are
spread over the CP ranks (``MoELayer.set_context_parallel_group``). As megatron-core's router
(its ``tp_cp`` group, TP being 1 for MoE here), ``aux_loss`` and ``seq_aux_loss`` sum their
tokens per expert (per sequence for the latter) over the CP group and count the tokens as
local x CP, while the scores stay local: each rank's loss is its share, and the shares of a
CP group add up to the loss of the whole sequences. The gradient each share gets is the
micro batch's factor x CP (megatron-core's schedule sets ``MoEAuxLossAutoScaler`` to
loss_scale x CP / micro batches), which the engine's average over the data x context ranks
divides out again: the router's gradient is the whole sequences' (moe.py,
[Note: attaching the aux loss]).

[Note: where the counts are reduced] Over which ranks each count is summed, here and in
megatron-core (Megatron-LM's groups in brackets; TP is 1 for MoE here):
- ``aux_loss``: the CP group (``tp_cp``); T = local tokens x CP. Not over data parallelism:
  the loss is per forward of each data-parallel rank.
- ``seq_aux_loss``: the per-sequence counts, over the CP group (``tp_cp``); T = local length x CP.
- ``global_aux_loss``: ``data_parallel_group`` (``tp_dp_cp``), in every forward; with CP that
  group must hold the data x context ranks (the default group does, at TP 1); T = local x its size.
- expert bias: ``finish_global_batch``'s group (``tp_dp_cp`` in ``_update_router_expert_bias``),
  once per global batch: the data x context ranks.
Expert parallelism changes none of them: the router is dense, every rank scores its own tokens
against all E experts and counts its own picks, so the counts -- and the losses and the bias --
are those of expert-parallel size 1; the EP group carries only the tokens (expert_parallel.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from .config import GPTConfig, MoELoadBalancing, RouterDtype, ScoreFunction, _ParsedEnum
from .forced_routing import ForcedRoutingStream, random_logits

_ROUTER_DTYPES = {RouterDtype.FP32: torch.float32, RouterDtype.FP64: torch.float64}
_FP32_STATE = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")
"""Router buffers kept in fp32 whatever the model is cast to (see ``TopKRouter._apply``)."""


# -- the top-k choice ------------------------------------------------------------------------
def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-/node-limited routing (DeepSeek-V2/V3): the E experts form G equal groups;
    a group's score is the sum of its topk // group_topk best scores; each token keeps
    its group_topk best groups and picks its k experts among their experts only.
    scores (n, E) -> values (n, k), indices (n, k)."""
    n, experts = scores.shape
    per_group = scores.view(n, num_groups, experts // num_groups)  # (n, G, E/G)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # (n, G)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices  # (n, group_topk)
    keep = torch.zeros(n, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
    keep = keep.repeat_interleave(experts // num_groups, dim=1)  # (n, E)
    return scores.masked_fill(~keep, float("-inf")).topk(topk, dim=-1)


def _select(scores: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def route(logits: torch.Tensor, topk: int, pre_softmax: bool = False, scaling_factor: float | None = None, *,
          score_function: ScoreFunction = ScoreFunction.SOFTMAX, expert_bias: torch.Tensor | None = None,
          num_groups: int | None = None, group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, E) -> routing weights (n, k), expert indices (n, k).

    softmax (Megatron's default): pick the k largest logits, softmax over those k (each
    token's weights sum to 1); ``pre_softmax``: softmax over all E, then the k largest
    probabilities, not renormalised. sigmoid: pick the k largest sigmoid scores (plus
    ``expert_bias`` for the choice only) and, for k > 1, divide the chosen scores by
    their sum. ``group_topk``: the pick is group-limited (``group_limited_topk``).
    ``scaling_factor`` multiplies the weights last. See [Note: routing precision]."""
    select = functools.partial(_select, topk=topk, num_groups=num_groups, group_topk=group_topk)
    if score_function is ScoreFunction.SIGMOID:
        scores = torch.sigmoid(logits.float())  # (n, E)
        if expert_bias is None:
            probs, indices = select(scores)
        else:
            _, indices = select(scores + expert_bias.float())  # the bias steers the choice only
            probs = scores.gather(1, indices)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    elif pre_softmax:
        probs, indices = select(torch.softmax(logits, dim=-1, dtype=torch.float32))
    else:
        top_logits, indices = select(logits)
        probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs.type_as(logits), indices


# -- token dropping ([Note: expert capacity]) ---------------------------------------------------
class TokenDropPolicy(_ParsedEnum):
    """Megatron's ``--moe-token-drop-policy``: which routed tokens an expert over capacity drops."""

    PROBS = "probs"
    """Keep the picks with the highest routing weights (megatron-core's default)."""
    POSITION = "position"
    """Keep the earliest tokens in megatron-core's token order: sequence position first, then
    the sequence (its activations are (t, b)); the tokens at the end of the sequences go."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertCapacity:
    """Megatron's token-dropping settings for one MoE layer ([Note: expert capacity])."""

    factor: float
    """``--moe-expert-capacity-factor``: an expert takes at most ceil(n k / E x factor) of the
    n k picks of one forward's n tokens (megatron-core's ``get_capacity``)."""
    drop_policy: Union[TokenDropPolicy, str] = TokenDropPolicy.PROBS
    """``--moe-token-drop-policy``."""
    pad_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: megatron-core then feeds every expert exactly its
    capacity, the gaps filled with zero-weight tokens, for static shapes. The outputs and
    gradients are those of the unpadded drop, so nothing is padded here; what it does change,
    as in megatron-core, is the expert-bias count: every expert counts its capacity (or every
    token, when the capacity exceeds them), so the bias stands still."""

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"moe_expert_capacity_factor={self.factor!r} must be a positive number (1.0: each expert "
                             "takes its even share of the picks); pass None for dropless routing")
        object.__setattr__(self, "drop_policy", TokenDropPolicy.parse(self.drop_policy, arg_name="moe_token_drop_policy"))

    def capacity(self, num_tokens: int, topk: int, num_experts: int) -> int:
        """megatron-core's ``get_capacity`` of the n x k picks, over this forward's (local) tokens."""
        return math.ceil((num_tokens * topk / num_experts) * self.factor)

    def keep(self, probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
             sequences: int) -> Optional[torch.Tensor]:
        """probs, indices (n, k) of ``sequences`` batch-major sequences -> (n, k) bool: the picks
        within their expert's capacity; None when no expert is over it."""
        n, k = indices.shape
        capacity = self.capacity(n, k, num_experts)
        if capacity >= n:  # no expert can hold more than every token once
            return None
        if self.drop_policy is TokenDropPolicy.PROBS:
            priority = probs.detach().reshape(-1)  # (n * k,)
        else:  # megatron-core's token index of batch-major row i = b * t + s is s * B + b
            rows = torch.arange(n, device=indices.device)
            length = n // sequences
            priority = -((rows % length) * sequences + rows // length).repeat_interleave(k)  # (n * k,)
        return keep_within_capacity(priority, indices.reshape(-1), num_experts, capacity).view(n, k)

    def routed_counts(self, indices: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int) -> torch.Tensor:
        """Tokens per expert (E,) the expert-bias update counts: the kept picks, or with
        ``pad_to_capacity`` the padded inputs, min(capacity, n) for every expert."""
        if self.pad_to_capacity:
            n, k = indices.shape
            fill = min(self.capacity(n, k, num_experts), n)
            return torch.full((num_experts,), float(fill), device=indices.device)
        return expert_counts(indices if keep is None else indices[keep], num_experts)


def keep_within_capacity(priority: torch.Tensor, experts: torch.Tensor, num_experts: int,
                         capacity: int) -> torch.Tensor:
    """priority (m,), experts (m,) the expert of each pick -> (m,) bool: every expert keeps its
    ``capacity`` picks of highest priority, ties going to the earlier pick."""
    m = experts.numel()
    order = torch.argsort(priority, descending=True, stable=True)
    order = order[torch.argsort(experts[order], stable=True)]  # grouped by expert, best first
    per_expert = torch.bincount(experts, minlength=num_experts)
    starts = per_expert.cumsum(0) - per_expert
    rank = torch.arange(m, device=experts.device) - starts[experts[order]]  # place within its expert
    keep = torch.empty(m, dtype=torch.bool, device=experts.device)
    keep[order] = rank < capacity
    return keep


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) (n, E): alternately rescale rows and columns
    until the column factors move by less than ``tol`` on average (megatron-core's
    iteration, eps 1e-8 in the divisions). Returns the balanced matrix (n, E)."""
    cost = torch.exp(cost)
    rows, cols = cost.shape
    row_scale = torch.ones(rows, device=cost.device, dtype=cost.dtype)
    col_scale = torch.ones(cols, device=cost.device, dtype=cost.dtype)
    previous, error = col_scale, 1e9
    while error > tol:
        row_scale = (1 / rows) / (torch.sum(col_scale * cost, 1) + 1e-8)
        col_scale = (1 / cols) / (torch.sum(row_scale.unsqueeze(1) * cost, 0) + 1e-8)
        error = torch.mean(torch.abs(previous - col_scale))
        previous = col_scale
    return col_scale * cost * row_scale.unsqueeze(1)


def sinkhorn_route(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``--moe-router-load-balancing-type sinkhorn`` (S-BASE): in training the k experts are
    the largest entries of the Sinkhorn-balanced fp32 logits (no gradient through the
    choice); in evaluation the largest activations. The weights are the activations of
    the chosen experts: sigmoid for k = 1, else the softmax over all E (not renormalised,
    no scaling factor). logits (n, E) -> weights (n, k), indices (n, k)."""
    if topk == 1:
        activation = torch.sigmoid(logits)
    else:
        activation = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            _, indices = sinkhorn(logits.float()).topk(topk, dim=1)
    else:
        _, indices = activation.topk(topk, dim=1)
    return activation.gather(1, indices), indices


# -- balancing losses ------------------------------------------------------------------------
def balancing_scores(logits: torch.Tensor, score_function: ScoreFunction = ScoreFunction.SOFTMAX) -> torch.Tensor:
    """The scores the balancing losses average (n, E), fp32: softmax over all experts, or
    the sigmoid scores divided by their sum over all experts."""
    if score_function is ScoreFunction.SIGMOID:
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (E,), fp32 (exact below 2**24), from indices (n, k)."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=indices.device)
    return counts.scatter_add_(0, indices.reshape(-1), torch.ones(indices.numel(), device=indices.device))


def switch_loss(scores: torch.Tensor, counts: torch.Tensor, num_tokens: int, topk: int, coeff: float) -> torch.Tensor:
    """coeff * E / (k * T^2) * sum_i (sum_x scores_x,i) * counts_i: the Switch-transformer loss
    coeff * E * sum_i f_i P_i with f_i = counts_i / (T k), P_i = mean score (the scores may be
    one rank's part of T tokens). Only the scores carry a gradient."""
    num_experts = scores.shape[-1]
    return torch.sum(scores.sum(dim=0) * counts) * (num_experts * coeff / (topk * num_tokens * num_tokens))


def switch_load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, coeff: float,
                               score_function: ScoreFunction = ScoreFunction.SOFTMAX) -> torch.Tensor:
    """Switch-transformer balancing loss of one layer on the tokens of one forward
    (``aux_loss``): 1 * coeff when routing is uniform, growing as tokens pile onto few
    experts. ``indices`` (n, k): the tokens' top-k by the balancing scores."""
    scores = balancing_scores(logits, score_function)
    return switch_loss(scores, expert_counts(indices, scores.shape[-1]), logits.shape[0], indices.shape[-1], coeff)


def sequence_loss(scores: torch.Tensor, indices: torch.Tensor, coeff: float, num_sequences: int,
                  group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``seq_aux_loss``: the Switch loss of each sequence's tokens on their own (counts and
    mean scores per sequence), averaged over the sequences -- what megatron-core gets by
    folding the batch into the expert axis. ``scores`` (b * t, E) in batch-major token
    order (b sequences of t tokens), ``indices`` (b * t, k). ``group``: the context-parallel
    group sharing every sequence (each rank holds t of its CP x t tokens): the per-sequence
    counts are summed over it and the length is CP x t, so the value is this rank's share of
    the whole sequences' loss ([Note: balancing losses under context parallelism])."""
    num_tokens, num_experts = scores.shape
    topk = indices.shape[-1]
    length = num_tokens // num_sequences
    scores = scores.view(num_sequences, length, num_experts)
    picks = indices.reshape(num_sequences, length * topk)
    counts = torch.zeros(num_sequences, num_experts, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=scores.dtype))  # (b, E)
    counts = sum_over_group(counts, group, "seq_aux_loss_counts")
    whole = length * group_size(group)
    scale = num_experts * coeff / (topk * whole * whole)
    return (scores.sum(dim=1) * counts).sum() * scale / num_sequences


def sequence_load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, coeff: float, num_sequences: int,
                                 score_function: ScoreFunction = ScoreFunction.SOFTMAX) -> torch.Tensor:
    """``sequence_loss`` from the logits (b * t, E)."""
    return sequence_loss(balancing_scores(logits, score_function), indices, coeff, num_sequences)


# -- the router module -----------------------------------------------------------------------
def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation recomputation. See
    [Note: counting under recomputation]."""
    return torch._C._current_graph_task_id() != -1


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks of an optional group (the context-parallel one): None is one rank, not the world."""
    return 1 if group is None else dist.get_world_size(group)


def sum_over_group(counts: torch.Tensor, group: Optional[dist.ProcessGroup], label: str) -> torch.Tensor:
    """``counts`` summed over ``group`` (a new tensor, no gradient); ``counts`` itself when
    ``group`` is None or one rank. One all-reduce, labelled for profiles and tests."""
    if group_size(group) == 1:
        return counts
    with torch.no_grad(), record_function(f"megatron_fsdp::moe_all_reduce:{label}"):
        summed = counts.detach().clone()
        dist.all_reduce(summed, group=group)
    return summed


class TopKRouter(nn.Module):
    """Scores every token against every expert: logits = x W^T + b, W ~ N(0, std), in
    ``cfg.moe_router_dtype`` when set (see moe.py's [Note: router dtype]). As Megatron-core's
    router, it has a bias exactly when the model's linear layers do (``add_bias_linear``),
    drawn from the same N(0, std) as the weight, not zeroed. It also holds the balancing
    state megatron-core's router holds, under the same names: ``expert_bias`` and
    ``local_tokens_per_expert`` ([Note: expert bias]), ``global_tokens_per_expert`` and
    ``ga_steps`` ([Note: global aux loss]); each is None when its feature is off."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.std = cfg.init_method_std
        self.router_dtype: torch.dtype | None = _ROUTER_DTYPES.get(cfg.moe_router_dtype)
        """Dtype of the gating GEMM and of everything routed from its logits; None: the tokens'."""
        experts = cfg.num_moe_experts
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size))  # (E, hidden)
        self.bias = nn.Parameter(torch.empty(experts)) if cfg.add_bias_linear else None  # (E,)
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.data_parallel_group: Optional[dist.ProcessGroup] = None
        """Where the global aux loss sums its counts in forward; None: the default group
        (when torch.distributed is initialised). ``GPT.set_moe_data_parallel_group`` sets it."""
        self.expert_bias: Optional[torch.Tensor]
        self.local_tokens_per_expert: Optional[torch.Tensor]
        self.global_tokens_per_expert: Optional[torch.Tensor]
        self.ga_steps: Optional[torch.Tensor]
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))  # persistent: checkpointed
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        if cfg.moe_router_load_balancing_type is MoELoadBalancing.GLOBAL_AUX_LOSS and cfg.moe_aux_loss_coeff > 0:
            self.register_buffer("global_tokens_per_expert", torch.zeros(experts), persistent=False)
            self.register_buffer("ga_steps", torch.zeros(()), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None
        self.forced_routing: Optional[ForcedRoutingStream] = (
            ForcedRoutingStream.from_torch_seed() if cfg.moe_router_force_load_balancing else None)
        """``--moe-router-force-load-balancing``: the noise that replaces the logits (a GPT
        shares one stream among its routers); None: route on the logits."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.normal_(self.bias, mean=0.0, std=self.std)
        with torch.no_grad():
            for name in _FP32_STATE:
                state = getattr(self, name)
                if state is not None:
                    state.zero_()

    def _apply(self, fn, recurse: bool = True):
        """Keep the balancing state in fp32 (and its exact values) through ``model.to(bf16)``
        and the like, as megatron-core keeps ``expert_bias`` fp32 under Float16Module: a
        bf16 bias could not hold steps of 1e-3 around its values. Moves still apply."""
        kept = {name: self._buffers[name] for name in _FP32_STATE if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:
                self._buffers[name] = after.float() if before.is_meta or after.is_meta else before.to(after.device)
        return self

    def forward(self, tokens: torch.Tensor, sequences: int = 1) -> torch.Tensor:
        """tokens (n, hidden), batch-major rows of ``sequences`` sequences -> logits (n, E)
        (with forced routing, the noise that replaces them: forced_routing.py)."""
        logits = self.gating(tokens)
        if self.forced_routing is not None:
            logits = random_logits(logits, self.forced_routing, sequences)
        return logits

    def gating(self, tokens: torch.Tensor) -> torch.Tensor:
        """The gating linear: tokens (n, hidden) -> logits (n, E) (megatron-core's name)."""
        if self.router_dtype is None:
            return F.linear(tokens, self.weight, self.bias)  # (n, hidden) -> (n, E), the tokens' compute dtype
        bias = None if self.bias is None else self.bias.to(self.router_dtype)
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            return F.linear(tokens.to(self.router_dtype), self.weight.to(self.router_dtype), bias)  # (n, E)

    # -- balancing state -----------------------------------------------------------------------
    def count_routed(self, counts: torch.Tensor) -> None:
        """Add a training forward's tokens per expert (E,) (the routed picks that reach
        their experts: after token dropping, as megatron-core counts its routing map) to
        ``local_tokens_per_expert``; see [Note: counting under recomputation]."""
        if self.local_tokens_per_expert is None or not torch.is_grad_enabled() or _recomputing():
            return
        with torch.no_grad():
            self.local_tokens_per_expert += counts.to(self.local_tokens_per_expert.dtype)

    def global_load_balancing_loss(self, scores: torch.Tensor, indices: torch.Tensor, coeff: float) -> torch.Tensor:
        """The global aux loss of this forward ([Note: global aux loss]): local scores (n, E),
        the balancing top-k indices (n, k)."""
        group = self.data_parallel_group
        if not _recomputing():
            with torch.no_grad():
                counts = expert_counts(indices, scores.shape[-1])
                if _world(group) > 1:
                    dist.all_reduce(counts, group=group)
                self.global_tokens_per_expert += counts
                self.ga_steps += 1
        mean_counts = self.global_tokens_per_expert / self.ga_steps
        return switch_loss(scores, mean_counts, scores.shape[0] * _world(group), indices.shape[-1], coeff)

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new global batch for the global aux loss (megatron-core's method name)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()


# -- once per global batch -------------------------------------------------------------------
def _bias_routers(model: nn.Module) -> list[nn.Module]:
    """Routers with an expert bias: ours and megatron-core's (same buffer names)."""
    return [m for m in model.modules()
            if getattr(m, "expert_bias", None) is not None and getattr(m, "local_tokens_per_expert", None) is not None]


def _bias_update_rate(router: nn.Module) -> float:
    rate = getattr(router, "bias_update_rate", None)
    return rate if rate is not None else router.config.moe_router_bias_update_rate  # megatron-core's router


@torch.no_grad()
def finish_global_batch(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """What megatron-core's ``finalize_model_grads`` does for MoE routers, once per global
    batch after the last micro batch's backward: update every expert bias from the
    tokens per expert of all micro batches summed over ``group`` (the data-parallel
    group; None: the default group), bias += rate * sign(mean - count), then zero those
    counts and reset the global-aux-loss counts. One all-reduce for all layers; nothing
    when no router has an expert bias. Works on our routers and megatron-core's."""
    routers = _bias_routers(model)
    if routers:
        counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])  # (layers, E)
        if _world(group) > 1:
            dist.all_reduce(counts, group=group)
        offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts  # mean - count
        for router, row in zip(routers, offset):
            router.expert_bias.copy_(router.expert_bias + torch.sign(row) * _bias_update_rate(router))
            router.local_tokens_per_expert.zero_()
    for module in model.modules():
        reset = getattr(module, "reset_global_aux_loss_tracker", None)
        if callable(reset):
            reset()


def balancing_logged_as_rank_sum(model: nn.Module) -> bool:
    """Whether the model's logged balancing loss is summed over the data-parallel ranks
    rather than averaged (the global aux loss: ``MoELoadBalancing.logged_as_rank_sum``)."""
    return any(getattr(m, "global_tokens_per_expert", None) is not None for m in model.modules())
