"""fsdp_double_buffer: pooled temporary buckets train identically, stop allocating
after the first step, hold a bounded amount, and refuse an order they cannot serve."""

import pytest
import torch
import torch.nn as nn

import megatron_fsdp as mf
from megatron_fsdp.buffers.allocator import SlotConflictError
from megatron_fsdp.buffers.units import UnitSpec, slot_plan
from models import Block, backward_microbatches, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def test_slot_plan_alternates_and_skips_nested():
    blocks = [nn.Linear(2, 2) for _ in range(4)]
    specs = [UnitSpec(f"b{i}", (b,)) for i, b in enumerate(blocks)]
    assert slot_plan(specs, 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert slot_plan(specs, 3) == {0: 0, 1: 1, 2: 2, 3: 0}
    assert slot_plan(specs, 1) == {0: 0, 1: 1, 2: 0, 3: 1}  # never fewer than two
    parent = nn.Sequential(nn.Linear(2, 2))
    nested = [UnitSpec("p", (parent,)), UnitSpec("p.0", (parent[0],))] + specs[:2]
    assert slot_plan(nested, 2) == {2: 0, 3: 1}


def parity_worker(rank, world, *, strategy, optimizer, recompute=False, microbatches=1, prefetch_depth=1):
    torch.manual_seed(0)
    model = make_model("net", depth=4, recompute=recompute)
    batches = make_batches("net", 4, batch=4 * world * microbatches)
    reference = train_reference(model, "net", batches, optimizer)
    config = mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, fsdp_double_buffer=True, prefetch_depth=prefetch_depth
    )
    fsdp = mf.MegatronFSDP(model, ddp_config=config, fsdp_unit_modules=[Block])
    opt = mf.fully_shard_optimizer(make_optimizer(optimizer)(fsdp.parameters()))
    allocations = []
    for x, y in batches:
        opt.zero_grad()
        backward_microbatches(fsdp, x, y, rank, world, microbatches)
        opt.step()
        fsdp.finish_param_sync()
        allocations.append(fsdp.buffer_accounting.temporary_allocations)
    accounting = fsdp.buffer_accounting
    return {
        "diff": max_param_diff(mf.get_full_state_dict(fsdp), reference),
        "allocations": allocations,
        "held": accounting.temporary,
        "peak": accounting.peak_temporary,
        "unit_bucket": max(g.model_weights.bucket.numel() * 4 for u in fsdp.units for g in u.groups),
        "slot_bytes": fsdp.param_and_grad_buffer.allocator.slot_bytes,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_double_buffer_parity(pool, strategy, optimizer):
    for out in pool.run(parity_worker, strategy=strategy, optimizer=optimizer):
        assert out["diff"] < 1e-5, out
        # Steady state: everything after the first step comes from the pool.
        assert out["allocations"][1:] == [out["allocations"][0]] * 3, out["allocations"]


@pytest.mark.parametrize(
    "variant", [dict(recompute=True), dict(microbatches=2), dict(prefetch_depth=2)], ids=["recompute", "accum", "depth2"]
)
def test_double_buffer_variants(pool2, variant):
    for out in pool2.run(parity_worker, strategy="optim_grads_params", optimizer="adamw", **variant):
        assert out["diff"] < 1e-5, out


def test_zero3_weights_use_two_slots(pool2):
    out = pool2.run(parity_worker, strategy="optim_grads_params", optimizer="sgd")[0]
    # Four equal unit buckets share two slots; nothing is ever given back, so what
    # is held is the peak (and it stopped growing after the first step, above).
    assert out["slot_bytes"] == 2 * out["unit_bucket"], out
    assert out["held"] == out["peak"], out


class ReversedNet(nn.Module):
    """Runs its blocks in reverse module order: unit 3 then unit 2 ... while the
    first unit's prefetch (unit 3 -> unit 2) collides with nothing, the order
    breaks the slot alternation as soon as two units of one slot are live."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(7) for _ in range(3))
        self.inp, self.out = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x):
        h = self.inp(x)
        h = self.blocks[0](h)
        h = self.blocks[2](h) + self.blocks[0](h)  # unit 0 used twice, around unit 2 (same slot)
        return self.out(self.blocks[1](h))


def conflict_worker(rank, world):
    model = ReversedNet()
    fsdp, opt = mf.fully_shard(model, lambda p: torch.optim.SGD(p, lr=0.1), fsdp_unit_modules=[Block],
                               fsdp_double_buffer=True)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    try:
        for _ in range(2):
            loss_fn("net", fsdp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
    except SlotConflictError as exc:
        return str(exc)
    return None


def test_slot_conflict_is_a_clear_error(pool2):
    for message in pool2.run(conflict_worker):
        assert message and "fsdp_double_buffer=False" in message and "still holds" in message, message


def two_forwards_conflict_worker(rank, world):
    """Two forwards before one backward keep units gathered until their gradients are
    complete ([Note: several forwards, one backward]), which the slots cannot serve:
    refused, before the optimizer changes any weight."""
    fsdp, opt = mf.fully_shard(make_model("net", depth=4), lambda p: torch.optim.SGD(p, lr=0.1),
                               fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params", fsdp_double_buffer=True)
    before = [p.detach().to_local().clone() for p in fsdp.parameters()]
    x, y = make_batches("net", 1, batch=4 * world)[0]
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    try:
        (loss_fn("net", fsdp(xs), ys) + loss_fn("net", fsdp(2 * xs), ys)).backward()
        opt.step()
        message = "no error"
    except NotImplementedError as exc:
        message = str(exc)
    unchanged = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, fsdp.parameters()))
    return message, unchanged


def test_two_forwards_with_double_buffer_are_refused(pool2):
    for message, unchanged in pool2.run(two_forwards_conflict_worker):
        assert "several forwards before one backward" in message and "fsdp_double_buffer=False" in message, message
        assert unchanged
