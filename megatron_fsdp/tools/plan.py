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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..enums import ShardingStrategy
from ..models import presets as model_presets
from ..models.config import vocab_size_with_padding
from ..models.gpt import GPT, GPTConfig, TransformerBlock
from ..models.tensor_parallel import tensor_parallel_problems
from ..buffers.units import NO_SHARD_UNIT_SIZE, plan_merge

logger = logging.getLogger(__name__)

ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq, in the main weights' dtype, per element."""

PRESETS: dict[str, dict] = {
    # Small enough to run real (fake-group) training steps in a test.
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256),
    "small": dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=4096),
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


def model_names() -> list[str]:
    """This module's GPT-shaped sizes plus the dense presets of ``models.presets``."""
    return list(PRESETS) + [n for n, kw in model_presets.PRESETS.items() if not kw.get("num_moe_experts")]


def gpt_config(name: str) -> GPTConfig:
    if name in PRESETS:
        return GPTConfig(**PRESETS[name])
    if name in model_names():
        return model_presets.config(name)
    raise ValueError(
        f"--model {name!r} is not a preset; use one of {model_names()} (mixture-of-experts presets are not "
        "planned: their experts shard over the expert data-parallel group)"
    )


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


def build_meta_gpt(cfg: GPTConfig, dtype: torch.dtype) -> nn.Module:
    """The GPT on the meta device (no memory), in the compute dtype."""
    with torch.device("meta"):
        return GPT(cfg).to(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    """A preset name (``PRESETS``)."""
    world: int
    """Ranks in all: ``dp x tp`` (one shard group; no HSDP)."""
    strategy: ShardingStrategy
    dtype: torch.dtype = torch.bfloat16
    """Compute (model-weight) dtype."""
    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = torch.float32
    """``None``: the compute dtype (as ``MixedPrecisionPolicy``)."""
    grad_comm_dtype: Optional[torch.dtype] = None
    """``None``: the main-grad dtype."""
    tp: int = 1
    """Tensor-parallel ranks; the data-parallel size is ``world / tp``
    ([Note: the plan under tensor parallelism])."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times ``tp`` (Megatron-LM's rule)."""
    micro_batch_size: int = 1
    """Sequences per rank per microbatch: sizes the TP activation collectives."""
    seq_length: Optional[int] = None
    """Tokens per sequence; ``None``: the preset's ``seq_length``."""

    def __post_init__(self) -> None:
        for name in ("world", "tp", "make_vocab_size_divisible_by", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world % self.tp:
            raise ValueError(f"tp={self.tp} does not divide world={self.world}: the world is data-parallel x "
                             "tensor-parallel ranks; use a tp that divides the world")
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy, arg_name="strategy"))
        longest = self.config.seq_length
        if self.seq_length is not None and not 1 <= self.seq_length <= longest:
            raise ValueError(f"seq_length={self.seq_length} must be between 1 and the model's {longest}")
        check_tp_split(self.config, self.tp)

    @functools.cached_property
    def config(self) -> GPTConfig:
        """The preset with its vocabulary padded to ``make_vocab_size_divisible_by * tp``."""
        cfg = gpt_config(self.model)
        padded = vocab_size_with_padding(cfg.vocab_size, self.make_vocab_size_divisible_by, self.tp)
        return cfg if padded == cfg.vocab_size else dataclasses.replace(cfg, vocab_size=padded)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the shard group of every parameter."""
        return self.world // self.tp

    @property
    def tokens(self) -> tuple[int, int]:
        """(micro batch, sequence length) of one microbatch."""
        return self.micro_batch_size, self.seq_length or self.config.seq_length

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
    def optimizer_state_elem(self) -> int:
        """AdamW state bytes per main-weight element."""
        return ADAM_STATES * _elem(self.main_params_dtype or self.dtype)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One parameter group (one flat buffer per role, one collective per kind)."""

    name: str
    numel: int
    """TP-local elements (all of them without tensor parallelism)."""
    world: int
    """The data-parallel ranks the group is sharded over."""
    unit: Optional[int]
    """FSDP unit index, ``None`` for the root (parameters outside every unit)."""

    @property
    def shard(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        return self.shard * self.world


def _elem(dtype: Optional[torch.dtype]) -> int:
    return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()


def plan_groups(module: nn.Module, unit_classes: tuple[type, ...], world: int, strategy: ShardingStrategy,
                tp: int = 1) -> list[GroupPlan]:
    """Root groups (one per top-level module outside the units) then unit groups in
    module order; under no_shard both are merged up to Megatron DDP's bucket size.
    ``world``: the data-parallel ranks; sizes are TP-local (``tp_local_numel``)."""
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) != 1 or not all(p.requires_grad for p in module.parameters()):
        raise ValueError(f"the plan covers models of one dtype, all trainable; this one has dtypes {dtypes}")
    local = {id(p): tp_local_numel(name, p, tp) for name, p in module.named_parameters()}
    units = [m for m in module.modules() if isinstance(m, unit_classes)]
    seen: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            seen.setdefault(id(p), set()).add(index)
    root: dict[str, int] = {}
    for name, p in module.named_parameters():
        if len(seen.get(id(p), ())) != 1:  # outside every unit, or tied across units
            top = name.split(".")[0]
            root[top] = root.get(top, 0) + local[id(p)]
    unit_numels = [sum(local[id(p)] for p in u.parameters() if len(seen[id(p)]) == 1) for u in units]
    limit = NO_SHARD_UNIT_SIZE if strategy is ShardingStrategy.NO_SHARD else None
    tops = list(root)
    groups = [
        GroupPlan("+".join(tops[i] for i in run), sum(root[tops[i]] for i in run), world, None)
        for run in plan_merge([root[t] for t in tops], limit)
    ]
    for unit_index, run in enumerate(plan_merge(unit_numels, limit)):
        groups.append(GroupPlan(f"unit{unit_index}", sum(unit_numels[i] for i in run), world, unit_index))
    return groups


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    request: PlanRequest
    params: int
    """Parameters of the whole model (padded vocabulary included)."""
    local_params: int
    """Parameters on one TP rank (``params`` without tensor parallelism)."""
    groups: tuple[GroupPlan, ...]
    memory: dict[str, int]
    """Persistent bytes on rank 0 by role (optimizer state: AdamW)."""
    formula: dict[str, float]
    """The textbook ZeRO formula, without padding, for the same roles."""
    step: dict[str, dict[str, int]]
    """``{"counts": {kind: n}, "bytes": {kind: payload bytes}}`` of one steady-state
    step over the data-parallel group."""
    tp_step: dict[str, dict[str, int]]
    """The same for the TP plan's activation collectives over the TP group, one
    microbatch (``tp_collectives``); empty without tensor parallelism."""

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())

    @property
    def padding_bytes(self) -> float:
        return self.total_memory - sum(self.formula.values())

    def as_dict(self) -> dict:
        r = self.request
        return {
            "model": r.model,
            "world": r.world,
            "tp": r.tp,
            "dp": r.dp,
            "strategy": r.strategy.label,
            "dtype": str(r.dtype).removeprefix("torch."),
            "vocab_size": r.config.vocab_size,
            "params": self.params,
            "local_params": self.local_params,
            "groups": len(self.groups),
            "memory": dict(self.memory),
            "memory_total": self.total_memory,
            "formula": dict(self.formula),
            "padding_bytes": self.padding_bytes,
            "step": self.step,
            "tp_step": self.tp_step,
            "tokens": list(r.tokens),
        }


def make_plan(request: PlanRequest, module: Optional[nn.Module] = None, unit_classes: tuple[type, ...] = (TransformerBlock,)) -> Plan:
    module = module if module is not None else build_meta_gpt(request.config, request.dtype)
    strategy, dp = request.strategy, request.dp
    groups = tuple(plan_groups(module, unit_classes, dp, strategy, request.tp))
    local_params = sum(g.numel for g in groups)
    memory = {
        "model_weights": _elem(request.dtype) * sum(g.shard if strategy.shards_params else g.padded for g in groups),
        "main_weights": _elem(request.main_dtype) * sum(g.shard if strategy.shards_optimizer else g.padded for g in groups),
        "main_grads": _elem(request.grads_dtype) * sum(g.shard if strategy.shards_grads else g.padded for g in groups),
        # Rank 0 owns the first shard of every group: real elements, never padding.
        "optimizer_state": request.optimizer_state_elem
        * sum(min(g.shard, g.numel) if strategy.shards_optimizer else g.numel for g in groups),
    }
    return Plan(
        request=request,
        params=sum(p.numel() for p in module.parameters()),
        local_params=local_params,
        groups=groups,
        memory=memory,
        formula=zero_formula(request, local_params),
        step=step_collectives(request, list(groups)),
        tp_step=tp_collectives(request),
    )


def zero_formula(request: PlanRequest, params: int) -> dict[str, float]:
    """Per-rank bytes of the textbook ZeRO levels (no padding) for ``params`` (TP-local)
    elements over the data-parallel ranks, with a main-weight copy when the compute
    dtype is narrower than the main dtype."""
    s, w = request.strategy, request.dp
    return {
        "model_weights": _elem(request.dtype) * params / (w if s.shards_params else 1),
        "main_weights": _elem(request.main_dtype) * params / (w if s.shards_optimizer else 1),
        "main_grads": _elem(request.grads_dtype) * params / (w if s.shards_grads else 1),
        "optimizer_state": request.optimizer_state_elem * params / (w if s.shards_optimizer else 1),
    }


class _Tally:
    """Calls and payload bytes per collective kind."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, kind: str, payload_elems: int, elem: int, times: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + times
        self.nbytes[kind] = self.nbytes.get(kind, 0) + times * payload_elems * elem

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"counts": self.counts, "bytes": self.nbytes}


def step_collectives(request: PlanRequest, groups: Sequence[GroupPlan]) -> dict[str, dict[str, int]]:
    """Collectives of one steady-state step with one microbatch over the data-parallel
    group (see the module note)."""
    tally = _Tally()
    if request.dp == 1:
        return tally.as_dict()
    strategy = request.strategy
    weight, comm = _elem(request.dtype), _elem(request.comm_dtype)
    last_unit = max((g.unit for g in groups if g.unit is not None), default=None)
    for g in groups:
        if strategy is ShardingStrategy.NO_SHARD:
            tally.add("all_reduce", g.padded, comm)
            continue
        gathers = 1 if (not strategy.shards_params or g.unit is None or g.unit == last_unit) else 2
        tally.add("all_gather", g.padded, weight, gathers)
        tally.add("reduce_scatter", g.padded, comm)
    return tally.as_dict()


def tp_collectives(request: PlanRequest) -> dict[str, dict[str, int]]:
    """The TP plan's activation collectives over the TP group for one microbatch,
    forward and backward ([Note: the plan under tensor parallelism])."""
    tally = _Tally()
    if request.tp == 1:
        return tally.as_dict()
    cfg, elem = request.config, _elem(request.dtype)
    b, s = request.tokens
    qkv_heads = cfg.num_attention_heads * (2 if cfg.attention_output_gate else 1) + 2 * cfg.num_query_groups
    fused = [qkv_heads * cfg.kv_channels] + ([2 * cfg.ffn_hidden_size] if cfg.swiglu else [])
    tally.add("all_reduce", b * s * cfg.hidden_size, elem, 4 * cfg.num_layers + 2)
    for width in fused:
        tally.add("all_gather", b * s * width, elem, cfg.num_layers)
        tally.add("reduce_scatter", b * s * width, elem, cfg.num_layers)
    tally.add("all_gather", b * s * cfg.vocab_size, elem)
    return tally.as_dict()


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def format_plan(plan: Plan) -> str:
    r = plan.request
    layout = f"world {r.world}" if r.tp == 1 else f"world {r.world} = DP {r.dp} x TP {r.tp}"
    lines = [
        f"{r.model}: {plan.params / 1e9:.3f}B parameters, {len(plan.groups)} groups, {layout}, "
        f"{r.strategy.label}, compute {str(r.dtype).removeprefix('torch.')}",
    ]
    if r.tp > 1:
        lines.append(f"  per TP rank {plan.local_params / 1e9:.3f}B parameters (vocabulary padded to "
                     f"{r.config.vocab_size})")
    lines.append("per-rank persistent memory (rank 0)          plan        ZeRO formula")
    for role, value in plan.memory.items():
        lines.append(f"  {role:<24}{_gib(value)}  {_gib(plan.formula[role])}")
    lines.append(f"  {'total':<24}{_gib(plan.total_memory)}  {_gib(sum(plan.formula.values()))}"
                 f"   (padding {plan.padding_bytes:.0f} B)")
    lines.append("collectives per step (one microbatch)" + (", data-parallel group" if r.tp > 1 else ""))
    lines += _collective_lines(plan.step)
    if r.tp > 1:
        b, s = r.tokens
        lines.append(f"tensor-parallel activations per microbatch ({b} x {s} tokens), TP group")
        lines += _collective_lines(plan.tp_step)
    return "\n".join(lines)


def _collective_lines(step: dict[str, dict[str, int]]) -> list[str]:
    return [f"  {kind:<16}{count:6d} calls  {_gib(step['bytes'][kind])}" for kind, count in step["counts"].items()]
