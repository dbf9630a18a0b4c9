"""Units that run in another order than the model registered them, on graphs that
differ by rank (unit_schedule.py [Note: the first forward in an unknown order] and
[Note: one unit sequence on every rank]): no hang and the single-process result,
from the very first step, ZeRO-3 with and without prefetching and the double buffer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import conftest
import megatron_fsdp as mf
from megatron_fsdp.runtime.unit_schedule import merge_order, merge_orders
from models import IN, OUT, Block, loss_fn, make_batches, make_optimizer, max_param_diff

TOL = 1e-5
STEPS = 3


class Reordered(nn.Module):
    """Registers blocks a, b, c but runs a, c, b; ``skip`` names blocks to leave out."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.a, self.b, self.c = Block(d), Block(d), Block(d)
        self.out = nn.Linear(d, OUT)
        self.skip: set[str] = set()

    def forward(self, x):
        h = self.inp(x)
        for name in ("a", "c", "b"):
            if name not in self.skip:
                h = getattr(self, name)(h)
        return self.out(h)


def _skips(rank: int, step: int, first_step_diverges: bool = True) -> set[str]:
    """Rank 0 leaves out b at the first step, rank 1 leaves out a, the others nothing;
    later one rank leaves out c."""
    if step == 0:
        return {0: {"b"}, 1: {"a"}}.get(rank, set()) if first_step_diverges else set()
    return {"c"} if rank == step % 2 else set()


def reordered_worker(rank, world, *, overlap, double_buffer):
    torch.manual_seed(0)
    reference = Reordered()
    batches = make_batches("net", STEPS, batch=2 * world)
    model, opt = mf.fully_shard(copy.deepcopy(reference), make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                zero_dp_strategy=3, overlap_param_gather=overlap, fsdp_double_buffer=double_buffer)
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        model.module.skip = _skips(rank, step, not double_buffer)
        try:
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        except NotImplementedError as exc:
            return str(exc)
        opt.step()
        ref_opt.zero_grad()
        loss = 0.0
        for r, (xr, yr) in enumerate(zip(x.chunk(world), y.chunk(world))):
            reference.skip = _skips(r, step, not double_buffer)
            loss = loss + loss_fn("net", reference(xr), yr)
        (loss / world).backward()
        ref_opt.step()
    model.finish_param_sync()
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("overlap,double_buffer", [(True, False), (False, False), (True, True)],
                         ids=["prefetch", "no-prefetch", "double-buffer"])
def test_reordered_units_on_divergent_graphs(world, overlap, double_buffer):
    """The double buffer's slots assume module order: it refuses this model on every
    rank, naming the remedy, at its first step, where every rank runs the same graph
    ([Note: the first forward in an unknown order])."""
    results = conftest.get_pool(world).run(reordered_worker, overlap=overlap, double_buffer=double_buffer)
    if double_buffer:
        assert all("Set fsdp_double_buffer=False" in str(r) for r in results), results
    else:
        assert max(results) < TOL, results


def test_merged_order_keeps_every_ranks_order():
    # Rank 0 ran 0, 2 (1 skipped); rank 1 ran 2, 1 (0 skipped): 1 runs after 2.
    assert merge_orders([[0, 2], [2, 1]], 3) == [0, 2, 1]
    # Rank 0's order alone would put the unit it skipped in module order (before 2).
    assert merge_order([0, 2], 3) == [0, 1, 2]
    # Units nobody ran follow their module-order predecessor.
    assert merge_orders([[3], [3]], 4) == [0, 1, 2, 3]
    # Contradicting ranks: rank 0's order, as before.
    assert merge_orders([[1, 0], [0, 1]], 2) == merge_order([1, 0], 2) == [1, 0]


class RootWeights(nn.Module):
    """A root that owns weights it uses between its children's calls, and whose output
    is also its last child's: with fine-grained gathering the root is a unit enclosing
    the others, and its backward hook may fire after its last child's."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.turn = nn.Parameter(torch.randn(d, d) * 0.3)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, OUT)

    def forward(self, x):
        h = self.mid(self.inp(x)) * self.gate
        return self.out(h @ self.turn)


def root_weights_worker(rank, world, *, nested_units):
    torch.manual_seed(0)
    reference = RootWeights()
    units = {"fine_grained": dict(enable_fine_grained_param_gather=True),
             "root_and_linears": dict(fsdp_unit_modules=[RootWeights, nn.Linear])}[nested_units]
    model, opt = mf.fully_shard(copy.deepcopy(reference), make_optimizer("sgd"), zero_dp_strategy=3, **units)
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for x, y in make_batches("net", STEPS, batch=2 * world):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
    model.finish_param_sync()
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("nested_units", ["fine_grained", "root_and_linears"])
def test_enclosing_unit_keeps_its_weights_through_its_childrens_backward(pool2, nested_units):
    assert max(pool2.run(root_weights_worker, nested_units=nested_units)) < TOL


def layer_drop_worker(rank, world, *, double_buffer):
    """SkipNet (units in module order) dropping a rank-dependent block from the first step."""
    from models import SkipNet

    torch.manual_seed(0)
    reference = SkipNet()
    batches = make_batches("net", STEPS, batch=2 * world)
    model, opt = mf.fully_shard(copy.deepcopy(reference), make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                zero_dp_strategy=3, fsdp_double_buffer=double_buffer)
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        model.module.skip = {(rank + step) % 3}
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = 0.0
        for r, (xr, yr) in enumerate(zip(x.chunk(world), y.chunk(world))):
            reference.skip = {(r + step) % 3}
            loss = loss + loss_fn("net", reference(xr), yr)
        (loss / world).backward()
        ref_opt.step()
    model.finish_param_sync()
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("double_buffer", [False, True], ids=["allocated", "double-buffer"])
def test_layer_drop_from_the_first_step(double_buffer):
    """Skipped units in module order are released at once under the double buffer's
    slots, which a unit held for the rest of the first forward would block."""
    assert max(conftest.get_pool(3).run(layer_drop_worker, double_buffer=double_buffer)) < TOL
