"""megatron_fsdp.experimental (upstream's per-module fully_shard on DBuffers):
training parity with single-process training and with PyTorch FSDP2, collective
counts, prefetch, nested ownership, recomputation, mixed precision,
HSDP / ZeRO-1/2 placements, memory, checkpoints and errors. Every distributed
test runs at world sizes 2 and 4 (gloo, shared pool)."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from megatron_fsdp import MixedPrecisionPolicy, record_collectives
from megatron_fsdp.experimental import (
    FsdpModule,
    Placements,
    full_state_dict,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    load_checkpoint,
    microbatch,
    save_checkpoint,
)
from dist_pool import RemoteError
from models import (
    Block, Net, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference, train_steps,
)

TOL = 1e-5


def placements_for(name: str) -> Placements:
    match name:
        case "zero3":
            return Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
        case "zero2":
            return Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Shard(0)], optimizer=[Shard(0)])
        case "zero1":
            return Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial("avg")], optimizer=[Shard(0)])
        case "no_shard":
            return Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial("avg")], optimizer=[Replicate()])
        case "hsdp":
            return Placements(
                dp_axes=[0, 1],
                parameter=[Replicate(), Shard(0)],
                gradient=[Partial("avg"), Shard(0)],
                optimizer=[Replicate(), Shard(0)],
            )
        case "hfsdp":
            # HSDP whose optimizer state is sharded over the outer axis too.
            return Placements(
                dp_axes=[0, 1],
                parameter=[Replicate(), Shard(0)],
                gradient=[Partial("avg"), Shard(0)],
                optimizer=[Shard(0), Shard(0)],
            )
    raise ValueError(name)


def make_mesh(world: int, name: str):
    if name in ("hsdp", "hfsdp"):
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
    return init_device_mesh("cpu", (world,))


class ReentrantNet(Net):
    """Net with reentrant activation checkpointing of every block."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.out(h)


def shard_net(model: nn.Module, mesh, placements: Placements, policy=None):
    """Blocks first, then the root (which keeps inp/out): a torchtitan-style bottom-up pass."""
    with fully_shard_context() as context:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, placements=placements, mixed_precision_policy=policy)
        # FSDP2's habit (model = fully_shard(model)) works: the same module comes back.
        returned = fully_shard(model, mesh=mesh, placements=placements, mixed_precision_policy=policy)
        if returned is not model or not isinstance(returned, FsdpModule):
            raise AssertionError(f"fully_shard returned {returned!r}, not the sharded module")
    return context


def train_sharded(model, context, batches, optimizer, rank, world, microbatches=1, dtype=None):
    opt = make_optimizer(optimizer)(model.parameters())
    fully_shard_optimizer(opt)
    for x, y in batches:
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(microbatches), y.chunk(world)[rank].chunk(microbatches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if dtype is not None:
                xm, ym = xm.to(dtype), ym.to(dtype)
            with microbatch(context, is_last=i == len(xs) - 1):
                (loss_fn("net", model(xm), ym) / len(xs)).backward()
        opt.step()
    return opt


# -- workers (run on every rank of the pool) -----------------------------------------------
def parity_worker(rank, world, *, strategy, optimizer="adamw", microbatches=1, steps=3, recompute=None):
    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", steps, batch=4 * world * microbatches)
    reference = train_reference(model, "net", batches, optimizer)
    if recompute == "reentrant":
        model.__class__ = ReentrantNet
    model.recompute = recompute == "non_reentrant"
    context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    train_sharded(model, context, batches, optimizer, rank, world, microbatches)
    resting = all(m.phase is FsdpModule.Phase.RESTING for m in context.forward_order)
    all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
    released = all(
        g._unsharded_model_weight.local_buffer.untyped_storage().nbytes() == 0
        for m in context.forward_order
        for g in m.parameter_groups
        if not g._replicated
    )
    return {
        "diff": max_param_diff(full_state_dict(model), reference),
        "resting": resting,
        "all_dtensor": all_dtensor,
        "released": released,
    }


def fsdp2_worker(rank, world, *, steps=3):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", steps, batch=4 * world)
    reference = train_reference(model, "net", batches, "adamw")
    fsdp2_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp2_model.blocks:
        fsdp2_fully_shard(block, mesh=mesh)
    fsdp2_fully_shard(fsdp2_model, mesh=mesh)
    opt = make_optimizer("adamw")(fsdp2_model.parameters())
    train_steps(fsdp2_model, opt, batches, rank, world)
    fsdp2_full = {n: p.full_tensor() for n, p in fsdp2_model.named_parameters()}
    context = shard_net(model, mesh, placements_for("zero3"))
    train_sharded(model, context, batches, "adamw", rank, world)
    ours = full_state_dict(model)
    return {
        "ours_vs_fsdp2": max((ours[n] - fsdp2_full[n]).abs().max().item() for n in fsdp2_full),
        "ours_vs_reference": max_param_diff(ours, reference),
        "fsdp2_vs_reference": max_param_diff(fsdp2_full, reference),
        "same_sharded_names": sorted(n for n, _ in model.named_parameters()) == sorted(fsdp2_full),
    }


def counts_worker(rank, world):
    model = make_model("net", d=8, depth=3)
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    order = []
    for m in context.forward_order:
        # Registered after fully_shard's own pre-hook: runs when the module starts computing.
        m.register_forward_pre_hook(
            lambda mod, _a: order.append(("compute", mod.name, [n.name for n in context.forward_order if n._in_flight])) and None
        )
    per_step = []
    for _ in range(2):
        opt.zero_grad()
        with record_collectives() as rec:
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        per_step.append({"counts": dict(rec.counts), "labels": list(rec.labels)})
    return {"steps": per_step, "order": order[:4], "modules": [m.name for m in context.forward_order]}


def nested_worker(rank, world):
    model = make_model("tied", d=8, depth=2)
    mesh = make_mesh(world, "zero3")
    with fully_shard_context() as context:
        fully_shard(model.blocks[0], mesh=mesh, placements=placements_for("zero3"))
        fully_shard(model, mesh=mesh, placements=placements_for("zero3"))
    root_fqns = [p.fqns for g in model.parameter_groups for p in g.fsdp_parameters]
    child_fqns = [p.fqns for g in model.blocks[0].parameter_groups for p in g.fsdp_parameters]
    return {
        "root": root_fqns,
        "child": child_fqns,
        "roots": [m.name for m in context.forward_order if m.is_root()],
        "backward": [m.name for m in context.backward_order],
        "n_params": len(list(model.parameters())),
    }


def mixed_precision_worker(rank, world, *, steps=3):
    """bf16 model, fp32 main weights, bf16 main gradients, against a single-process
    emulation of the same recipe: fp32 master weights, a bf16 copy for the
    forward/backward on the global batch, gradients cast to fp32 for AdamW."""
    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", steps, batch=4 * world)
    master = copy.deepcopy(model)
    master_opt = make_optimizer("adamw")(master.parameters())
    model = model.to(torch.bfloat16)
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"), MixedPrecisionPolicy())
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, _a: seen.update(compute=m.fc1.weight.dtype))
    loss_gaps = []
    for x, y in batches:
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        compute = copy.deepcopy(master).to(torch.bfloat16)
        loss_fn("net", compute(x).float(), y.float()).backward()
        with torch.no_grad():
            reference_local = loss_fn("net", compute(x.chunk(world)[rank]).float(), y.chunk(world)[rank].float())
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.float()
        master_opt.step()
        opt.zero_grad()
        loss = loss_fn("net", model(x.chunk(world)[rank]).float(), y.chunk(world)[rank].float())
        loss.backward()
        grad_dtype = model.blocks[0].fc1.weight.grad.dtype
        opt.step()
        loss_gaps.append(abs(loss.item() - reference_local.item()))
    group = model.blocks[0].parameter_groups[0]
    state = opt.state[model.blocks[0].fc1.weight]
    return {
        "param_dtype": model.blocks[0].fc1.weight.dtype,
        "grad_dtype": grad_dtype,
        "compute_dtype": seen["compute"],
        "main_grad_dtype": group.main_grad.dtype,
        "model_weight_dtype": group.model_weight.dtype,
        "state_dtype": state["exp_avg"].dtype,
        "weight_gap": max_param_diff(full_state_dict(model), master),
        "loss_gap": max(loss_gaps),
    }


class MLPBlock(nn.Module):
    """Transformer-like sizes (rows of 64 and 256): little row-alignment padding."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MLPNet(nn.Module):
    def __init__(self, d: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(depth))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def memory_worker(rank, world):
    torch.manual_seed(0)
    model = MLPNet()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    context.accounting.reset_peak()
    for _ in range(2):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    acc = context.accounting
    return {
        "full_bytes": full_bytes,
        "persistent": acc.total_persistent,
        "peak_temporary": acc.peak_temporary,
        "temporary_now": acc.temporary,
        "largest_module": max(
            sum(p.sharded.numel() * 4 for g in m.parameter_groups for p in g.fsdp_parameters) for m in context.forward_order
        ),
    }


def checkpoint_worker(rank, world, *, directory):
    batches = make_batches("net", 4, batch=4 * world)

    def build():
        model = make_model("net", d=8, depth=3)
        context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
        return model, context

    model, context = build()
    opt = train_sharded(model, context, batches[:2], "adamw", rank, world)
    save_checkpoint(model, opt, directory)
    for x, y in batches[2:]:
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    expected = full_state_dict(model)
    torch.manual_seed(99)
    model2, context2 = build()
    opt2 = make_optimizer("adamw")(model2.parameters())
    fully_shard_optimizer(opt2)
    load_checkpoint(model2, opt2, directory)
    for x, y in batches[2:]:
        opt2.zero_grad()
        loss_fn("net", model2(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt2.step()
    got = full_state_dict(model2)
    return max((expected[n] - got[n]).abs().max().item() for n in expected)


GLOBAL_BATCH = 16  # divisible by 2 and 4: the same batches at either world size


def save_at_world_worker(rank, world, *, directory, steps):
    batches = make_batches("net", 4, batch=GLOBAL_BATCH)
    model = make_model("net", d=8, depth=3)
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
    opt = train_sharded(model, context, batches[:steps], "adamw", rank, world)
    save_checkpoint(model, opt, directory)


def load_at_world_worker(rank, world, *, directory, steps, strategy):
    batches = make_batches("net", 4, batch=GLOBAL_BATCH)
    reference = train_reference(make_model("net", d=8, depth=3), "net", batches, "adamw")
    torch.manual_seed(5)  # different initial weights: everything must come from the checkpoint
    model = make_model("net", d=8, depth=3, seed=5)
    context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    load_checkpoint(model, opt, directory)
    for x, y in batches[steps:]:
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return max_param_diff(full_state_dict(model), reference)


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_checkpoint_reshards_across_world_sizes(pool2, pool4, strategy):
    """Saved by 2 ranks, resumed by 4 (and by 2 with other placements): training
    continues exactly as uninterrupted single-process training."""
    with tempfile.TemporaryDirectory() as directory:
        pool2.run(save_at_world_worker, directory=directory, steps=2)
        for pool in (pool4, pool2):
            for diff in pool.run(load_at_world_worker, directory=directory, steps=2, strategy=strategy):
                assert diff < TOL, (pool.world, strategy, diff)


def unused_parameter_worker(rank, world):
    model = make_model("net", d=8, depth=3)
    model.blocks[0].unused = nn.Linear(3, 3)  # never called in forward
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
    x, y = make_batches("net", 1, batch=4 * world)[0]
    try:
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    except RuntimeError as e:
        return {"error": str(e), "resting": all(m.phase is FsdpModule.Phase.RESTING for m in context.forward_order)}
    return {"error": None}


def test_unused_parameter_is_a_clear_error(pool):
    for result in pool.run(unused_parameter_worker):
        assert result["error"] and "blocks.0" in result["error"] and "unused" in result["error"], result


def stale_weights_worker(rank, world, *, foreach, strategy="zero3"):
    """bf16 compute weights must follow the fp32 main weights even when the
    optimizer was not wrapped by fully_shard_optimizer (which registers no global
    optimizer hook: the in-place step moves the main weights' version counters)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    model = make_model("net", d=8, depth=3).to(torch.bfloat16)
    shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=foreach)  # no fully_shard_optimizer
    assert not any("megatron_fsdp" in getattr(h, "__module__", "") for h in _global_optimizer_post_hooks.values())
    x, y = (t.to(torch.bfloat16) for t in make_batches("net", 1, batch=4 * world)[0])
    loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    eager = make_model("net", d=8, depth=3)
    eager.load_state_dict(full_state_dict(model))
    with torch.no_grad():
        expected = eager.to(torch.bfloat16)(x)
        got = model(x)
    return (got.float() - expected.float()).abs().max().item()


# torch 2.11's foreach kernels refuse a gradient whose dtype differs from its parameter's
# (bf16 main gradients on fp32 main weights, torch's ``grad_dtype``); 2.13's accept it.
# fully_shard_optimizer casts the gradients for the step on every torch.
_FOREACH_TAKES_GRAD_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.parametrize("strategy", ["zero3", "no_shard"])
@pytest.mark.parametrize("foreach", [False, True])
def test_compute_weights_follow_main_weights_without_optimizer_hooks(pool, foreach, strategy):
    if foreach and not _FOREACH_TAKES_GRAD_DTYPE:
        with pytest.raises(RemoteError, match="must be on the same device and the same dtype"):
            pool.run(stale_weights_worker, foreach=foreach, strategy=strategy)
        return
    diffs = pool.run(stale_weights_worker, foreach=foreach, strategy=strategy)
    assert all(diff == 0.0 for diff in diffs), diffs


def errors_worker(rank, world):
    mesh = make_mesh(world, "zero3")
    zero3 = placements_for("zero3")
    raised = {}

    def expect(name, fn, exc):
        try:
            fn()
        except exc as e:
            raised[name] = str(e)

    def outside_context():
        # A module sharded outside any context (upstream 0.6.1's usage) cannot join a parent
        # sharded inside one: the two contexts' prefetch orders cannot span one model.
        parent = nn.Sequential(nn.Linear(2, 2))
        fully_shard(parent[0], mesh=mesh, placements=zero3)
        with fully_shard_context():
            fully_shard(parent, mesh=mesh, placements=zero3)

    expect("outside_context", outside_context, ValueError)

    def twice():
        layer = nn.Linear(2, 2)
        with fully_shard_context():
            fully_shard(layer, mesh=mesh, placements=zero3)
            fully_shard(layer, mesh=mesh, placements=zero3)

    expect("twice", twice, ValueError)

    def shard_dim1():
        with fully_shard_context():
            fully_shard(nn.Linear(2, 2), mesh=mesh, placements=Placements(
                dp_axes=[0], parameter=[Shard(1)], gradient=[Shard(0)], optimizer=[Shard(0)]))

    expect("shard_dim1", shard_dim1, NotImplementedError)
    expect("lengths", lambda: Placements(dp_axes=[0], parameter=[], gradient=[Shard(0)], optimizer=[Shard(0)]),
           ValueError)

    def symmetric():
        with fully_shard_context(use_symmetric_memory=True):
            pass

    expect("symmetric", symmetric, NotImplementedError)

    def placement_list():  # FSDP2's habit: a list of placements
        with fully_shard_context():
            fully_shard(nn.Linear(2, 2), mesh=mesh, placements=[Shard(0)])

    expect("placement_list", placement_list, TypeError)

    def run_inside():
        layer = nn.Linear(2, 2)
        with fully_shard_context():
            fully_shard(layer, mesh=mesh, placements=zero3)
            layer(torch.ones(1, 2))

    expect("run_inside", run_inside, RuntimeError)

    def tied_across():
        model = make_model("tied", d=4, depth=1)
        with fully_shard_context():
            fully_shard(model.embed, mesh=mesh, placements=zero3)
            fully_shard(model.head, mesh=mesh, placements=zero3)

    expect("tied_across", tied_across, ValueError)
    layer = nn.Linear(2, 2)
    before = type(layer)
    try:
        with fully_shard_context():
            fully_shard(layer, mesh=mesh, placements=Placements(
                dp_axes=[0], parameter=[Shard(2)], gradient=[Shard(0)], optimizer=[Shard(0)]))
    except NotImplementedError:
        pass
    raised["class_restored"] = type(layer) is before
    return raised


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "no_shard"])
def test_training_equals_single_process(pool, strategy):
    for result in pool.run(parity_worker, strategy=strategy):
        assert result["diff"] < TOL, result
        assert result["resting"] and result["all_dtensor"] and result["released"], result


@pytest.mark.parametrize("optimizer", ["sgd_momentum"])
def test_training_equals_single_process_sgd(pool, optimizer):
    for result in pool.run(parity_worker, strategy="zero3", optimizer=optimizer):
        assert result["diff"] < TOL, result


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_gradient_accumulation_with_microbatches(pool, strategy):
    for result in pool.run(parity_worker, strategy=strategy, microbatches=3):
        assert result["diff"] < TOL, result


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_hsdp_equals_single_process(pool, strategy, microbatches):
    # A 2 x (world / 2) mesh, outer replicate x inner shard; at world 2 the inner axis
    # is trivial and the outer all-reduce is still deferred to the last microbatch.
    # HFSDP also shards the optimizer state (main weights, Adam moments) over the outer axis.
    for result in pool.run(parity_worker, strategy=strategy, microbatches=microbatches):
        assert result["diff"] < TOL, result


@pytest.mark.parametrize("recompute", ["non_reentrant", "reentrant"])
def test_activation_recomputation(pool, recompute):
    for result in pool.run(parity_worker, strategy="zero3", recompute=recompute):
        assert result["diff"] < TOL, result
        assert result["resting"] and result["all_dtensor"] and result["released"], result


def test_equals_fsdp2_fully_shard(pool):
    for result in pool.run(fsdp2_worker):
        assert result["same_sharded_names"]
        assert result["ours_vs_fsdp2"] < TOL, result
        assert result["ours_vs_reference"] < TOL and result["fsdp2_vs_reference"] < TOL, result


def test_collective_counts_and_prefetch(pool):
    for result in pool.run(counts_worker):
        modules = result["modules"]
        assert modules == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        for step in result["steps"]:
            # One all-gather per module in forward and one in backward, one reduce-scatter each.
            assert step["counts"] == {"all_gather": 2 * len(modules), "reduce_scatter": len(modules)}, step
            gathers = [label for kind, label in step["labels"] if kind == "all_gather"]
            assert sorted(gathers) == sorted(f"{m}:float32" for m in modules * 2)
            assert gathers[:4] == [f"{m}:float32" for m in modules], gathers  # forward order
            reduces = [label for kind, label in step["labels"] if kind == "reduce_scatter"]
            assert reduces == [f"{m}:float32" for m in reversed(modules)], reduces
        # When a module starts computing, the next module's gather is already in flight.
        for (_, name, in_flight), following in zip(result["order"], modules[1:]):
            assert following in in_flight, (name, in_flight)


def test_nested_ownership(pool):
    for result in pool.run(nested_worker):
        assert result["child"] == [("norm.weight",), ("norm.bias",), ("fc1.weight",), ("fc1.bias",),
                                   ("fc2.weight",), ("fc2.bias",)]
        # The tied embedding/head weight is one physical parameter with two names.
        assert ("embed.weight", "head.weight") in result["root"]
        assert not any(fqns[0].startswith("blocks.0.") for fqns in result["root"])
        assert result["roots"] == ["<root>"]
        assert result["backward"] == ["<root>", "blocks.0"]


def test_mixed_precision_fp32_main_weights_bf16_grads(pool):
    for result in pool.run(mixed_precision_worker):
        assert result["param_dtype"] == torch.float32  # the optimizer steps fp32 main weights
        assert result["grad_dtype"] == torch.bfloat16 and result["main_grad_dtype"] == torch.bfloat16
        assert result["compute_dtype"] == torch.bfloat16 and result["model_weight_dtype"] == torch.bfloat16
        assert result["state_dtype"] == torch.float32
        # bf16 compute and bf16 gradient averaging: equal at bf16 resolution
        # (bf16 spacing near 1 is 7.8e-3; the weights here are O(0.3)).
        assert result["loss_gap"] < 1e-2, result
        assert result["weight_gap"] < 1e-2, result


def test_peak_memory_below_unsharded_model(pool):
    for result in pool.run(memory_worker):
        unsharded = 2 * result["full_bytes"]  # weights + gradients of the unsharded model
        assert result["persistent"] + result["peak_temporary"] < unsharded, result
        assert result["peak_temporary"] < result["full_bytes"], result
        assert result["temporary_now"] == 0, result


def test_checkpoint_round_trip(pool):
    with tempfile.TemporaryDirectory() as directory:
        for diff in pool.run(checkpoint_worker, directory=directory):
            assert diff == 0.0


def test_errors_name_the_problem(pool2):
    raised = pool2.run(errors_worker)[0]
    assert set(raised) == {"outside_context", "twice", "shard_dim1", "lengths", "symmetric", "run_inside",
                           "tied_across", "class_restored", "placement_list"}, raised
    assert "Placements(dp_axes=[0]" in raised["placement_list"]
    assert "fully_shard_context" in raised["outside_context"]
    assert "Shard(0)" in raised["shard_dim1"]
    assert "common ancestor" in raised["tied_across"]
    assert raised["class_restored"] is True


# -- the README's Llama example (scripts/llama_experimental.py) -------------------------------
def llama_worker(rank, world, *, steps=6):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import llama_experimental as ex

    from megatron_fsdp.training import data

    cfg = ex.LlamaConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=96, seq_length=16)
    with torch.device("meta"):
        model = ex.Llama(cfg)
    mesh = init_device_mesh("cpu", (world,))
    context = ex.parallelize_llama(model, mesh)
    ex.init_weights(model, seed=3)
    reference = ex.Llama(cfg)
    reference.load_state_dict(full_state_dict(model))
    tokens = data.load_corpus_tokens(None)
    windows, _, _ = data.split_windows(tokens.numel(), cfg.seq_length, [98.0, 2.0, 0.0])
    source = data.TextDataset(tokens, windows, cfg.seq_length, 3)
    # AdamW's eps=1e-4: the house rule for AdamW parity (a tiny eps turns reduction-order
    # rounding in near-zero gradients into large update differences).
    kwargs = dict(steps=steps, micro_batch_size=2, lr=3e-3, device=torch.device("cpu"), adam_eps=1e-4)
    losses = ex.train(model, context, source, microbatches=2, rank=rank, world=world, **kwargs)
    # Single process, same global batches (all ranks' micro batches), no sharding.
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, eps=1e-4, weight_decay=0.1)
    layout = data.BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=0, dp_size=world)
    reference_losses = []
    for step in range(steps):
        opt.zero_grad()
        inputs, targets = zip(*(
            data.get_microbatch(source, dataclasses_replace(layout, dp_rank=r), step * layout.global_batch_size, m,
                                torch.device("cpu"))
            for m in range(2) for r in range(world)
        ))
        logits = reference(torch.cat(inputs))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.cat(targets).flatten())
        loss.backward()
        opt.step()
        reference_losses.append(loss.item())
    return {"losses": losses, "reference": reference_losses, "diff": max_param_diff(full_state_dict(model), reference)}


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_llama_example_trains_like_single_process(pool):
    for result in pool.run(llama_worker):
        losses, reference = result["losses"], result["reference"]
        assert losses[-1] < losses[0] - 0.2, losses
        # Same weights after meta init and sharding, same data: the loss curves and
        # the trained weights agree.
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, (losses, reference)
        assert result["diff"] < 1e-5, result["diff"]


# -- expert parallelism ----------------------------------------------------------------------
class _GatherTokens(torch.autograd.Function):
    """All-gather the tokens of the expert-parallel group; backward sums each
    token's gradient over the experts that saw it."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.n)[ctx.rank], None


class _CombineExperts(torch.autograd.Function):
    """Sum every expert's output for this rank's tokens; backward hands each expert
    the gradients of all the group's tokens."""

    @staticmethod
    def forward(ctx, y, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), dist.get_world_size(group)
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y.chunk(ctx.n)[ctx.rank].clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        parts = [torch.empty_like(grad) for _ in range(ctx.n)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class MoENet(nn.Module):
    """Dense input/output layers around ``n_experts`` expert blocks whose outputs are
    summed (every token visits every expert: routing is not what is tested here)."""

    def __init__(self, d: int = 8, n_experts: int = 2, ep_group=None, expert_index=None) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.experts = nn.ModuleList(Block(d) for _ in range(n_experts))
        self.out = nn.Linear(d, 3)
        self.ep_group, self.expert_index = ep_group, expert_index

    def forward(self, x):
        h = self.inp(x)
        if self.ep_group is None:  # single process: all experts here
            return self.out(sum(expert(h) - h for expert in self.experts))
        tokens = _GatherTokens.apply(h, self.ep_group)
        mine = self.experts[self.expert_index]
        return self.out(_CombineExperts.apply(mine(tokens) - tokens, self.ep_group))


def expert_parallel_worker(rank, world, *, steps=3):
    ep = 2
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    dense_mesh = init_device_mesh("cpu", (world,))
    ep_rank = mesh.get_local_rank("ep")
    torch.manual_seed(0)
    model = MoENet(n_experts=ep)
    batches = make_batches("net", steps, batch=4 * world)
    reference = train_reference(model, "net", batches, "adamw")
    model.ep_group, model.expert_index = mesh.get_group("ep"), ep_rank
    # This rank keeps only its own expert; the others are dropped before sharding.
    for index in range(ep):
        if index != ep_rank:
            model.experts[index] = nn.Identity()
    zero3 = placements_for("zero3")
    with fully_shard_context() as context:
        # Expert weights: sharded over the expert-data-parallel ranks; their gradient
        # already sums over the ep ranks' tokens, hence grad_divisor=ep.
        fully_shard(model.experts[ep_rank], mesh=mesh["edp"], placements=zero3, grad_divisor=ep)
        fully_shard(model, mesh=dense_mesh, placements=zero3)
    train_sharded(model, context, batches, "adamw", rank, world)
    full = full_state_dict(model)
    # Expert e of the reference is this rank's expert: the same index on both sides.
    reference_state = dict(reference.named_parameters())
    diff = max((value - reference_state[name]).abs().max().item() for name, value in full.items())
    return {"diff": diff, "expert_names": sorted(n for n in full if n.startswith("experts."))}


def test_expert_parallel_mesh(pool):
    results = pool.run(expert_parallel_worker)
    for rank, result in enumerate(results):
        assert result["diff"] < TOL, result
    assert {tuple(r["expert_names"]) for r in results} == {
        tuple(f"experts.{e}.{p}" for p in ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.bias", "norm.weight"))
        for e in range(2)
    }
