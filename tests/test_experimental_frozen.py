"""[Note: frozen groups in trained modules] The experimental per-module API with
partly frozen modules: a frozen LayerNorm inside a trained block needs its full
weight in backward after the block's trained weights have their gradients, so such
a module keeps its frozen groups whole until the gradients of its inputs exist.

Each run trains ``Net(d=8)`` sharded blocks-then-root and must equal one process
with the same parameters frozen (SGD over the trainable parameters only); the last
test checks that the frozen weights are still released during backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import conftest
from megatron_fsdp.experimental import (
    full_state_dict, fully_shard, fully_shard_context, fully_shard_optimizer, microbatch,
)
from models import Net, loss_fn, make_batches, max_param_diff
from test_experimental import make_mesh, placements_for

TOL = 1e-5
STEPS = 3
LR = 0.1
FREEZES = ["block1", "norms", "both"]


def freeze(model: nn.Module, which: str) -> None:
    """``block1``: blocks[1] entirely; ``norms``: the LayerNorms of blocks 0 and 2
    inside trained blocks; ``both``."""
    if which in ("block1", "both"):
        model.blocks[1].requires_grad_(False)
    if which in ("norms", "both"):
        model.blocks[0].norm.requires_grad_(False)
        model.blocks[2].norm.requires_grad_(False)


def shard_net(model: nn.Module, placement: str, world: int):
    """Blocks first, then the root (which keeps inp/out)."""
    mesh, placements = make_mesh(world, placement), placements_for(placement)
    with fully_shard_context() as context:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, placements=placements)
        fully_shard(model, mesh=mesh, placements=placements)
    return context


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def train_reference(model: nn.Module, batches) -> nn.Module:
    opt = sgd(model)
    for x, y in batches:
        opt.zero_grad()
        loss_fn("net", model(x), y).backward()
        opt.step()
    return model


def released(context) -> bool:
    """No module holds a full weight (replicated groups have none to free)."""
    return all(
        not m._held
        and all(g._unsharded_model_weight.local_buffer.untyped_storage().nbytes() == 0
                for g in m.parameter_groups if not g._replicated)
        for m in context.forward_order
    )


def frozen_worker(rank, world, *, placement, which, microbatches=1, recompute=False):
    batches = make_batches("net", STEPS, batch=4 * world * microbatches)
    torch.manual_seed(0)
    model = Net(d=8)
    freeze(model, which)
    reference = train_reference(copy.deepcopy(model), batches)
    model.recompute = recompute
    context = shard_net(model, placement, world)
    opt = sgd(model)
    fully_shard_optimizer(opt)
    released_after_backward = []
    for x, y in batches:
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(microbatches), y.chunk(world)[rank].chunk(microbatches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with microbatch(context, is_last=i == len(xs) - 1):
                (loss_fn("net", model(xm), ym) / len(xs)).backward()
            released_after_backward.append(released(context))
        opt.step()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {
        "diff": max_param_diff(full_state_dict(model), reference),
        "released": all(released_after_backward),
        "same_trainable": trainable == sorted(n for n, p in reference.named_parameters() if p.requires_grad),
    }


def _check(results) -> None:
    for result in results:
        assert result["diff"] < TOL, results
        assert result["released"] and result["same_trainable"], results


@pytest.mark.parametrize("which", FREEZES)
@pytest.mark.parametrize(
    "placement,world", [("zero3", 2), ("zero3", 3), ("zero2", 2), ("hsdp", 4)],
    ids=["zero3-world2", "zero3-world3", "zero2-world2", "hsdp-2x2"],
)
def test_partly_frozen_model_trains_like_single_process(placement, world, which):
    _check(conftest.get_pool(world).run(frozen_worker, placement=placement, which=which))


@pytest.mark.parametrize("placement,world", [("zero3", 2), ("hsdp", 4)], ids=["zero3-world2", "hsdp-2x2"])
def test_partly_frozen_with_microbatches(placement, world):
    _check(conftest.get_pool(world).run(frozen_worker, placement=placement, which="both", microbatches=2))


@pytest.mark.parametrize("world", [2, 3])
def test_partly_frozen_with_activation_checkpointing(world):
    """Non-reentrant checkpointing reruns each block's forward inside backward (the
    frozen norm's input hook is registered again by the rerun)."""
    _check(conftest.get_pool(world).run(frozen_worker, placement="zero3", which="both", recompute=True))


# -- the memory promise: held only until the inputs' gradients exist ----------------------------------
def lifetime_worker(rank, world):
    batches = make_batches("net", STEPS, batch=4 * world)
    torch.manual_seed(0)
    model = Net(d=8)
    freeze(model, "norms")
    context = shard_net(model, "zero3", world)
    opt = sgd(model)
    fully_shard_optimizer(opt)
    block0 = model.blocks[0]
    frozen = next(g for g in block0.parameter_groups if not g.requires_grad)

    def state():
        whole = frozen._unsharded_model_weight.local_buffer.untyped_storage().nbytes() > 0
        return whole, len(block0._held)

    seen: dict[str, list] = {"trained": [], "norm_output": [], "root_inp": []}
    # Tensor hooks on sharded parameters run on the local gradient, as it is computed.
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        block0.get_parameter(name).register_hook(lambda g: seen["trained"].append(state()) and None)
    model.inp.weight.register_hook(lambda g: seen["root_inp"].append(state()) and None)

    def watch_norm_output(_module, _inputs, output):
        # Runs just before the norm's backward, which needs its frozen weight.
        output.register_hook(lambda g: seen["norm_output"].append(state()) and None)

    block0.norm.register_forward_hook(watch_norm_output)
    after_backward = []
    for x, y in batches:
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        after_backward.append(released(context))
        opt.step()
    return {"seen": seen, "after_backward": after_backward, "frozen_fqns": [p.fqns for p in frozen.fsdp_parameters]}


def test_frozen_group_released_before_end_of_backward(pool2):
    for result in pool2.run(lifetime_worker):
        seen = result["seen"]
        assert result["frozen_fqns"] == [("norm.weight",), ("norm.bias",)], result
        assert len(seen["trained"]) == 4 * STEPS and len(seen["root_inp"]) == STEPS, seen
        # While blocks[0]'s trained weights get their gradients, its frozen norm is whole;
        assert all(whole for whole, _ in seen["trained"]), seen
        # their gradients complete the block's post_backward, which holds the frozen group
        # for the norm's backward (the gradient of the block's input) ...
        assert seen["norm_output"] == [(True, 1)] * STEPS, seen
        # ... and it is freed once that gradient exists, before backward reaches the root's inp.
        assert seen["root_inp"] == [(False, 0)] * STEPS, seen
        assert all(result["after_backward"]), result
