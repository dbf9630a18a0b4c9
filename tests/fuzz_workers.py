"""What one fuzz draw runs on every rank (tests/test_fuzz.py draws the configuration),
and the single-process reference it is compared with.

Three ways in, as users come: ``engine`` (``fully_shard`` / ``fully_shard_model``
with a training-loop pattern), ``mcore_loop`` (Megatron-core's
``FullyShardedDataParallel`` driven as Megatron-LM's loop does, ``broadcast_params()``
after building) and ``experimental`` (the per-module API over a device mesh, as
FSDP2 is used). Each returns ("trained", max abs difference from the reference) or
("rejected", the error's type and message)."""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import megatron_fsdp as mf
from megatron_fsdp.comm.distributed_index import build_hybrid_mesh
from fuzz_models import build, initialised_like_meta
from models import Block, Net, loss_fn, make_batches

LR = 0.05
STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}
UNITS = {
    "none": None,
    "block": [Block],
    "block_path": ["models.Block"],
    "linear": [nn.Linear],
    "nested": [Block, nn.Linear],
    "bad_path": ["no.such.Module"],
}
FROZEN = ("blocks.0.fc1.weight", "blocks.0.fc1.bias")
HOOKED = "blocks.1.fc2.weight"


def optimizer_factory(name):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR)
    return lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def skip_for(pattern: str, step: int, rank: int) -> set:
    if pattern == "skip_block":
        return {1} if step == 1 else set()
    if pattern == "rank_skip":
        return {(rank + step) % 4}  # blocks 2 and 3 may not exist: that rank skips nothing
    return set()


def freeze_step(params: dict, step: int) -> None:
    """Step 1 frozen (through the optimizer's parameters), step 2 unfrozen."""
    for name in FROZEN:
        if step in (1, 2):
            params[name].requires_grad_(step == 1)


def freeze_parts(model: nn.Module, parts: str) -> None:
    """Frozen before wrapping: a whole block, a LayerNorm inside a trained block, or both."""
    if parts in ("block", "both"):
        model.blocks[-1].requires_grad_(False)
    if parts in ("norm", "both"):
        model.blocks[0].norm.requires_grad_(False)


def add_hooks(named_params: dict, kind: str) -> None:
    """Linear gradient hooks (so each rank's share, then the mean, equals the hook on
    the global gradient): one parameter tripled, or every parameter halved."""
    if kind == "named" and named_params[HOOKED].requires_grad:
        named_params[HOOKED].register_hook(lambda g: g * 3)
    elif kind == "all":
        for p in named_params.values():
            if p.requires_grad:  # torch refuses hooks on frozen tensors
                p.register_hook(lambda g: g * 0.5)


def init_seed(cfg: dict, rank: int) -> int:
    """Seed of this rank's initialisation: the same everywhere, or one per rank (the
    engine must start every rank from data-parallel rank 0's: seed 100)."""
    return 100 + rank if cfg["init"] == "rank_seeded" else 0


@torch.no_grad()
def edit_weights(model):
    for p in model.parameters():
        p.clamp_(-0.3, 0.3)
        p.mul_(0.95)


def reference(base: nn.Module, batches, cfg: dict, world: int) -> dict:
    """Single process on the global batch: main-dtype weights updated by the optimizer,
    a copy in the model's own dtypes doing forward/backward, the same pattern."""
    compute = copy.deepcopy(base)
    master = copy.deepcopy(base)
    main_dtype = DTYPES.get(cfg["main_params"])
    for p in master.parameters():
        p.data = p.data.to(main_dtype or p.dtype)
    add_hooks(dict(compute.named_parameters()), cfg["hooks"])
    opt = optimizer_factory(cfg["optimizer"])(master.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if cfg["pattern"] == "scheduler" else None
    scale = world if cfg["per_token"] else 1.0  # per-token: gradients sum over ranks
    dtype = next(compute.parameters()).dtype
    for step, (x, y) in enumerate(batches):
        if cfg["pattern"] == "freeze_unfreeze":
            freeze_step(dict(compute.named_parameters()), step)
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.copy_(m)
        opt.zero_grad()
        compute.zero_grad()
        loss = 0.0
        for r, (xr, yr) in enumerate(zip(x.chunk(world), y.chunk(world))):
            compute.skip = skip_for(cfg["pattern"], step, r)
            loss = loss + loss_fn("net", compute(xr.to(dtype)), yr.to(dtype))
        (scale * loss / world).backward()
        for c, m in zip(compute.parameters(), master.parameters()):
            m.grad = None if c.grad is None else c.grad.to(m.dtype)
        opt.step()
        if sched is not None:
            sched.step()
        if cfg["pattern"] == "inplace_edit":
            edit_weights(master)
    return {n: p.detach().float() for n, p in master.named_parameters()}


def reference_base(cfg: dict, rank0_seed: int) -> nn.Module:
    """The weights every rank must start from (data-parallel rank 0's)."""
    dtype = DTYPES[cfg["compute"]]
    if cfg["meta_init"]:
        base = initialised_like_meta(cfg["model"], dtype, rank0_seed)
    else:
        base = build(cfg["model"], dtype, rank0_seed)
    freeze_parts(base, cfg["frozen_parts"])
    return base


def compare(got: dict, expected: dict) -> tuple[str, float]:
    diffs = [(got[k].float() - v).abs().max().item() for k, v in expected.items() if v.numel()]
    assert len(got) >= len(expected), sorted(set(expected) - set(got))
    return "trained", max(diffs)


def rejected(exc: Exception) -> tuple[str, str]:
    assert str(exc), "an error without a message"
    return "rejected", f"{type(exc).__name__}: {exc}"


# -- engine: fully_shard / fully_shard_model, with a training-loop pattern ----------------
def _mesh_kwargs(cfg: dict) -> dict:
    if not cfg["hybrid"]:
        return {}
    return dict(device_mesh=build_hybrid_mesh("cpu", cfg["outer_size"]), dp_shard_dim="dp_shard",
                dp_outer_dim="dp_outer", tp_dim="tp", hybrid_fsdp_group=dist.group.WORLD)


def _wrap_kwargs(cfg: dict) -> dict:
    policy = mf.MixedPrecisionPolicy(
        main_params_dtype=cfg["main_params"], main_grads_dtype=cfg["main_grads"], grad_comm_dtype=cfg["grad_comm"]
    )
    return dict(
        fsdp_unit_modules=UNITS[cfg["units"]],
        zero_dp_strategy=cfg["strategy"],
        outer_dp_sharding_strategy=cfg["outer"],
        init_model_with_meta_device=cfg["meta_init"],
        mixed_precision_policy=policy,
        overlap_grad_reduce=cfg["overlap_grad_reduce"],
        overlap_param_gather=cfg["overlap_param_gather"],
        disable_bucketing=cfg["disable_bucketing"],
        average_in_collective=cfg["average_in_collective"],
        calculate_per_token_loss=cfg["per_token"],
        enable_fine_grained_param_gather=cfg["fine_grained"],
        fsdp_double_buffer=cfg["double_buffer"],
        suggested_communication_unit_size=cfg["suggested"],
        **_mesh_kwargs(cfg),
    )


def _engine_module(cfg: dict, rank: int) -> nn.Module:
    module = build(cfg["model"], DTYPES[cfg["compute"]], init_seed(cfg, rank), meta=cfg["meta_init"])
    freeze_parts(module, cfg["frozen_parts"])
    if cfg["no_shard_mark"] == "module":
        mf.fsdp_no_shard(module.blocks[0])
    elif cfg["no_shard_mark"] == "param":
        mf.fsdp_no_shard(module.blocks[0].fc1.weight)
    return module


def _engine_backward(model, x, y, rank, world, cfg, step, dtype):
    """This rank's share in ``microbatches`` pieces; all but the last under no_sync,
    except for plain accumulation (every piece a synced backward)."""
    model.module.skip = skip_for(cfg["pattern"], step, rank)
    xs, ys = x.chunk(world)[rank].chunk(cfg["microbatches"]), y.chunk(world)[rank].chunk(cfg["microbatches"])
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        quiet = i < len(xs) - 1 and cfg["pattern"] != "plain_accumulation"
        with model.no_sync() if quiet else contextlib.nullcontext():
            if cfg["two_forwards"]:  # the mean of the halves' mean losses: the piece's mean loss
                halves = zip(xm.chunk(2), ym.chunk(2))
                loss = sum(loss_fn("net", model(xh.to(dtype)), yh.to(dtype)) for xh, yh in halves) / 2
            else:
                loss = loss_fn("net", model(xm.to(dtype)), ym.to(dtype))
            (loss / len(xs)).backward()


def _engine_steps(model, opt, sched, batches, rank, world, cfg, first: int = 0) -> None:
    dtype = DTYPES[cfg["compute"]]  # the input layer's, in every model
    pattern = cfg["pattern"]
    for step, (x, y) in enumerate(batches, start=first):
        if pattern == "freeze_unfreeze":  # frozen through the wrapper, unfrozen through the module
            freeze_step(dict(model.named_parameters()) if step == 1 else dict(model.module.named_parameters()), step)
        if pattern == "closure":
            def closure(x=x, y=y, step=step):
                opt.zero_grad()
                _engine_backward(model, x, y, rank, world, cfg, step, dtype)
                return torch.zeros(())

            opt.step(closure)
        else:
            opt.zero_grad()
            _engine_backward(model, x, y, rank, world, cfg, step, dtype)
            opt.step()
        if sched is not None:
            sched.step()
        if pattern == "inplace_edit":
            edit_weights(model)


def engine_worker(rank, world, *, cfg):
    batches = make_batches("net", STEPS, batch=2 * world * cfg["microbatches"])
    try:
        module = _engine_module(cfg, rank)
        wrap = _wrap_kwargs(cfg)
        if cfg["binding"] == "plain":
            model = mf.fully_shard_model(module, **wrap)
            opt = optimizer_factory(cfg["optimizer"])(model.parameters())
        else:
            model, opt = mf.fully_shard(module, optimizer_factory(cfg["optimizer"]), **wrap)
    except (ValueError, NotImplementedError) as exc:
        return rejected(exc)
    add_hooks(dict(model.named_parameters()), cfg["hooks"])  # after wrapping, as DDP users do
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if cfg["pattern"] == "scheduler" else None
    try:
        _engine_steps(model, opt, sched, batches[:1], rank, world, cfg)
    except (ValueError, NotImplementedError) as exc:  # refused in the first step, before the update
        return rejected(exc)
    _engine_steps(model, opt, sched, batches[1:], rank, world, cfg, first=1)
    model.finish_param_sync()
    got = mf.get_full_state_dict(model)
    return compare(got, reference(reference_base(cfg, init_seed(cfg, 0)), batches, cfg, world))


# -- Megatron-core's adapter in Megatron-LM's loop ------------------------------------------
def _without_megatron_parallel_state():
    """A pooled worker may hold Megatron-core's parallel state from another test;
    hiding it makes the whole world the data-parallel group."""
    return mock.patch.dict(sys.modules, {"megatron.core.parallel_state": None})


def mcore_loop_worker(rank, world, *, cfg):
    from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    batches = make_batches("net", STEPS, batch=2 * world * cfg["microbatches"])
    with _without_megatron_parallel_state():
        module = build(cfg["model"], torch.float32, init_seed(cfg, rank))
        freeze_parts(module, cfg["frozen_parts"])
        config = types.SimpleNamespace(calculate_per_token_loss=False, init_model_with_meta_device=False)
        try:
            ddp_config = mf.DistributedDataParallelConfig(
                data_parallel_sharding_strategy=cfg["strategy"], overlap_grad_reduce=cfg["overlap_grad_reduce"],
                overlap_param_gather=cfg["overlap_param_gather"])
            fsdp = FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=UNITS[cfg["units"]])
        except (ValueError, NotImplementedError) as exc:
            return rejected(exc)
    fsdp.broadcast_params()  # Megatron-LM's --data-parallel-random-init habit
    add_hooks(dict(fsdp.named_parameters()), cfg["hooks"])
    opt = optimizer_factory(cfg["optimizer"])(fsdp.parameters())
    for x, y in batches:
        fsdp.zero_grad_buffer()
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(cfg["microbatches"]), y.chunk(world)[rank].chunk(cfg["microbatches"])
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with fsdp.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
                (loss_fn("net", fsdp(xm), ym) / len(xs)).backward()
        fsdp.finish_grad_sync()
        opt.step()
        fsdp.install_optimized_model_weights()
    fsdp.finish_param_sync()
    got = mf.get_full_state_dict(fsdp.module)
    return compare(got, reference(reference_base(cfg, init_seed(cfg, 0)), batches, cfg, world))


# -- the experimental per-module API, as FSDP2 is used -------------------------------------
def _placements(cfg: dict):
    from megatron_fsdp.experimental import Placements

    if cfg["hybrid"]:
        optimizer = Shard(0) if cfg["outer"] == "optim" else Replicate()
        return Placements(dp_axes=[0, 1], parameter=[Replicate(), Shard(0)], gradient=[Partial("avg"), Shard(0)],
                          optimizer=[optimizer, Shard(0)])
    kind = {0: "no_shard", 1: "zero1", 2: "zero2"}.get(cfg["strategy"], "zero3")
    parameter = Shard(0) if kind == "zero3" else Replicate()
    gradient = Shard(0) if kind in ("zero2", "zero3") else Partial("avg")
    optimizer = Replicate() if kind == "no_shard" else Shard(0)
    return Placements(dp_axes=[0], parameter=[parameter], gradient=[gradient], optimizer=[optimizer])


def _experimental_model(cfg: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Net(recompute=cfg["recompute"]).to(DTYPES[cfg["compute"]])
    freeze_parts(model, cfg["frozen_parts"])
    return model


def experimental_worker(rank, world, *, cfg):
    from megatron_fsdp.experimental import (
        full_state_dict, fully_shard, fully_shard_context, fully_shard_optimizer, microbatch)

    batches = make_batches("net", STEPS, batch=2 * world * cfg["microbatches"])
    model = _experimental_model(cfg, init_seed(cfg, rank))
    hybrid = cfg["hybrid"]
    mesh = (init_device_mesh("cpu", (cfg["outer_size"], world // cfg["outer_size"]), mesh_dim_names=("outer", "inner"))
            if hybrid else init_device_mesh("cpu", (world,)))
    placements = _placements(cfg)
    try:
        with fully_shard_context() as context:
            for block in model.blocks:
                fully_shard(block, mesh=mesh, placements=placements)
            fully_shard(model, mesh=mesh, placements=placements)
    except (ValueError, NotImplementedError) as exc:
        return rejected(exc)
    add_hooks(dict(model.named_parameters()), cfg["hooks"])
    opt = optimizer_factory(cfg["optimizer"])([p for p in model.parameters() if p.requires_grad])
    fully_shard_optimizer(opt)
    dtype = DTYPES[cfg["compute"]]
    for x, y in batches:
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(cfg["microbatches"]), y.chunk(world)[rank].chunk(cfg["microbatches"])
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with microbatch(context, is_last=i == len(xs) - 1):
                (loss_fn("net", model(xm.to(dtype)), ym.to(dtype)) / len(xs)).backward()
        opt.step()
    got = full_state_dict(model)
    return compare(got, reference(_experimental_model(cfg, init_seed(cfg, 0)), batches, cfg, world))


WORKERS = {"engine": engine_worker, "mcore_loop": mcore_loop_worker, "experimental": experimental_worker}
