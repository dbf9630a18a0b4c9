"""Training through megatron_fsdp equals single-process training on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_fsdp as mf
from models import Block, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5


def freeze_second_block_fc1(model):
    for p in model.blocks[1].fc1.parameters():
        p.requires_grad_(False)


def parity_worker(
    rank,
    world,
    *,
    strategy,
    optimizer="sgd",
    overlap=True,
    microbatches=1,
    steps=4,
    kind="net",
    model_kwargs=None,
    freeze=False,
    units=True,
    suggested=None,
):
    torch.manual_seed(0)
    model = make_model(kind, **(model_kwargs or {}))
    batches = make_batches(kind, steps, batch=4 * world * microbatches)
    freeze_fn = freeze_second_block_fc1 if freeze else None
    reference = train_reference(model, kind, batches, optimizer, freeze_fn)
    if freeze_fn:
        freeze_fn(model)
    fsdp_model, opt = mf.fully_shard(
        model,
        make_optimizer(optimizer),
        fsdp_unit_modules=[Block] if units else None,
        zero_dp_strategy=strategy,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        suggested_communication_unit_size=suggested,
    )
    for x, y in batches:
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(microbatches), y.chunk(world)[rank].chunk(microbatches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == microbatches - 1
            ctx = fsdp_model.no_sync() if not last else torch.enable_grad()
            with ctx:
                (loss_fn(kind, fsdp_model(xm), ym) / microbatches).backward()
        opt.step()
    return max_param_diff(mf.get_full_state_dict(fsdp_model), reference)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity(pool, strategy, optimizer, overlap):
    diffs = pool.run(parity_worker, strategy=strategy, optimizer=optimizer, overlap=overlap)
    assert max(diffs) < TOL, diffs


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_gradient_accumulation(pool, strategy, optimizer):
    diffs = pool.run(parity_worker, strategy=strategy, optimizer=optimizer, microbatches=2)
    assert max(diffs) < TOL, diffs


@pytest.mark.parametrize(
    "variant",
    [
        dict(freeze=True),
        dict(kind="tied"),
        dict(model_kwargs=dict(recompute=True)),
        dict(units=False),
        dict(optimizer="sgd_momentum", model_kwargs=dict(d=13, depth=2)),
        # Blocks hold 246 elements: 600 merges blocks 0 and 1 into one communication unit.
        dict(suggested=600, optimizer="adamw"),
        dict(suggested=600, model_kwargs=dict(recompute=True)),
    ],
    ids=["frozen", "tied", "recompute", "no_units", "odd_sizes_momentum", "merged_units", "merged_recompute"],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_model_variants(pool, strategy, variant):
    diffs = pool.run(parity_worker, strategy=strategy, **variant)
    assert max(diffs) < TOL, diffs
