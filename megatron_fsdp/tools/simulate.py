"""Scale by simulation: build a model for W ranks on torch's fake process group.

The fake group (``init_process_group("fake", ...)``) answers every collective at
once without moving data, so one CPU process can play rank 0 of a 1024-rank job
through the *real* construction path: the model is built on the meta device and
``fully_shard`` materialises it module by module straight into rank 0's shards
(meta_init.py), so host memory holds one module's full weights at a time plus
this rank's shards. What comes out is what rank 0 of the real job would hold and
issue: persistent buffer bytes, optimizer state, collectives per step.

Gathered buckets on a fake group hold whatever the allocator handed out, so a
training step here exercises control flow and counts collectives; its numbers
are meaningless. For large models (``steps=0``) the step's collectives are
counted from the engine's built groups and units instead of by running it.

The meshes are the launcher's (``parallel_dims.ParallelDims``, Megatron-LM's rank order).
With tensor or context parallelism (``PlanRequest.tp`` or ``cp`` > 1) the fake world is
its ``(dp_shard, cp, tp)`` mesh, the (dp_shard, cp) ranks flattened into ``dp_shard_cp``
when cp > 1; the meta GPT gets the embedded models' TP plan (``models.tensor_parallel.
apply_tensor_parallel``, without sequence parallelism) on ``mesh["tp"]`` and is wrapped
over the dp x cp ranks of its TP piece, so rank 0 holds the TP-local pieces of tp rank 0
sharded over them; the TP plan's activation collectives are recorded apart
(``record_tp_collectives``). Context parallelism changes no parameter: without TP its
shard group is the whole world, which the check confirms (``layout``). The GPT gets the
embedded models' CP attention (``models.context_parallel.apply_context_parallel`` on
``mesh["cp"]``), a training step runs rank 0's ``s / cp`` tokens of every sequence, and the
attention layers' own counters (``kv_exchange_counts``) give the K/V all-gathers and
reduce-scatters of the last step (``cp_step``).

A mixture-of-experts model gets the launcher's expert mesh ``(edp, ep)`` (named
``(<the dense shard dimension>, "ep")``) as ``expt_device_mesh`` and, with ``ep`` > 1, the
embedded models' expert parallelism (``models.expert_parallel.apply_expert_parallel`` on
its ``ep`` dimension: rank 0 keeps its experts under their global names and exchanges tokens
with the other EP ranks); the engine shards the experts over the ``edp`` ranks. The fake
group answers no collective, so the EP dispatch would read its split sizes from an
uninitialised count exchange: during steps ``_MirroredAllToAll`` answers that equal-split
exchange with this rank's own counts (a world in which every rank routes as rank 0 does,
each receiving as many rows as it sends), and records every all-to-all (``ep_step``).

The fake group must not meet a real one: run this in a process of its own
(``python -m megatron_fsdp.tools.plan_cli --check`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import device as device_mod
from ..comm.collectives import record_collectives
from ..enums import ShardingStrategy
from ..fully_shard import fully_shard
from ..mixed_precision import MixedPrecisionPolicy
from ..models.context_parallel import apply_context_parallel, kv_exchange_counts
from ..models.expert_parallel import apply_expert_parallel, expert_exchange_counts
from ..models.gpt import GPT, TransformerBlock, gpt_loss
from ..models.tensor_parallel import apply_tensor_parallel
from ..parallel_dims import ParallelDims
from ..param_marks import is_expert_param
from .plan import Plan, PlanRequest, build_meta_gpt, expert_index, local_experts


def init_fake_world(world: int) -> None:
    """Join a fake process group of ``world`` ranks as rank 0 (once per process)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world:
            raise RuntimeError(
                f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks is already initialised; "
                f"the fake-group simulation of {world} ranks needs a process of its own"
            )
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def simulate(request: PlanRequest, *, steps: int = 3, device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Rank 0's persistent bytes (in all and per parameter kind), the shard groups it
    built, collectives of the last of ``steps`` steps (or of the engine's plan when
    ``steps == 0``), wrap time and host memory. ``device``: where the shards and the steps'
    tensors live (the fake group moves nothing; a CUDA device runs the real kernels)."""
    init_fake_world(request.world)
    module = build_meta_gpt(request.config, request.dtype)
    policy = MixedPrecisionPolicy(
        main_params_dtype=request.main_params_dtype,
        main_grads_dtype=request.main_grads_dtype,
        grad_comm_dtype=request.grad_comm_dtype,
    )
    rss_before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    mesh_kwargs = _parallelize(module, request, device_mod.mesh_device_type(device))
    model, optimizer = fully_shard(
        module,
        lambda params: torch.optim.AdamW(params, lr=1e-4),
        fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=request.strategy.value,
        init_model_with_meta_device=True,
        mixed_precision_policy=policy,
        device=device,
        **mesh_kwargs,
    )
    wrap_s = time.perf_counter() - start
    out: dict[str, Any] = {
        "wrap_s": wrap_s,
        "wrap_cpu_s": time.process_time() - cpu_start,  # on a shared machine wall time follows the load
        "rss_before": rss_before,
        "wrap_rss_growth": _max_rss_bytes() - rss_before,
        "init_peak_param_bytes": model.init_peak_param_bytes,
        "memory": {k: v for k, v in model.buffer_accounting.persistent.items() if v},
        "layout": engine_layout(model),
        "experts_held": experts_held(model.module),
    }
    if steps > 0:
        out.update(_run_steps(model, optimizer, steps, request.local_tokens, device))
        out["optimizer_state_source"] = "optimizer.state after the steps"
        out["memory"]["optimizer_state"] = _optimizer_state_bytes(optimizer, list(optimizer.state))
        out["step_source"] = f"step {steps} of {steps} recorded"
        out["step_rss_growth"] = _max_rss_bytes() - rss_before
    else:
        out["step"] = engine_step_collectives(model)
        out["memory"]["optimizer_state"] = _planned_optimizer_bytes(request, model.parameters())
        out["step_source"] = "the engine's built groups and units (no step run)"
    out["memory_by_kind"] = engine_memory_by_kind(model, lambda params: (
        _optimizer_state_bytes(optimizer, params) if steps > 0 else _planned_optimizer_bytes(request, params)))
    out["step_by_kind"] = {kind: engine_step_collectives(model, kind) for kind in out["layout"]}
    return out


def _parallelize(module: GPT, request: PlanRequest, device_type: str = "cpu") -> dict[str, Any]:
    """Lay ``module`` out as the launcher does (TP plan, CP attention, EP experts) and return the
    meshes ``fully_shard`` takes: ``ParallelDims``'s dense mesh when TP or CP needs one
    (else the default one over every rank), and the expert mesh of a MoE model."""
    dims = ParallelDims(world=request.world, tp=request.tp, cp=request.cp, ep=request.ep)
    mesh = dims.build_mesh(device_type)
    kwargs = dims.wrap_kwargs(mesh, None)
    tp_mesh = dims.tp_mesh(mesh)
    if tp_mesh is not None:
        apply_tensor_parallel(module, tp_mesh, sequence_parallel=False)
    cp_mesh = dims.cp_mesh(mesh)
    if cp_mesh is not None:
        apply_context_parallel(module, cp_mesh)
    if module.moe_layers():
        expert_mesh = dims.build_expert_mesh(device_type)
        kwargs["expt_device_mesh"] = expert_mesh
        if request.ep > 1:
            apply_expert_parallel(module, dims.ep_mesh(expert_mesh))
    return kwargs


def experts_held(module: nn.Module) -> list[int]:
    """The global expert indices rank 0's model holds parameters of (empty: a dense model)."""
    return sorted({expert_index(name) for name, p in module.named_parameters() if is_expert_param(p)})


def _group_kind(group) -> str:
    return "expert" if is_expert_param(group.params[0]) else "dense"


def engine_layout(model) -> dict[str, list[int]]:
    """Parameter kind -> the sizes of the shard groups the engine built for it."""
    sizes: dict[str, set[int]] = {}
    for group in model.param_and_grad_buffer.groups:
        sizes.setdefault(_group_kind(group), set()).add(group.dp.shard_size)
    return {kind: sorted(s) for kind, s in sizes.items()}


def engine_memory_by_kind(model, optimizer_bytes) -> dict[str, dict[str, int]]:
    """Parameter kind -> the engine's persistent buffer bytes by role, and the optimizer
    state of its distributed parameters (``optimizer_bytes(params)``)."""
    out: dict[str, dict[str, int]] = {}
    for group in model.param_and_grad_buffer.groups:
        memory = out.setdefault(_group_kind(group), dict.fromkeys(("model_weights", "main_weights", "main_grads",
                                                                   "optimizer_state"), 0))
        for role in ("model_weights", "main_weights", "main_grads"):
            buffer = getattr(group, role)
            if buffer is not None:
                memory[role] += buffer.data.numel() * buffer.data.element_size()
        memory["optimizer_state"] += optimizer_bytes(group.dist_params)
    return out


def _run_steps(model, optimizer, steps: int, shape: tuple[int, int],
               device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """The collectives of the last of ``steps`` steps on ``shape`` = (micro batch, tokens per
    sequence on this rank): the engine's (``step``), the TP plan's, the CP attention's and the
    EP dispatch's (``tp_step``, ``cp_step``, ``ep_step``; ``ep_exchanges``: the MoE layers' own
    counters), and that step's seconds (``step_s``)."""
    batch, seq = shape
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.module.config.vocab_size, (batch, seq + 1), generator=generator).to(device)
    counters = list(kv_exchange_counts(model.module).values()) + list(expert_exchange_counts(model.module).values())
    out: dict[str, Any] = {}
    for _ in range(steps):
        start = time.perf_counter()
        for counts in counters:
            counts.reset()
        with (record_collectives() as rec, record_tp_collectives() as tp_rec, _FlatReduceScatter(),
              _MirroredAllToAll() as ep_rec):
            optimizer.zero_grad()
            gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
        out = {"step": {"counts": dict(rec.counts), "bytes": dict(rec.bytes)},
               "tp_step": {"counts": dict(tp_rec.counts), "bytes": dict(tp_rec.bytes)},
               "ep_step": {"counts": dict(ep_rec.counts), "bytes": dict(ep_rec.bytes)},
               "step_s": time.perf_counter() - start}
    model.finish_param_sync()
    out["cp_step"] = _kv_tally(kv_exchange_counts(model.module).values())
    out["ep_exchanges"] = _exchange_totals(expert_exchange_counts(model.module).values())
    return out


def _exchange_totals(exchange_counts) -> dict[str, int]:
    """The MoE layers' EP counters (``ExchangeCounts``) summed over the layers."""
    totals: dict[str, int] = {}
    for counts in exchange_counts:
        for name, value in dataclasses.asdict(counts).items():
            totals[name] = totals.get(name, 0) + value
    return totals


def _kv_tally(kv_counts) -> dict[str, dict[str, int]]:
    """The CP attention layers' counters as one tally (``Plan.cp_step``'s form)."""
    fields = {"all_gather": ("all_gathers", "gathered_bytes"), "reduce_scatter": ("reduce_scatters", "scattered_bytes")}
    out: dict[str, dict[str, int]] = {"counts": {}, "bytes": {}}
    for kind, (calls, nbytes) in fields.items():
        if sum(getattr(c, calls) for c in kv_counts):
            out["counts"][kind] = sum(getattr(c, calls) for c in kv_counts)
            out["bytes"][kind] = sum(getattr(c, nbytes) for c in kv_counts)
    return out


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    """Bytes of ``optimizer``'s tensor state of ``params`` (this rank's pieces)."""
    total = 0
    for param in params:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _planned_optimizer_bytes(request: PlanRequest, params) -> int:
    """AdamW's state for ``params``' local pieces, without running a step."""
    return request.optimizer_state_elem * sum(_local_numel(p) for p in params)


def engine_step_collectives(model, kind: Optional[str] = None) -> dict[str, dict[str, int]]:
    """The collectives one steady-state step issues, read off the built engine (only
    the groups of parameter ``kind``, "dense" or "expert", when given):
    ZeRO-3 gathers root groups once and unit groups in forward and backward except
    the last unit's (kept gathered from its forward into its backward); ZeRO-1/2
    refresh every replicated model-weight buffer once; every trainable group reduces
    once."""
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}

    def add(kind: str, tensor_numel: int, elem: int) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        nbytes[kind] = nbytes.get(kind, 0) + tensor_numel * elem

    buffer = model.param_and_grad_buffer
    last_unit = model.units[-1].index if model.units else None
    policy = model.mp_policy
    for group in buffer.groups:
        weights = group.model_weights
        if weights.layout.world_size == 1 or (kind is not None and _group_kind(group) != kind):
            continue
        elem = weights.data.element_size()
        if weights.is_distributed:
            gathers = 1 if group.unit is None or group.unit == last_unit else 2
        else:
            gathers = 1 if group.strategy.shards_optimizer else 0
        for _ in range(gathers):
            add("all_gather", group.layout.padded_numel, elem)
        if group.requires_grad:
            comm = torch.empty((), dtype=policy.comm_dtype_for(group.dtype)).element_size()
            reduce_kind = "all_reduce" if group.strategy is ShardingStrategy.NO_SHARD else "reduce_scatter"
            add(reduce_kind, group.layout.padded_numel, comm)
    return {"counts": counts, "bytes": nbytes}


def planned_layout(plan: Plan) -> dict[str, list[int]]:
    """Parameter kind -> the shard-group sizes the plan expects."""
    return {kind: sorted({g.world for g in plan.groups if g.kind == kind}) for kind in plan.step_by_kind}


def compare(plan: Plan, measured: dict[str, Any]) -> list[str]:
    """Every number where the fake-group build differs from the plan (empty: equal)."""
    r = plan.request
    problems = []
    for role, planned in plan.memory.items():
        got = measured["memory"].get(role, 0)
        if got != planned:
            problems.append(f"memory {role}: built {got} B, planned {planned} B")
    if measured["memory_by_kind"] != plan.memory_by_kind:
        problems.append(f"memory by parameter kind: built {measured['memory_by_kind']}, planned {plan.memory_by_kind}")
    if measured["layout"] != planned_layout(plan):
        problems.append(f"shard groups by parameter kind: built {measured['layout']}, planned {planned_layout(plan)}")
    held = list(local_experts(r.config.num_moe_experts, r.ep)) if r.config.num_moe_experts else []
    if measured["experts_held"] != held:
        problems.append(f"experts held by rank 0: built {measured['experts_held']}, planned {held}")
    if measured["step_by_kind"] != plan.step_by_kind:
        problems.append(f"collectives by parameter kind: built {measured['step_by_kind']}, planned {plan.step_by_kind}")
    for field in ("counts", "bytes"):
        planned, got = plan.step[field], measured["step"][field]
        if planned != got:
            problems.append(f"collective {field}: built {got}, planned {planned}")
        for name, planned_step in (("tensor", plan.tp_step), ("context", plan.cp_step), ("expert", plan.ep_step)):
            ran = measured.get(f"{name[0]}p_step")
            if ran is not None and ran[field] != planned_step[field]:
                problems.append(f"{name}-parallel collective {field}: ran {ran[field]}, planned {planned_step[field]}")
    return problems


# -- tensor parallelism --------------------------------------------------------------------
_FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
_BOOKKEEPING = ("wait_tensor", "_wrap_tensor_autograd")
"""Functional ops that move nothing (waiting on, and wrapping, a collective's result)."""


class _FunctionalCollectives(TorchDispatchMode):
    """Counts torch's functional collectives, which DTensor (the TP plan) issues and
    the engine never does: calls and payload bytes per kind (the larger of input and
    output, as the engine's recorder counts a gathered or reduced buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func._opname not in _BOOKKEEPING:
            kind = _FUNCTIONAL_KINDS.get(func._opname, func._opname)  # an unknown one shows as itself
            tensors = [t for t in (args[0], out) if isinstance(t, torch.Tensor)]
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + max(t.numel() * t.element_size() for t in tensors)
        return out


class _FlatReduceScatter(TorchDispatchMode):
    """The fake group's reduce-scatter splits its input along the first dimension into
    outputs of the output's shape; real backends take any input of ``group size x`` the
    output's elements, and the CP attention's backward hands it (CP, b, s/cp, ...) for a
    (b, s/cp, ...) output. This mode gives the fake group a view of the input it can split."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d._reduce_scatter_base_.default and args[1].dim() != args[0].dim():
            output, full = args[0], args[1]
            args = (output, full.reshape(-1, *output.shape[1:]), *args[2:])
        return func(*args, **(kwargs or {}))


class _MirroredAllToAll(TorchDispatchMode):
    """The fake group's all-to-alls, answered and counted. An equal-split all-to-all (EP's
    exchange of rows per expert) is answered with this rank's own input, as if every rank
    routed as this one does: then each rank receives as many rows as it sends, and the
    uneven-split token exchanges that follow get consistent sizes. Counted per call: the
    input bytes (this rank's routed side: in a mirrored world input and output are the same
    size), equal-split calls as ``all_to_all_counts``, the others as ``all_to_all``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d.alltoall_base_.default:
            output, source, _, output_splits, input_splits = args[:5]
            equal = not output_splits and not input_splits
            if equal:
                output.copy_(source)
            kind = "all_to_all_counts" if equal else "all_to_all"
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + source.numel() * source.element_size()
        return out


@contextlib.contextmanager
def record_tp_collectives() -> Iterator[_FunctionalCollectives]:
    """Record the tensor-parallel (DTensor) collectives issued inside the block."""
    with _FunctionalCollectives() as mode:
        yield mode
