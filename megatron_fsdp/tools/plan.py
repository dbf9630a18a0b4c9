"""What a sharded model holds per rank and moves per step, before any GPU is touched.

``python -m megatron_fsdp.tools.plan_cli --model 8b --world 1024 --strategy optim_grads_params``
prints, for one rank, the persistent bytes by role (model weights, main weights,
main gradients, optimizer state) and the collectives of one steady-state step
(count and payload bytes per kind). ``--check`` then builds the same model through
the real construction path on torch's fake process group (``simulate.py``: meta
device, per-rank shards only) and compares every number.

The plan is derived here from the model's *structure* only (which parameters sit in
which FSDP unit, their sizes and dtypes), with its own statement of the rules, so
that ``--check`` compares two independent derivations rather than the engine with
itself. The rules, for one microbatch per step (``S`` = sharded groups)::

    persistent per group     model weights   main weights      main grads
    no_shard                 padded          padded (if any)   padded
    optim                    padded          shard             padded
    optim_grads              padded          shard             shard
    optim_grads_params       shard           shard             shard

    collectives per step     all_gather                         gradient collective
    no_shard                 -                                  all_reduce per group
    optim / optim_grads      per group (refresh after the step) reduce_scatter per group
    optim_grads_params       root groups once; unit groups in   reduce_scatter per group
                             forward and backward, except the
                             last unit, kept from its forward
                             into its backward

``padded`` is a group's size rounded up to a multiple of the data-parallel size,
``shard`` that divided by it. The textbook ZeRO formula (``zero_formula``) is the same
without padding; the plan reports the padding separately so the two can be compared
exactly. Main weights exist only when their dtype differs from the compute dtype.

[Note: the plan under tensor parallelism] With ``tp`` > 1 the world is ``dp x tp``
(tp fastest, Megatron-LM's rank order) and the model is the GPT under the embedded
models' TP plan (``models.tensor_parallel.apply_tensor_parallel``, without sequence
parallelism): each rank holds its TP-local tensors (``TP_SPLIT`` names those the plan
splits, each divided by ``tp``; norms, row-parallel biases and learned positions stay
whole), and the engine shards them over the ``dp`` ranks that hold the same TP piece.
So every rule above holds with the data-parallel size ``dp`` for the world size and
TP-local sizes for parameter sizes; all-gathers and reduce-scatters run over the
data-parallel group. The vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp`` (Megatron-LM's ``--make-vocab-size-divisible-by``),
so that it splits; every preset's vocabulary is a multiple of 128 already, so at
``tp=1`` nothing changes.

The plan also counts the TP plan's own activation collectives over the TP group
(``tp_collectives``), per microbatch of ``b = micro_batch_size`` sequences of ``s =
seq_length`` tokens, in the compute dtype; ``F`` is a fused column-parallel output
width, the qkv's ``(heads + 2 groups (+ heads, gated)) x kv_channels`` and, with
swiglu, the fc's ``2 ffn`` (the plan gathers a fused output whole and keeps each
section's own piece, [Note: fused projections] there)::

    forward    all_reduce      (b, s, h)  the vocabulary-parallel embedding's output
               all_gather      (b, s, F)  per layer and fused projection
               all_reduce      (b, s, h)  x 2 per layer (attention and MLP row-parallel outputs)
               all_gather      (b, s, V)  the logits, column-parallel over the vocabulary
    backward   reduce_scatter  (b, s, F)  per layer and fused projection
               all_reduce      (b, s, h)  x 2 per layer (inputs of the column-parallel qkv and fc)
               all_reduce      (b, s, h)  the output layer's input gradient

Not counted: sequence parallelism (not planned), recomputation (no preset recomputes),
q/k layernorm weight gradients (no preset has them).

[Note: the plan under expert and context parallelism] The dense ranks are ``tp x cp x dp``,
tp fastest, then cp, then dp (Megatron-LM's ``parallel_state`` order, as
``parallel_dims.ParallelDims`` lays it out). Every CP rank of a data-parallel rank holds the
whole TP-local model and computes gradients for its own part of each sequence, so dense
groups are sharded, and their gradients averaged, over the ``dp x cp = world / tp`` ranks
holding the same TP piece (upstream Megatron-FSDP's ``dp_shard_cp``). At ``tp`` = 1 that is
the whole world whatever ``cp`` is: context parallelism changes no parameter layout and no
FSDP collective, only the activations below.

Experts (parameters marked ``param.allreduce = False``) have a layout of their own,
``ep x edp`` with ep fastest and an expert tensor-parallel size of 1 (EP with TP > 1 is
refused, as ``ParallelDims`` refuses it): EP groups are runs of ``ep`` consecutive ranks
carved out of the data x context ranks, and ``edp = world / ep`` ranks hold the same
experts. EP rank r holds the global experts ``[r E/ep, (r+1) E/ep)`` of every MoE layer
(rank 0, the one planned: the first ``E/ep``), and the engine shards them over the ``edp``
ranks. So every FSDP unit with experts is two groups: a dense group sharded over ``dp x cp``
and a group of its local experts sharded over ``edp``, each padded to a multiple of its own
group size. The tables above hold for each group with its own size (under no_shard, units
merge by their dense plus local expert elements, as the engine's unit merge counts them);
an expert group's all-gathers and reduce-scatters run over the expert data-parallel group,
so their payload is the local experts' padded size (``E/ep`` experts, 1/edp of it kept per
rank). The ZeRO formula divides dense parameters by ``dp x cp`` and local expert
parameters by ``edp``.

The activation collectives of EP and CP (``ep_collectives``, ``cp_collectives``), per
microbatch of ``b`` sequences of ``s`` tokens, ``n = b s / cp`` of them on a rank, in the
compute dtype unless stated; ``k`` is the router's top-k, ``E`` the experts, ``g`` the query
groups on a TP rank, ``d`` kv_channels, ``w`` the routing weights' dtype (the router's:
``moe_router_dtype``, else the compute dtype). Payload as the engine's recorder counts it (the
gathered side of an all-gather, the input of a reduce-scatter); for a token all-to-all,
this rank's routed side, ``n k`` rows whatever the routing (a dropless dispatch sends every
pick; ``models.expert_parallel``'s [Note: the token exchange])::

    EP, per MoE layer       forward   all_to_all_counts  (E,) int64        rows per expert (sets the splits)
                                      all_to_all         (n k, h) + (n k,) w  dispatch: each pick, with its
                                                                           routing weight, to its expert's rank
                                      all_to_all         (n k, h)          combine: the expert outputs back
                            backward  all_to_all         (n k, h)          the combine's gradient, out
                                      all_to_all         (n k, h) + (n k,) w  the dispatch's, rows and weights, back
    CP, per attention layer forward   all_gather         (2, b, s, g d)    K and V of every CP rank
                            backward  reduce_scatter     (2, b, s, g d)    their gradients back to their owners

Our CP attention all-gathers K and V (each rank's ``b x s/cp x g x d``, stacked, one call)
rather than passing them round a ring: one collective each way per layer, at the price of
the whole sequence's K and V held during the layer. What leaves a rank is the payload times
``(p - 1) / p`` for a group of ``p`` ranks (``Plan.leaving``): exactly for CP's gather, and
for EP's tokens in expectation under uniform routing (each pick lands on any EP rank with
probability ``1/ep``; real routers are skewed, and a dropless dispatch moves whatever they
pick). Megatron-core exchanges the per-expert counts by an all-gather over the EP group
rather than an all-to-all (either is a few numbers per expert), and sends the routing
weights in an all-to-all of their own rather than beside the rows (the same bytes, one call
more). With TP as well (EP 1), the TP collectives above see ``s / cp`` tokens.

Not counted here either: the loss's token count and the balancing losses' per-expert token
counts summed over the CP or data-parallel groups (a few numbers per layer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..enums import ShardingStrategy
from ..models import presets as model_presets
from ..models.config import vocab_size_with_padding
from ..models.context_parallel import context_parallel_problems
from ..models.expert_parallel import expert_parallel_problems
from ..models.gpt import GPT, GPTConfig, TransformerBlock
from ..models.moe import MoELayer
from ..models.tensor_parallel import tensor_parallel_problems
from ..buffers.units import NO_SHARD_UNIT_SIZE, plan_merge
from ..param_marks import is_expert_param

logger = logging.getLogger(__name__)

ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq, in the main weights' dtype, per element."""

COUNT_ELEM = 8
"""Bytes of one per-expert token count in EP's count exchange (int64)."""

PRESETS: dict[str, dict] = {
    # Small enough to run real (fake-group) training steps in a test.
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256),
    "small": dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=4096),
    # Many small experts, so that expert parallelism up to 64 ranks can be planned and built in seconds.
    "moe-tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256,
                     num_moe_experts=64, moe_router_topk=2, moe_ffn_hidden_size=32),
    # GPT-shaped (4h MLP replaced by the ffn sizes below) at the usual scales; tied embeddings.
    "1b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50304),
    "8b": dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=128256, ffn_hidden_size=20480
    ),
    "70b": dict(
        num_layers=80, hidden_size=8192, num_attention_heads=64, seq_length=8192, vocab_size=128256, ffn_hidden_size=36864
    ),
}

TP_SPLIT: dict[str, int] = {
    "wte.weight": 0,  # vocabulary-parallel embedding
    "lm_head.weight": 0,  # column-parallel output layer (the embedding itself when tied)
    "attn.qkv.weight": 0,  # column-parallel: heads and query groups
    "attn.qkv.bias": 0,
    "attn.proj.weight": 1,  # row-parallel: its input is the heads
    "mlp.fc.weight": 0,  # column-parallel: the ffn channels
    "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,  # row-parallel: its input is the ffn channels
}
"""Parameter name (its last two or three parts) -> the dimension the TP plan splits.
Every other parameter is replicated on the TP ranks. Stated here apart from the plan
itself, so that ``--check`` compares the two."""

_EXPERT_INDEX = re.compile(r"(?:^|\.)experts\.(\d+)\.")
"""An expert parameter's global expert index in its name (``blocks.0.mlp.experts.5.fc.weight``)."""


def model_names() -> list[str]:
    """This module's sizes plus every preset of ``models.presets`` (dense and mixture-of-experts)."""
    return list(PRESETS) + list(model_presets.PRESETS)


def moe_model_names() -> list[str]:
    return [name for name in model_names() if gpt_config(name).num_moe_experts]


def gpt_config(name: str) -> GPTConfig:
    if name in PRESETS:
        return GPTConfig(**PRESETS[name])
    if name in model_presets.PRESETS:
        return model_presets.config(name)
    raise ValueError(f"--model {name!r} is not a preset; use one of {model_names()}")


def check_tp_split(cfg: GPTConfig, tp: int) -> None:
    """Refuse a GPT that the TP plan cannot split over ``tp`` ranks (its own reasons)."""
    problems = tensor_parallel_problems(cfg, tp, sequence_parallel=False) if tp > 1 else []
    if problems:
        raise ValueError(f"tp={tp} cannot split this model: " + "; ".join(problems))


def tp_split_dim(name: str) -> Optional[int]:
    """The dimension the TP plan splits parameter ``name`` along, ``None`` if replicated."""
    parts = name.split(".")
    for n in (3, 2):
        if ".".join(parts[-n:]) in TP_SPLIT:
            return TP_SPLIT[".".join(parts[-n:])]
    return None


def tp_local_numel(name: str, param: torch.Tensor, tp: int) -> int:
    """Elements of parameter ``name`` on one TP rank (the TP plan splits evenly)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return param.numel()
    if param.shape[dim] % tp:
        raise ValueError(f"parameter {name!r} of shape {tuple(param.shape)}: dimension {dim} does not split "
                         f"over tp={tp}; check_tp_split refuses such a model")
    return param.numel() // tp


def expert_index(name: str) -> Optional[int]:
    """The global expert an expert parameter belongs to, from its name; ``None`` if none."""
    found = _EXPERT_INDEX.search(name)
    return None if found is None else int(found.group(1))


def local_experts(num_experts: int, ep: int, ep_rank: int = 0) -> range:
    """The global experts of every MoE layer that EP rank ``ep_rank`` holds (Megatron-LM's
    consecutive blocks; [Note: the plan under expert and context parallelism])."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def build_meta_gpt(cfg: GPTConfig, dtype: torch.dtype) -> nn.Module:
    """The GPT on the meta device (no memory), in the compute dtype."""
    with torch.device("meta"):
        return GPT(cfg).to(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    """A preset name (``model_names()``)."""
    world: int
    """Ranks in all: ``dp x cp x tp`` (one shard group; no HSDP)."""
    strategy: ShardingStrategy
    dtype: torch.dtype = torch.bfloat16
    """Compute (model-weight) dtype."""
    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = torch.float32
    """``None``: the compute dtype (as ``MixedPrecisionPolicy``)."""
    grad_comm_dtype: Optional[torch.dtype] = None
    """``None``: the main-grad dtype."""
    tp: int = 1
    """Tensor-parallel ranks; dense parameters shard over ``world / tp``
    ([Note: the plan under tensor parallelism])."""
    cp: int = 1
    """Context-parallel ranks sharing each sequence, carved out of the ``world / tp`` ranks;
    the data-parallel size is ``world / (tp cp)`` ([Note: the plan under expert and context
    parallelism])."""
    ep: int = 1
    """Expert-parallel ranks sharing each MoE layer's experts (mixture-of-experts presets);
    experts shard over ``edp = world / ep``."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times ``tp`` (Megatron-LM's rule)."""
    micro_batch_size: int = 1
    """Sequences per data-parallel rank per microbatch: sizes the activation collectives."""
    seq_length: Optional[int] = None
    """Tokens per sequence (before the CP split); ``None``: the preset's ``seq_length``."""
    gpt: Optional[GPTConfig] = dataclasses.field(default=None, hash=False)
    """A model of one's own instead of the preset (``model`` then only names it)."""

    def __post_init__(self) -> None:
        for name in ("world", "tp", "cp", "ep", "make_vocab_size_divisible_by", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world % self.tp:
            raise ValueError(f"tp={self.tp} does not divide world={self.world}: the world is data-parallel x "
                             "context-parallel x tensor-parallel ranks; use a tp that divides the world")
        if (self.world // self.tp) % self.cp:
            raise ValueError(f"cp={self.cp} does not divide world / tp = {self.world // self.tp}: the context-parallel "
                             "ranks are carved out of the ranks of one TP piece; use a cp that divides it")
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy, arg_name="strategy"))
        longest = self.config.seq_length
        if self.seq_length is not None and not 1 <= self.seq_length <= longest:
            raise ValueError(f"seq_length={self.seq_length} must be between 1 and the model's {longest}")
        self._check_context_parallel()
        self._check_expert_parallel()
        check_tp_split(self.config, self.tp)

    def _check_context_parallel(self) -> None:
        if self.cp == 1:
            return
        seq = self.tokens[1]
        if seq % (2 * self.cp):
            raise ValueError(f"seq_length={seq} is not a multiple of 2 x cp = {2 * self.cp}: each sequence is cut "
                             f"into 2 x cp equal chunks (Megatron-LM's load-balanced split, CP rank r holding chunks r "
                             f"and 2cp-1-r); use a seq_length that is a multiple of {2 * self.cp}")
        if self.config.multi_latent_attention:
            raise ValueError(f"cp={self.cp} with multi-latent attention is not planned (its K/V exchange differs); "
                             "use cp=1")
        problems = context_parallel_problems(dataclasses.replace(self.config, seq_length=seq), self.cp)
        if problems:
            raise ValueError(f"cp={self.cp} cannot share this model's sequences: " + "; ".join(problems))

    def _check_expert_parallel(self) -> None:
        experts = self.config.num_moe_experts
        if self.ep == 1:
            return
        if not experts:
            raise ValueError(f"ep={self.ep} with {self.model!r}, a dense model: expert parallelism splits the experts "
                             f"of MoE layers; use ep=1 or a mixture-of-experts preset ({', '.join(moe_model_names())})")
        if self.tp > 1:
            raise ValueError(f"ep={self.ep} with tp={self.tp}: experts are not supported together with tensor "
                             "parallelism (they would need an expert tensor-parallel layout); use tp=1 or ep=1")
        if experts % self.ep:
            divisors = [d for d in range(1, experts + 1) if experts % d == 0 and self.world % d == 0]
            raise ValueError(f"ep={self.ep} does not divide the {experts} experts of {self.model!r}: every EP rank "
                             f"holds the same number of experts; use one of {divisors}")
        if self.world % self.ep:
            raise ValueError(f"ep={self.ep} does not divide world={self.world}: the EP groups are carved out of the "
                             f"data x context-parallel ranks; use an ep that divides {self.world}")
        problems = expert_parallel_problems(self.config, self.ep, self.world)
        if problems:
            raise ValueError(f"ep={self.ep} cannot spread this model's experts: " + "; ".join(problems))

    @functools.cached_property
    def config(self) -> GPTConfig:
        """The preset with its vocabulary padded to ``make_vocab_size_divisible_by * tp``."""
        cfg = self.gpt if self.gpt is not None else gpt_config(self.model)
        padded = vocab_size_with_padding(cfg.vocab_size, self.make_vocab_size_divisible_by, self.tp)
        return cfg if padded == cfg.vocab_size else dataclasses.replace(cfg, vocab_size=padded)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those training on different samples."""
        return self.world // (self.tp * self.cp)

    @property
    def dense_world(self) -> int:
        """The ranks every dense group is sharded over: ``dp x cp``, those of one TP piece."""
        return self.world // self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel ranks: those holding the same experts (the expert groups' shard group)."""
        return self.world // (self.tp * self.ep)

    @property
    def tokens(self) -> tuple[int, int]:
        """(micro batch, sequence length) of one microbatch, before the CP split."""
        return self.micro_batch_size, self.seq_length or self.config.seq_length

    @property
    def local_tokens(self) -> tuple[int, int]:
        """(micro batch, tokens of each sequence on one CP rank)."""
        b, s = self.tokens
        return b, s // self.cp

    @property
    def main_dtype(self) -> Optional[torch.dtype]:
        """Dtype of a separate main-weight buffer, ``None`` when the model weights serve."""
        return None if self.main_params_dtype in (None, self.dtype) else self.main_params_dtype

    @property
    def grads_dtype(self) -> torch.dtype:
        return self.main_grads_dtype or self.dtype

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.grad_comm_dtype or self.grads_dtype

    @property
    def routing_weight_dtype(self) -> torch.dtype:
        """The dtype of the routing weights the EP dispatch sends beside the rows: the router's."""
        router = self.config.moe_router_dtype
        return self.dtype if router is None else {"fp32": torch.float32, "fp64": torch.float64}[router.value]

    @property
    def optimizer_state_elem(self) -> int:
        """AdamW state bytes per main-weight element."""
        return ADAM_STATES * _elem(self.main_params_dtype or self.dtype)

    def rank_numel(self, name: str, param: torch.Tensor) -> int:
        """Elements of parameter ``name`` on rank 0: TP-local, and 0 for an expert that
        EP rank 0 does not hold."""
        index = expert_index(name) if is_expert_param(param) else None
        if index is not None and index not in local_experts(self.config.num_moe_experts, self.ep):
            return 0
        return tp_local_numel(name, param, self.tp)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One parameter group (one flat buffer per role, one collective per kind)."""

    name: str
    numel: int
    """Elements on rank 0 (TP-local; the local experts' for an expert group)."""
    world: int
    """The ranks the group is sharded over (``dp x cp``; ``edp`` for an expert group)."""
    unit: Optional[int]
    """FSDP unit index, ``None`` for the root (parameters outside every unit)."""
    expert: bool = False
    """Expert parameters (``param.allreduce = False``), on the expert data-parallel group."""

    @property
    def shard(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        return self.shard * self.world

    @property
    def kind(self) -> str:
        return "expert" if self.expert else "dense"


def _elem(dtype: Optional[torch.dtype]) -> int:
    return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()


def plan_groups(module: nn.Module, unit_classes: tuple[type, ...], request: PlanRequest) -> list[GroupPlan]:
    """Root groups (one per top-level module outside the units) then unit groups in
    module order, each split into a dense and an expert group; under no_shard both are
    merged up to Megatron DDP's bucket size. Sizes are rank 0's (``PlanRequest.rank_numel``)."""
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) != 1 or not all(p.requires_grad for p in module.parameters()):
        raise ValueError(f"the plan covers models of one dtype, all trainable; this one has dtypes {dtypes}")
    local = {id(p): (request.rank_numel(name, p), is_expert_param(p)) for name, p in module.named_parameters()}
    units = [m for m in module.modules() if isinstance(m, unit_classes)]
    seen: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            seen.setdefault(id(p), set()).add(index)
    root: dict[str, list[int]] = {}  # top-level module -> [dense, expert] elements
    for name, p in module.named_parameters():
        if len(seen.get(id(p), ())) != 1:  # outside every unit, or tied across units
            numel, expert = local[id(p)]
            root.setdefault(name.split(".")[0], [0, 0])[expert] += numel
    unit_numels = [[0, 0] for _ in units]
    for index, unit in enumerate(units):
        for p in unit.parameters():
            if len(seen[id(p)]) == 1:
                numel, expert = local[id(p)]
                unit_numels[index][expert] += numel
    limit = NO_SHARD_UNIT_SIZE if request.strategy is ShardingStrategy.NO_SHARD else None
    tops = list(root)
    groups: list[GroupPlan] = []
    for run in plan_merge([sum(root[t]) for t in tops], limit):
        groups += _split_by_kind("+".join(tops[i] for i in run), [root[tops[i]] for i in run], request, None)
    for unit_index, run in enumerate(plan_merge([sum(n) for n in unit_numels], limit)):
        groups += _split_by_kind(f"unit{unit_index}", [unit_numels[i] for i in run], request, unit_index)
    return groups


def _split_by_kind(name: str, numels: list[list[int]], request: PlanRequest, unit: Optional[int]) -> list[GroupPlan]:
    """The dense and the expert group (when it has elements) of one run of modules."""
    dense, expert = sum(n[0] for n in numels), sum(n[1] for n in numels)
    groups = [GroupPlan(name, dense, request.dense_world, unit)] if dense else []
    if expert:
        groups.append(GroupPlan(f"{name}.experts", expert, request.edp, unit, expert=True))
    return groups


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    request: PlanRequest
    params: int
    """Parameters of the whole model (padded vocabulary included)."""
    local_params: int
    """Parameters on rank 0: TP-local, its own experts only (``params`` without TP and EP)."""
    expert_params: int
    """Of ``local_params``, those of rank 0's experts."""
    groups: tuple[GroupPlan, ...]
    memory: dict[str, int]
    """Persistent bytes on rank 0 by role (optimizer state: AdamW)."""
    memory_by_kind: dict[str, dict[str, int]]
    """``memory`` split into ``{"dense": ..., "expert": ...}`` (``expert`` for MoE models only)."""
    formula: dict[str, float]
    """The textbook ZeRO formula, without padding, for the same roles."""
    step: dict[str, dict[str, int]]
    """``{"counts": {kind: n}, "bytes": {kind: payload bytes}}`` of one steady-state
    step, the data-parallel collectives of every group."""
    step_by_kind: dict[str, dict[str, dict[str, int]]]
    """``step`` split by group kind: ``dense`` (over ``dp x cp``), ``expert`` (over ``edp``)."""
    tp_step: dict[str, dict[str, int]]
    """The TP plan's activation collectives over the TP group, one microbatch
    (``tp_collectives``); empty without tensor parallelism."""
    ep_step: dict[str, dict[str, int]]
    """EP's token exchanges over the EP group, one microbatch (``ep_collectives``)."""
    cp_step: dict[str, dict[str, int]]
    """CP's K/V exchanges over the CP group, one microbatch (``cp_collectives``)."""

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())

    @property
    def padding_bytes(self) -> float:
        return self.total_memory - sum(self.formula.values())

    @property
    def leaving(self) -> dict[str, float]:
        """Bytes per microbatch that leave rank 0 in EP's and CP's exchanges: the payload
        times (p-1)/p (EP's token exchanges: in expectation, under uniform routing)."""
        r = self.request
        out = {}
        for name, step, size in (("ep", self.ep_step, r.ep), ("cp", self.cp_step, r.cp)):
            if step["counts"]:
                out[name] = sum(step["bytes"].values()) * (size - 1) / size
        return out

    def as_dict(self) -> dict:
        r = self.request
        return {
            "model": r.model,
            "world": r.world,
            "tp": r.tp,
            "cp": r.cp,
            "ep": r.ep,
            "dp": r.dp,
            "dense_world": r.dense_world,
            "edp": r.edp,
            "strategy": r.strategy.label,
            "dtype": str(r.dtype).removeprefix("torch."),
            "vocab_size": r.config.vocab_size,
            "params": self.params,
            "local_params": self.local_params,
            "expert_params": self.expert_params,
            "groups": len(self.groups),
            "memory": dict(self.memory),
            "memory_by_kind": self.memory_by_kind,
            "memory_total": self.total_memory,
            "formula": dict(self.formula),
            "padding_bytes": self.padding_bytes,
            "step": self.step,
            "step_by_kind": self.step_by_kind,
            "tp_step": self.tp_step,
            "ep_step": self.ep_step,
            "cp_step": self.cp_step,
            "leaving": self.leaving,
            "tokens": list(r.tokens),
        }


def make_plan(request: PlanRequest, module: Optional[nn.Module] = None, unit_classes: tuple[type, ...] = (TransformerBlock,)) -> Plan:
    module = module if module is not None else build_meta_gpt(request.config, request.dtype)
    groups = tuple(plan_groups(module, unit_classes, request))
    kinds = {kind: [g for g in groups if g.kind == kind] for kind in ("dense", "expert")}
    last_unit = max((g.unit for g in groups if g.unit is not None), default=None)
    by_kind = {kind: group_memory(request, members) for kind, members in kinds.items() if members}
    moe_layers = sum(isinstance(m, MoELayer) for m in module.modules())
    attention_layers = sum(isinstance(m, TransformerBlock) for m in module.modules())
    return Plan(
        request=request,
        params=sum(p.numel() for p in module.parameters()),
        local_params=sum(g.numel for g in groups),
        expert_params=sum(g.numel for g in kinds["expert"]),
        groups=groups,
        memory={role: sum(m[role] for m in by_kind.values()) for role in _ROLES},
        memory_by_kind=by_kind,
        formula=zero_formula(request, sum(g.numel for g in kinds["dense"]), sum(g.numel for g in kinds["expert"])),
        step=step_collectives(request, list(groups)),
        step_by_kind={kind: step_collectives(request, members, last_unit) for kind, members in kinds.items()
                      if members},
        tp_step=tp_collectives(request),
        ep_step=ep_collectives(request, moe_layers),
        cp_step=cp_collectives(request, attention_layers),
    )


_ROLES = ("model_weights", "main_weights", "main_grads", "optimizer_state")


def group_memory(request: PlanRequest, groups: Sequence[GroupPlan]) -> dict[str, int]:
    """Rank 0's persistent bytes by role for ``groups`` (each padded to its own group size)."""
    strategy = request.strategy
    return {
        "model_weights": _elem(request.dtype) * sum(g.shard if strategy.shards_params else g.padded for g in groups),
        "main_weights": _elem(request.main_dtype) * sum(g.shard if strategy.shards_optimizer else g.padded
                                                        for g in groups),
        "main_grads": _elem(request.grads_dtype) * sum(g.shard if strategy.shards_grads else g.padded for g in groups),
        # Rank 0 owns the first shard of every group: real elements, never padding.
        "optimizer_state": request.optimizer_state_elem
        * sum(min(g.shard, g.numel) if strategy.shards_optimizer else g.numel for g in groups),
    }


def zero_formula(request: PlanRequest, params: int, expert_params: int = 0) -> dict[str, float]:
    """Per-rank bytes of the textbook ZeRO levels (no padding) for ``params`` dense
    (TP-local) elements over the ``dp x cp`` ranks and ``expert_params`` local expert
    elements over the expert data-parallel ranks, with a main-weight copy when the
    compute dtype is narrower than the main dtype."""
    s = request.strategy

    def per_rank(sharded: bool) -> float:
        return params / (request.dense_world if sharded else 1) + expert_params / (request.edp if sharded else 1)

    return {
        "model_weights": _elem(request.dtype) * per_rank(s.shards_params),
        "main_weights": _elem(request.main_dtype) * per_rank(s.shards_optimizer),
        "main_grads": _elem(request.grads_dtype) * per_rank(s.shards_grads),
        "optimizer_state": request.optimizer_state_elem * per_rank(s.shards_optimizer),
    }


class _Tally:
    """Calls and payload bytes per collective kind."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, kind: str, payload_elems: int, elem: int, times: int = 1) -> None:
        if times == 0:
            return
        self.counts[kind] = self.counts.get(kind, 0) + times
        self.nbytes[kind] = self.nbytes.get(kind, 0) + times * payload_elems * elem

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"counts": self.counts, "bytes": self.nbytes}


def step_collectives(request: PlanRequest, groups: Sequence[GroupPlan],
                     last_unit: Optional[int] = None) -> dict[str, dict[str, int]]:
    """Collectives of one steady-state step with one microbatch, each group over its own
    shard group (see the module note). ``last_unit``: the model's last unit (kept
    gathered into backward), by default the last of ``groups``."""
    tally = _Tally()
    strategy = request.strategy
    weight, comm = _elem(request.dtype), _elem(request.comm_dtype)
    if last_unit is None:
        last_unit = max((g.unit for g in groups if g.unit is not None), default=None)
    for g in groups:
        if g.world == 1:
            continue
        if strategy is ShardingStrategy.NO_SHARD:
            tally.add("all_reduce", g.padded, comm)
            continue
        gathers = 1 if (not strategy.shards_params or g.unit is None or g.unit == last_unit) else 2
        tally.add("all_gather", g.padded, weight, gathers)
        tally.add("reduce_scatter", g.padded, comm)
    return tally.as_dict()


def tp_collectives(request: PlanRequest) -> dict[str, dict[str, int]]:
    """The TP plan's activation collectives over the TP group for one microbatch,
    forward and backward ([Note: the plan under tensor parallelism]), on this CP rank's tokens."""
    tally = _Tally()
    if request.tp == 1:
        return tally.as_dict()
    cfg, elem = request.config, _elem(request.dtype)
    b, s = request.local_tokens
    qkv_heads = cfg.num_attention_heads * (2 if cfg.attention_output_gate else 1) + 2 * cfg.num_query_groups
    fused = [qkv_heads * cfg.kv_channels] + ([2 * cfg.ffn_hidden_size] if cfg.swiglu else [])
    tally.add("all_reduce", b * s * cfg.hidden_size, elem, 4 * cfg.num_layers + 2)
    for width in fused:
        tally.add("all_gather", b * s * width, elem, cfg.num_layers)
        tally.add("reduce_scatter", b * s * width, elem, cfg.num_layers)
    tally.add("all_gather", b * s * cfg.vocab_size, elem)
    return tally.as_dict()


def ep_collectives(request: PlanRequest, moe_layers: int) -> dict[str, dict[str, int]]:
    """EP's exchanges over the EP group for one microbatch, forward and backward, for
    ``moe_layers`` MoE layers ([Note: the plan under expert and context parallelism])."""
    tally = _Tally()
    if request.ep == 1:
        return tally.as_dict()
    cfg = request.config
    b, s = request.local_tokens
    routed = b * s * cfg.moe_router_topk  # (token, pick) pairs on this rank: rows sent in dispatch
    row = cfg.hidden_size * _elem(request.dtype)  # bytes of one row
    tally.add("all_to_all_counts", cfg.num_moe_experts, COUNT_ELEM, moe_layers)
    tally.add("all_to_all", routed, row + _elem(request.routing_weight_dtype), 2 * moe_layers)  # dispatch, its grad
    tally.add("all_to_all", routed, row, 2 * moe_layers)  # combine, its grad
    return tally.as_dict()


def cp_collectives(request: PlanRequest, attention_layers: int) -> dict[str, dict[str, int]]:
    """CP's K/V exchanges over the CP group for one microbatch, forward and backward, for
    ``attention_layers`` layers ([Note: the plan under expert and context parallelism])."""
    tally = _Tally()
    if request.cp == 1:
        return tally.as_dict()
    cfg = request.config
    b, s = request.tokens
    kv = 2 * b * s * (cfg.num_query_groups // request.tp) * cfg.kv_channels  # (2, b, s, g, d): K and V gathered
    tally.add("all_gather", kv, _elem(request.dtype), attention_layers)
    tally.add("reduce_scatter", kv, _elem(request.dtype), attention_layers)
    return tally.as_dict()


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def format_plan(plan: Plan) -> str:
    r = plan.request
    lines = [
        f"{r.model}: {plan.params / 1e9:.3f}B parameters, {len(plan.groups)} groups, {_layout(r)}, "
        f"{r.strategy.label}, compute {str(r.dtype).removeprefix('torch.')}",
    ]
    if r.tp > 1:
        lines.append(f"  per TP rank {plan.local_params / 1e9:.3f}B parameters (vocabulary padded to "
                     f"{r.config.vocab_size})")
    if plan.expert_params:
        experts = local_experts(r.config.num_moe_experts, r.ep)
        held = f"expert {experts.start}" if len(experts) == 1 else f"experts {experts.start}..{experts.stop - 1}"
        lines.append(f"  rank 0 holds {_count(plan.local_params)} parameters: {held} of every MoE layer "
                     f"({_count(plan.expert_params)}, sharded over EDP {r.edp}), dense {_count(plan.local_params - plan.expert_params)}"
                     f" (sharded over DP x CP {r.dense_world})")
    lines.append("per-rank persistent memory (rank 0)          plan        ZeRO formula")
    for role, value in plan.memory.items():
        lines.append(f"  {role:<24}{_gib(value)}  {_gib(plan.formula[role])}")
    lines.append(f"  {'total':<24}{_gib(plan.total_memory)}  {_gib(sum(plan.formula.values()))}"
                 f"   (padding {plan.padding_bytes:.0f} B)")
    if plan.expert_params:
        for kind, memory in plan.memory_by_kind.items():
            lines.append(f"  {kind + ' parameters':<24}{_gib(sum(memory.values()))}")
    over = ", each group over its shard group" if plan.expert_params else ", data-parallel group"
    lines.append("collectives per step (one microbatch)" + (over if r.tp > 1 or r.cp > 1 or plan.expert_params else ""))
    lines += _collective_lines(plan.step)
    if plan.expert_params:
        for kind, step in plan.step_by_kind.items():
            group = f"expert data-parallel group ({r.edp})" if kind == "expert" else f"DP x CP group ({r.dense_world})"
            lines.append(f"  of which {kind} groups, over the {group}")
            lines += ["  " + line for line in _collective_lines(step)]
    lines += _activation_lines(plan)
    return "\n".join(lines)


def _layout(r: PlanRequest) -> str:
    if r.tp == r.cp == r.ep == 1:
        return f"world {r.world}"
    parts = [f"DP {r.dp}"] + [f"{name} {size}" for name, size in (("CP", r.cp), ("TP", r.tp)) if size > 1]
    experts = f", experts EP {r.ep} x EDP {r.edp}" if r.ep > 1 else ""
    return f"world {r.world} = {' x '.join(parts)}{experts}"


def _activation_lines(plan: Plan) -> list[str]:
    r = plan.request
    b, s = r.local_tokens
    lines = []
    if r.tp > 1:
        lines.append(f"tensor-parallel activations per microbatch ({b} x {s} tokens), TP group")
        lines += _collective_lines(plan.tp_step)
    for name, step, size in (("expert", plan.ep_step, r.ep), ("context", plan.cp_step, r.cp)):
        if step["counts"]:
            group = name[0].upper() + "P"
            lines.append(f"{name}-parallel activations per microbatch ({b} x {s} tokens per rank), {group} group "
                         f"of {size}; leaving the rank {_gib(plan.leaving[group.lower()])}"
                         + (" (uniform routing)" if name == "expert" else ""))
            lines += _collective_lines(step)
    return lines


def _collective_lines(step: dict[str, dict[str, int]]) -> list[str]:
    return [f"  {kind:<18}{count:6d} calls  {_gib(step['bytes'][kind])}" for kind, count in step["counts"].items()]
