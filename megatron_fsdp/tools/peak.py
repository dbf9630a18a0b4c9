"""The peak bytes of one training step on one rank, not only the persistent state.

``estimate_peak(plan, PeakOptions(recompute=True))`` adds to the plan's persistent bytes
(weights, main weights, main gradients, AdamW state: ``Plan.memory``) the largest of the
step's transient totals, phase by phase::

    forward_blocks    traced peak in the embedding and blocks   + root + two units gathered
    forward_head      traced peak in the logits and loss        + root + the last unit
    backward_head     traced peak in the loss's backward         + root + the last unit
    backward_blocks   traced peak in the blocks' backward        + root + two units
                                                                 + reduce buckets in flight
    optimizer         the optimizer's temporaries

and names the phase where the largest falls (``PeakEstimate.phase``). Per part:

- activations: one microbatch of the plan's ``micro_batch_size`` x ``seq_length`` tokens
  traced on fake tensors in the compute dtype (``activation_trace.py``), the logits and
  the loss's temporaries included, with or without full recomputation of every block
  (``PeakOptions.recompute``: the embedded GPT's ``recompute`` option). Under context
  parallelism the trace sees a rank's ``s / cp`` tokens (the gathered K and V of the
  whole sequence are not added); under tensor parallelism it traces the whole model and
  divides by ``tp`` (a bound: layer norms and residuals are not split without sequence
  parallelism).
- gathered (``optim_grads_params`` over more than one rank): the root groups' padded
  size and the largest unit's, in the compute dtype, the unit twice in the blocks with
  prefetch (``PeakOptions.prefetch``; [Note: gathered weights under ZeRO-3]).
- reduce buckets (``optim_grads`` and ``optim_grads_params`` over more than one rank): the
  largest unit's padded gradient in the reduce dtype, ``PeakOptions.buckets_in_flight``
  of them. ``no_shard`` and ``optim`` reduce in the persistent main-gradient buffer.
- optimizer: AdamW's single-tensor path (CPU's default) allocates two temporaries of its
  largest tensor; the multi-tensor (foreach, CUDA's default) path about two of the whole
  shard (``PeakOptions.optimizer_foreach``).

[Note: gathered weights under ZeRO-3] The root groups (embedding, final norm, output
layer: the parameters outside every unit) are gathered once per step and held to its
end, so they count in every phase. Units are gathered one after another; in the blocks
the next is prefetched while one computes (two held), while the head runs only the last
unit is held, kept from its forward into its backward.

[Note: the edit snapshot] Beside the plan's roles, the engine keeps one more persistent
copy under ``optim`` and ``optim_grads`` when the model weights are also the main weights
(no separate main dtype): a snapshot of this rank's model-weight shard, compared bit for
bit before the next forward to catch in-place edits of the parameters
(``runtime/weight_edits.py``). It is counted in ``PeakEstimate.persistent`` (not in
``Plan.memory``, which ``--check`` compares with the engine's buffers).

[Note: offload] CPU offload of the main weights, main gradients and optimizer state is not
built yet, so the plan has no offload figure: ``PeakOptions.offload`` is refused. When it
exists, the device peak is the same sum with those three roles replaced by what stays on
the device (``_device_persistent`` is the one place to change).

Measured against the real CPU peak (glibc's bytes in use, ``peak_measure.py``) in
``tests/test_plan_peak.py``. Not on CPU: the CUDA caching allocator's reserve and
fragmentation, NCCL buffers, cuBLAS workspaces, streams' deferred frees.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..enums import ShardingStrategy
from .activation_trace import ActivationTrace, trace_activations
from .plan import Plan, _elem, build_meta_gpt


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeakOptions:
    recompute: bool = False
    """Trace with full recomputation of every transformer block (``GPTConfig.recompute``)."""
    prefetch: bool = True
    """ZeRO-3 holds two gathered units (this one and the next, prefetched); ``False``: one."""
    buckets_in_flight: int = 2
    """Gradient reduce buckets alive at once under sharded gradients (one reducing, one filling)."""
    optimizer_foreach: bool = False
    """The optimizer's multi-tensor path (temporaries of the whole shard, not of one tensor)."""
    offload: bool = False
    """Offload of optimizer state to the host: not built yet ([Note: offload])."""

    def __post_init__(self) -> None:
        if self.buckets_in_flight < 1:
            raise ValueError(f"buckets_in_flight={self.buckets_in_flight} must be >= 1")
        if self.offload:
            raise NotImplementedError("offload=True: CPU offload is not built yet, so the plan has no offload "
                                      "figure to predict from; use offload=False")


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    persistent: int
    """Persistent bytes on the device: ``Plan.total_memory`` and the edit snapshot
    ([Note: the edit snapshot])."""
    activations: ActivationTrace
    """One microbatch's traced bytes beside the weights, for this rank (divided by ``tp``)."""
    gathered: int
    """Most bytes of gathered weights held at once (ZeRO-3 over more than one rank)."""
    reduce_buckets: int
    """Bytes of the gradient reduce buckets in flight (sharded gradients over more than one rank)."""
    optimizer_temporary: int
    """Bytes the optimizer step allocates and frees."""
    phases: dict[str, int]
    """Phase (``forward_blocks``, ``forward_head``, ``backward_head``, ``backward_blocks``,
    ``optimizer``) -> predicted bytes in use at its peak."""

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        """The phase where the peak falls."""
        return max(self.phases, key=self.phases.__getitem__)

    def as_dict(self) -> dict:
        return {"peak": self.peak, "phase": self.phase, "persistent": self.persistent,
                "activations": dataclasses.asdict(self.activations), "gathered": self.gathered,
                "reduce_buckets": self.reduce_buckets, "optimizer_temporary": self.optimizer_temporary,
                "phases": dict(self.phases)}


def _device_persistent(plan: Plan) -> int:
    """The persistent bytes on the device ([Note: offload]: all of them, for now)."""
    return plan.total_memory + _edit_snapshot(plan)


def _edit_snapshot(plan: Plan) -> int:
    """[Note: the edit snapshot] bytes: ZeRO-1/2 over more than one rank without separate
    main weights keep a copy of this rank's model-weight shard."""
    r = plan.request
    if r.strategy not in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS) or r.main_dtype is not None:
        return 0
    return sum(g.shard for g in plan.groups if g.world > 1) * _elem(r.dtype)


def _largest_unit(plan: Plan) -> int:
    """Padded elements of the largest FSDP unit (its dense and expert groups together)."""
    units: dict[Optional[int], int] = {}
    for g in plan.groups:
        if g.unit is not None:
            units[g.unit] = units.get(g.unit, 0) + g.padded
    return max(units.values(), default=0)


def _gathered(plan: Plan, options: PeakOptions) -> dict[str, int]:
    """Gathered bytes beside the shards, in the blocks and in the head ([Note: gathered
    weights under ZeRO-3]); none unless parameters are sharded over more than one rank."""
    r = plan.request
    if not (r.strategy.shards_params and r.dense_world > 1):
        return {"blocks": 0, "head": 0}
    elem = _elem(r.dtype)
    root = sum(g.padded for g in plan.groups if g.unit is None) * elem
    unit = _largest_unit(plan) * elem
    return {"blocks": root + unit * (2 if options.prefetch else 1), "head": root + unit}


def _optimizer_temporary(plan: Plan, module: torch.nn.Module, options: PeakOptions) -> int:
    """Two temporaries of AdamW's largest tensor (of the whole shard with foreach), in the main dtype."""
    r = plan.request
    elem = _elem(r.main_params_dtype or r.dtype)
    if options.optimizer_foreach:
        shard = sum(g.shard if r.strategy.shards_optimizer else g.numel for g in plan.groups)
        return 2 * shard * elem
    largest = max(p.numel() for p in module.parameters())
    world = r.dense_world if r.strategy.shards_optimizer else 1
    return 2 * -(-largest // world) * elem


def estimate_peak(plan: Plan, options: PeakOptions = PeakOptions(),
                  module: Optional[torch.nn.Module] = None) -> PeakEstimate:
    """The peak bytes of one steady-state step on rank 0 of ``plan`` (module docstring).
    ``module``: the meta model the plan was made from (built again when ``None``)."""
    r = plan.request
    cfg = dataclasses.replace(r.config, recompute=options.recompute) if options.recompute else r.config
    b, s = r.local_tokens
    trace = trace_activations(cfg, r.dtype, b, s)
    if r.tp > 1:
        trace = ActivationTrace(*(-(-v // r.tp) for v in dataclasses.astuple(trace)))
    module = module if module is not None else build_meta_gpt(r.config, r.dtype)
    gathered = _gathered(plan, options)
    buckets = 0
    if r.strategy.shards_grads and r.dense_world > 1:
        buckets = _largest_unit(plan) * _elem(r.comm_dtype) * options.buckets_in_flight
    optimizer = _optimizer_temporary(plan, module, options)
    persistent = _device_persistent(plan)
    phases = {
        "forward_blocks": persistent + trace.forward_blocks + gathered["blocks"],
        "forward_head": persistent + trace.forward_head + gathered["head"],
        "backward_head": persistent + trace.backward_head + gathered["head"],
        "backward_blocks": persistent + trace.backward_blocks + gathered["blocks"] + buckets,
        "optimizer": persistent + optimizer,
    }
    return PeakEstimate(persistent=persistent, activations=trace, gathered=max(gathered.values()), reduce_buckets=buckets,
                        optimizer_temporary=optimizer, phases=phases)


def format_peak(estimate: PeakEstimate) -> str:
    gib = 2**30
    a = estimate.activations
    return "\n".join([
        f"peak per rank {estimate.peak / gib:10.3f} GiB, in the {estimate.phase}",
        f"  persistent              {estimate.persistent / gib:10.3f} GiB",
        f"  activations (traced)    {a.forward_end / gib:10.3f} GiB at forward end, peaks "
        f"{a.forward_peak / gib:.3f} forward / {a.backward_peak / gib:.3f} backward",
        f"  gathered units          {estimate.gathered / gib:10.3f} GiB",
        f"  reduce buckets          {estimate.reduce_buckets / gib:10.3f} GiB",
        f"  optimizer temporaries   {estimate.optimizer_temporary / gib:10.3f} GiB",
    ])
