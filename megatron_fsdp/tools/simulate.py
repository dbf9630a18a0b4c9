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

With tensor parallelism (``PlanRequest.tp`` > 1) the fake world is a ``(dp, tp)``
mesh; the meta GPT gets the embedded models' TP plan (``models.tensor_parallel.
apply_tensor_parallel``, without sequence parallelism) on ``mesh["tp"]`` and is wrapped
with ``dp_shard_dim="dp", tp_dim="tp"``, so rank 0 holds the TP-local pieces of
(dp 0, tp 0) sharded over the data-parallel ranks; the plan's own activation
collectives are recorded apart (``record_tp_collectives``).

The fake group must not meet a real one: run this in a process of its own
(``python -m megatron_fsdp.tools.plan_cli --check`` does).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.collectives import record_collectives
from ..enums import ShardingStrategy
from ..fully_shard import fully_shard
from ..mixed_precision import MixedPrecisionPolicy
from ..models.gpt import TransformerBlock, gpt_loss
from ..models.tensor_parallel import apply_tensor_parallel
from .plan import Plan, PlanRequest, build_meta_gpt


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


def simulate(request: PlanRequest, *, steps: int = 3) -> dict[str, Any]:
    """Rank 0's persistent bytes, collectives of the last of ``steps`` steps (or of the
    engine's plan when ``steps == 0``), wrap time and host memory."""
    init_fake_world(request.world)
    module = build_meta_gpt(request.config, request.dtype)
    policy = MixedPrecisionPolicy(
        main_params_dtype=request.main_params_dtype,
        main_grads_dtype=request.main_grads_dtype,
        grad_comm_dtype=request.grad_comm_dtype,
    )
    rss_before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    mesh_kwargs: dict[str, Any] = {}
    if request.tp > 1:
        mesh = init_device_mesh("cpu", (request.dp, request.tp), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(module, mesh["tp"], sequence_parallel=False)
        mesh_kwargs = dict(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    model, optimizer = fully_shard(
        module,
        lambda params: torch.optim.AdamW(params, lr=1e-4),
        fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=request.strategy.value,
        init_model_with_meta_device=True,
        mixed_precision_policy=policy,
        device=torch.device("cpu"),
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
    }
    if steps > 0:
        out["step"], out["tp_step"], out["step_s"] = _run_steps(model, optimizer, steps, request.tokens)
        out["optimizer_state_source"] = "optimizer.state after the steps"
        out["memory"]["optimizer_state"] = _optimizer_state_bytes(optimizer)
        out["step_source"] = f"step {steps} of {steps} recorded"
        out["step_rss_growth"] = _max_rss_bytes() - rss_before
    else:
        out["step"] = engine_step_collectives(model)
        out["memory"]["optimizer_state"] = request.optimizer_state_elem * sum(
            p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
        )
        out["step_source"] = "the engine's built groups and units (no step run)"
    return out


def _run_steps(model, optimizer, steps: int, shape: tuple[int, int]) -> tuple[dict, dict, float]:
    """The engine's and the TP plan's collectives of the last of ``steps`` steps on
    ``shape`` = (micro batch, sequence length) tokens, and that step's seconds."""
    batch, seq = shape
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.module.config.vocab_size, (batch, seq + 1), generator=generator)
    last: dict = {}
    last_tp: dict = {}
    start = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        with record_collectives() as rec, record_tp_collectives() as tp_rec:
            optimizer.zero_grad()
            gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
        last = {"counts": dict(rec.counts), "bytes": dict(rec.bytes)}
        last_tp = {"counts": dict(tp_rec.counts), "bytes": dict(tp_rec.bytes)}
    elapsed = time.perf_counter() - start
    model.finish_param_sync()
    return last, last_tp, elapsed


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def engine_step_collectives(model) -> dict[str, dict[str, int]]:
    """The collectives one steady-state step issues, read off the built engine:
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
        if weights.layout.world_size == 1:
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
            kind = "all_reduce" if group.strategy is ShardingStrategy.NO_SHARD else "reduce_scatter"
            add(kind, group.layout.padded_numel, comm)
    return {"counts": counts, "bytes": nbytes}


def compare(plan: Plan, measured: dict[str, Any]) -> list[str]:
    """Every number where the fake-group build differs from the plan (empty: equal)."""
    problems = []
    for role, planned in plan.memory.items():
        got = measured["memory"].get(role, 0)
        if got != planned:
            problems.append(f"memory {role}: built {got} B, planned {planned} B")
    for field in ("counts", "bytes"):
        planned, got = plan.step[field], measured["step"][field]
        if planned != got:
            problems.append(f"collective {field}: built {got}, planned {planned}")
        if "tp_step" in measured and plan.tp_step[field] != measured["tp_step"][field]:
            problems.append(f"tensor-parallel collective {field}: ran {measured['tp_step'][field]}, "
                            f"planned {plan.tp_step[field]}")
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


@contextlib.contextmanager
def record_tp_collectives() -> Iterator[_FunctionalCollectives]:
    """Record the tensor-parallel (DTensor) collectives issued inside the block."""
    with _FunctionalCollectives() as mode:
        yield mode
