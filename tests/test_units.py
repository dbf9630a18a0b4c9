"""Communication units: merging small neighbouring units into one collective."""

import pytest
import torch
import torch.nn as nn

import megatron_fsdp as mf
from megatron_fsdp.buffers.units import merge_units, owned_numels, plan_merge
from models import Block, loss_fn, make_batches, make_model


@pytest.mark.parametrize(
    "numels, limit, runs",
    [
        ([3, 3, 3], None, [[0], [1], [2]]),
        ([3, 3, 3], 6, [[0, 1], [2]]),
        ([3, 3, 3], 9, [[0, 1, 2]]),
        ([10, 1, 1, 10], 5, [[0], [1, 2], [3]]),  # an oversized item stays alone
        ([1, 10, 1], 5, [[0], [1], [2]]),  # never merged across an oversized one
        ([], 5, []),
    ],
)
def test_plan_merge_packs_neighbours(numels, limit, runs):
    assert plan_merge(numels, limit) == runs


def test_merge_units_names_and_members():
    model = make_model("net")  # three Blocks of 246 elements
    units = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    assert owned_numels(units) == [246, 246, 246]
    merged = merge_units(units, 600)
    assert [u.name for u in merged] == ["blocks.0..blocks.1", "blocks.2"]
    assert merged[0].modules == (model.blocks[0], model.blocks[1])
    assert [u.modules for u in merge_units(units, None)] == [(b,) for b in model.blocks]


def test_nested_units_are_never_merged():
    outer = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    units = [("outer", outer), ("outer.1", outer[1]), ("side", nn.Linear(2, 2)), ("side2", nn.Linear(2, 2))]
    merged = merge_units(units, 10_000)
    assert [u.name for u in merged] == ["outer", "outer.1", "side..side2"]
    # The parent owns only what its nested unit does not.
    assert owned_numels(units)[:2] == [6, 6]


def count_worker(rank, world, *, strategy, suggested):
    torch.manual_seed(0)
    model = make_model("net")
    fsdp, opt = mf.fully_shard(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        suggested_communication_unit_size=suggested,
    )
    batches = make_batches("net", 2, batch=4 * world)
    counts = None
    for step, (x, y) in enumerate(batches):
        with mf.record_collectives() as rec:
            opt.zero_grad()
            loss_fn("net", fsdp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
            fsdp.finish_param_sync()
        counts = dict(rec.counts)  # the second step: the forward order is known
    hooked = sum(len(m._forward_pre_hooks) for m in model.blocks)
    return counts, len(fsdp.units), hooked


def test_merged_units_gather_and_reduce_once_each(pool2):
    # Root modules inp+out merge into one group, blocks 0+1 into one unit, block 2 alone.
    counts, units, _ = pool2.run(count_worker, strategy="optim_grads_params", suggested=600)[0]
    assert units == 2
    # Forward: root, {0,1}, {2}; backward re-gathers {0,1} only (the last unit stays).
    assert counts == {"all_gather": 4, "reduce_scatter": 3}
    plain, units, _ = pool2.run(count_worker, strategy="optim_grads_params", suggested=None)[0]
    assert units == 3 and plain == {"all_gather": 7, "reduce_scatter": 5}


def test_no_shard_units_merge_by_default_and_need_no_hooks(pool2):
    counts, units, hooked = pool2.run(count_worker, strategy="no_shard", suggested=None)[0]
    assert units == 1 and hooked == 0
    assert counts == {"all_reduce": 2}  # the blocks, and the root modules
    counts, units, _ = pool2.run(count_worker, strategy="no_shard", suggested=300)[0]
    assert units == 3 and counts == {"all_reduce": 4}


def merged_skip_worker(rank, world, *, strategy, double_buffer):
    """Rank-dependent layer drop over merged units (blocks 0+1 one unit, block 2
    alone): rank r skips block (r + step) % 4, so on some ranks a merged unit's
    last module never runs (its closing post-forward never fires)."""
    import copy

    from models import SkipNet

    torch.manual_seed(0)
    base = SkipNet()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    fsdp, opt = mf.fully_shard(base, lambda p: torch.optim.SGD(p, lr=0.1), fsdp_unit_modules=[Block],
                               zero_dp_strategy=strategy, suggested_communication_unit_size=600,
                               fsdp_double_buffer=double_buffer)
    assert len(fsdp.units) == 2
    sequences = []
    for step, (x, y) in enumerate(make_batches("net", 4, batch=2 * world)):
        ref_opt.zero_grad()
        total = 0.0
        for r, (xr, yr) in enumerate(zip(x.chunk(world), y.chunk(world))):
            reference.skip = {(r + step) % 4}
            total = total + loss_fn("net", reference(xr), yr)
        (total / world).backward()
        ref_opt.step()
        with mf.record_collectives() as rec:
            opt.zero_grad()
            fsdp.module.skip = {(rank + step) % 4}
            loss_fn("net", fsdp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
            fsdp.finish_param_sync()
        sequences.append(dict(rec.counts))
    full = mf.get_full_state_dict(fsdp)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return diff, sequences


@pytest.mark.parametrize(
    "strategy,double_buffer",
    [("no_shard", False), ("optim", False), ("optim_grads", False), ("optim_grads_params", False),
     ("optim_grads_params", True)],
)
def test_rank_dependent_skip_over_merged_units(pool, strategy, double_buffer):
    results = pool.run(merged_skip_worker, strategy=strategy, double_buffer=double_buffer)
    assert all(diff < 1e-5 for diff, _ in results), [d for d, _ in results]
    # Every rank issued the same collectives whatever it skipped.
    assert all(seq == results[0][1] for _, seq in results)


def root_kept_worker(rank, world, *, strategy):
    """Two micro batches, the first under no_sync: the root's groups stay gathered
    between them (hooks.py [Note: root groups across micro batches])."""
    from models import backward_microbatches, make_optimizer, max_param_diff, train_reference

    torch.manual_seed(0)
    fsdp, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block],
                               zero_dp_strategy=strategy)
    batches = make_batches("net", 3, batch=4 * world)
    root_gathers = []
    for x, y in batches:
        with mf.record_collectives() as rec:
            opt.zero_grad()
            backward_microbatches(fsdp, x, y, rank, world, microbatches=2)
            opt.step()
        root_gathers.append(sum(1 for kind, label in rec.labels if kind == "all_gather" and label.startswith("root")))
    fsdp.finish_param_sync()
    diff = max_param_diff(mf.get_full_state_dict(fsdp), train_reference(make_model("net"), "net", batches, "adamw"))
    return diff, root_gathers, len(fsdp.param_and_grad_buffer.groups_of_unit(None))


def test_root_stays_gathered_across_no_sync_micro_batches(pool2):
    for diff, root_gathers, root_groups in pool2.run(root_kept_worker, strategy="optim_grads_params"):
        assert diff < 1e-5, diff
        # One gather per root group per step, not one per micro batch (4 before).
        assert root_gathers[1:] == [root_groups, root_groups], (root_gathers, root_groups)
