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

``padded`` is a group's size rounded up to a multiple of the world size, ``shard``
that divided by it. The textbook ZeRO formula (``zero_formula``) is the same without
padding; the plan reports the padding separately so the two can be compared exactly.
Main weights exist only when their dtype differs from the compute dtype.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..enums import ShardingStrategy
from ..models import presets as model_presets
from ..models.gpt import GPT, GPTConfig, TransformerBlock
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


def build_meta_gpt(name: str, dtype: torch.dtype) -> nn.Module:
    """The preset GPT on the meta device (no memory), in the compute dtype."""
    with torch.device("meta"):
        return GPT(gpt_config(name)).to(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    """A preset name (``PRESETS``)."""
    world: int
    """Data-parallel ranks (one shard group; no HSDP)."""
    strategy: ShardingStrategy
    dtype: torch.dtype = torch.bfloat16
    """Compute (model-weight) dtype."""
    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = torch.float32
    """``None``: the compute dtype (as ``MixedPrecisionPolicy``)."""
    grad_comm_dtype: Optional[torch.dtype] = None
    """``None``: the main-grad dtype."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world={self.world} must be >= 1")
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy, arg_name="strategy"))

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
    world: int
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


def plan_groups(module: nn.Module, unit_classes: tuple[type, ...], world: int, strategy: ShardingStrategy) -> list[GroupPlan]:
    """Root groups (one per top-level module outside the units) then unit groups in
    module order; under no_shard both are merged up to Megatron DDP's bucket size."""
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) != 1 or not all(p.requires_grad for p in module.parameters()):
        raise ValueError(f"the plan covers models of one dtype, all trainable; this one has dtypes {dtypes}")
    units = [m for m in module.modules() if isinstance(m, unit_classes)]
    seen: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            seen.setdefault(id(p), set()).add(index)
    root: dict[str, int] = {}
    for name, p in module.named_parameters():
        if len(seen.get(id(p), ())) != 1:  # outside every unit, or tied across units
            top = name.split(".")[0]
            root[top] = root.get(top, 0) + p.numel()
    unit_numels = [sum(p.numel() for p in u.parameters() if len(seen[id(p)]) == 1) for u in units]
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
    groups: tuple[GroupPlan, ...]
    memory: dict[str, int]
    """Persistent bytes on rank 0 by role (optimizer state: AdamW)."""
    formula: dict[str, float]
    """The textbook ZeRO formula, without padding, for the same roles."""
    step: dict[str, dict[str, int]]
    """``{"counts": {kind: n}, "bytes": {kind: payload bytes}}`` of one steady-state step."""

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
            "strategy": r.strategy.label,
            "dtype": str(r.dtype).removeprefix("torch."),
            "params": self.params,
            "groups": len(self.groups),
            "memory": dict(self.memory),
            "memory_total": self.total_memory,
            "formula": dict(self.formula),
            "padding_bytes": self.padding_bytes,
            "step": self.step,
        }


def make_plan(request: PlanRequest, module: Optional[nn.Module] = None, unit_classes: tuple[type, ...] = (TransformerBlock,)) -> Plan:
    module = module if module is not None else build_meta_gpt(request.model, request.dtype)
    strategy, world = request.strategy, request.world
    groups = tuple(plan_groups(module, unit_classes, world, strategy))
    params = sum(g.numel for g in groups)
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
        params=params,
        groups=groups,
        memory=memory,
        formula=zero_formula(request, params),
        step=step_collectives(request, list(groups)),
    )


def zero_formula(request: PlanRequest, params: int) -> dict[str, float]:
    """Per-rank bytes of the textbook ZeRO levels (no padding), with a main-weight
    copy when the compute dtype is narrower than the main dtype."""
    s, w = request.strategy, request.world
    return {
        "model_weights": _elem(request.dtype) * params / (w if s.shards_params else 1),
        "main_weights": _elem(request.main_dtype) * params / (w if s.shards_optimizer else 1),
        "main_grads": _elem(request.grads_dtype) * params / (w if s.shards_grads else 1),
        "optimizer_state": request.optimizer_state_elem * params / (w if s.shards_optimizer else 1),
    }


def step_collectives(request: PlanRequest, groups: Sequence[GroupPlan]) -> dict[str, dict[str, int]]:
    """Collectives of one steady-state step with one microbatch (see the module note)."""
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}

    def add(kind: str, payload_elems: int, elem: int) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        nbytes[kind] = nbytes.get(kind, 0) + payload_elems * elem

    if request.world == 1:
        return {"counts": counts, "bytes": nbytes}
    strategy = request.strategy
    weight, comm = _elem(request.dtype), _elem(request.comm_dtype)
    last_unit = max((g.unit for g in groups if g.unit is not None), default=None)
    for g in groups:
        if strategy is ShardingStrategy.NO_SHARD:
            add("all_reduce", g.padded, comm)
            continue
        gathers = 1 if (not strategy.shards_params or g.unit is None or g.unit == last_unit) else 2
        for _ in range(gathers):
            add("all_gather", g.padded, weight)
        add("reduce_scatter", g.padded, comm)
    return {"counts": counts, "bytes": nbytes}


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def format_plan(plan: Plan) -> str:
    r = plan.request
    lines = [
        f"{r.model}: {plan.params / 1e9:.3f}B parameters, {len(plan.groups)} groups, world {r.world}, "
        f"{r.strategy.label}, compute {str(r.dtype).removeprefix('torch.')}",
        "per-rank persistent memory (rank 0)          plan        ZeRO formula",
    ]
    for role, value in plan.memory.items():
        lines.append(f"  {role:<24}{_gib(value)}  {_gib(plan.formula[role])}")
    lines.append(f"  {'total':<24}{_gib(plan.total_memory)}  {_gib(sum(plan.formula.values()))}"
                 f"   (padding {plan.padding_bytes:.0f} B)")
    lines.append("collectives per step (one microbatch)")
    for kind, count in plan.step["counts"].items():
        lines.append(f"  {kind:<16}{count:6d} calls  {_gib(plan.step['bytes'][kind])}")
    return "\n".join(lines)
