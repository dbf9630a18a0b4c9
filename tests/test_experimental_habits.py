"""DDP/FSDP2 habits on megatron_fsdp.experimental: gradients written into after
``zero_grad(set_to_none=False)``, units returning structured outputs; each equal to
single-process training or refused before any weight changes."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_fsdp.experimental import (
    full_state_dict, fully_shard, fully_shard_context, fully_shard_optimizer, microbatch,
)
from models import (
    add_decay_into_grads, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, structured_case,
)
from test_experimental import make_mesh, placements_for, shard_net


def grads_written_worker(rank, world, *, strategy, steps=4):
    """zero_grad(set_to_none=False) keeps the sharded gradients bound; a decay term
    written into them before backward is accumulated on, as in plain PyTorch."""
    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", steps, batch=4 * world)
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer("sgd")(reference.parameters())
    context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    opt = make_optimizer("sgd")(model.parameters())
    fully_shard_optimizer(opt)

    for x, y in batches:
        ref_opt.zero_grad(set_to_none=False)
        add_decay_into_grads(reference)
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad(set_to_none=False)
        add_decay_into_grads(model)
        with microbatch(context, is_last=True):
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return max_param_diff(full_state_dict(model), reference)


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "no_shard"])
def test_grads_written_after_zero_grad_are_accumulated_on(pool2, strategy):
    """A write after zero_grad is kept under every placement: ZeRO-1 must not drop the
    finalised gradient when accumulation goes back to Partial (0.003 off if it does)."""
    for diff in pool2.run(grads_written_worker, strategy=strategy):
        assert diff < 1e-5, diff


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_hybrid_grads_written_after_zero_grad_are_accumulated_on(pool4, strategy):
    for diff in pool4.run(grads_written_worker, strategy=strategy):
        assert diff < 1e-5, diff


def structured_output_worker(rank, world, *, kind):
    """Units returning dicts, namedtuples, dataclasses (backward_outputs.py), or an object
    hiding its tensors (refused in forward)."""
    model, inputs, reference = structured_case(kind, world)  # the same initial weights everywhere, as FSDP2 expects
    mesh, placements = make_mesh(world, "zero3"), placements_for("zero3")
    with fully_shard_context() as context:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, placements=placements)
        fully_shard(model, mesh=mesh, placements=placements)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard_optimizer(opt)
    try:
        for x in inputs:
            opt.zero_grad()
            with microbatch(context, is_last=True):
                model(x.chunk(world)[rank]).backward()
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    return max_param_diff(full_state_dict(model), reference)


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass", "opaque"])
def test_unit_outputs_in_containers(pool2, kind):
    for result in pool2.run(structured_output_worker, kind=kind):
        if kind == "opaque":
            assert "StructuredBlock returned an object of type Opaque holding tensors" in str(result), result
        else:
            assert result < 1e-5, result


def requires_gradient_sync_worker(rank, world, *, strategy, steps=3):
    """FSDP2's ``model.set_requires_gradient_sync`` on the root: the first of two
    microbatches unsynced (Partial gradients rest where they can), the second synced;
    on a block it is refused, naming the root and ``microbatch``."""
    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", steps, batch=4 * world * 2)
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer("adamw")(reference.parameters())
    context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    try:
        model.blocks[0].set_requires_gradient_sync(False)
        refusal = "no error"
    except NotImplementedError as exc:
        refusal = str(exc)
    for x, y in batches:
        ref_opt.zero_grad()
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            model.set_requires_gradient_sync(i == 1)
            (loss_fn("net", model(xm), ym) / 2).backward()
        opt.step()
    return max_param_diff(full_state_dict(model), reference), refusal


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "no_shard"])
def test_fsdp2_requires_gradient_sync(pool2, strategy):
    for diff, refusal in pool2.run(requires_gradient_sync_worker, strategy=strategy):
        assert diff < 1e-5, diff
        assert "root module" in refusal and "microbatch" in refusal, refusal


def added_parameter_worker(rank, world, *, strategy):
    """A parameter assigned, or a parameter-holding module attached, after sharding is
    refused (the groups used to write their own parameters back over it: a silently
    ignored re-initialisation); nothing changes."""
    model = make_model("net", d=8, depth=3)
    shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    before = full_state_dict(model)
    messages = []
    for attach in (lambda: setattr(model.out, "weight", torch.nn.Parameter(torch.zeros(3, 8))),
                   lambda: setattr(model, "out", torch.nn.Linear(8, 3))):
        try:
            attach()
            messages.append("no error")
        except TypeError as exc:
            messages.append(str(exc))
    after = full_state_dict(model)
    return messages, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("strategy", ["zero3", "zero1", "no_shard"])
def test_parameters_added_after_sharding_are_refused(pool2, strategy):
    for messages, unchanged in pool2.run(added_parameter_worker, strategy=strategy):
        assert all("Nothing was assigned" in m and "before wrapping" in m for m in messages), messages
        assert unchanged


def sharded_habit_worker(rank, world, *, strategy, habit):
    """The main engine's habits on the experimental one: backward(inputs=params) (it
    trained nothing, silently) and param.data = value (ignored, silently) are refused
    before anything changes, and so is a create_graph backward (the unused-parameter
    message misled there); clip_grad_norm_ with the inf norm (torch's "empty tensor"
    error on ranks holding no rows) trains as one process."""
    model = make_model("net", d=8, depth=3)
    batches = make_batches("net", 3, batch=4 * world)
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer("adamw")(reference.parameters())
    context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    opt = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(opt)
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    x, y = batches[0]
    try:
        if habit == "backward_inputs":
            with microbatch(context, is_last=True):
                loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward(
                    inputs=list(model.blocks[0].parameters()))
        elif habit == "penalty":  # higher-order gradients: the main engine's, not this one's
            inputs = x.chunk(world)[rank].clone().requires_grad_(True)
            with microbatch(context, is_last=True):
                out = model(inputs)
                torch.autograd.grad(out.sum(), inputs, create_graph=True)
        elif habit == "data":
            weight = model.blocks[0].fc1.weight
            weight.data = torch.full(tuple(weight.shape), 0.01)
            with microbatch(context, is_last=True):
                loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        else:
            for xb, yb in batches:
                for m, o, xs, ys in ((reference, ref_opt, xb, yb),
                                     (model, opt, xb.chunk(world)[rank], yb.chunk(world)[rank])):
                    o.zero_grad()
                    if m is model:
                        with microbatch(context, is_last=True):
                            loss_fn("net", m(xs), ys).backward()
                    else:
                        loss_fn("net", m(xs), ys).backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=float("inf"))
                    o.step()
            return "trained", max_param_diff(full_state_dict(model), reference)
    except RuntimeError as exc:
        after = full_state_dict(model)
        return str(exc), all(torch.equal(before[k], after[k]) for k in before)
    return "no error", None


@pytest.mark.parametrize("habit", ["backward_inputs", "data", "clip_inf", "penalty"])
@pytest.mark.parametrize("strategy", ["zero3", "zero1", "no_shard"])
def test_sharded_parameter_habits(pool2, strategy, habit):
    for message, value in pool2.run(sharded_habit_worker, strategy=strategy, habit=habit):
        if habit == "clip_inf":
            assert message == "trained" and value < 1e-5, (message, value)
        else:
            expected = {"backward_inputs": "gathered copies", "data": ".data was assigned after wrapping",
                        "penalty": "create_graph=True"}[habit]
            assert expected in message and value is True, (message, value)
