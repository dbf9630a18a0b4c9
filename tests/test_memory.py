"""Bytes moved and memory held, from the package's own accounting (never timings)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.models.gpt import gpt_loss

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _step(model, opt, rank, world, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG["vocab_size"], (2 * world, CFG["seq_length"] + 1), generator=g).chunk(world)[rank]
    opt.zero_grad()
    gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    model.finish_param_sync()


def _shard(strategy, **kwargs):
    return mf.fully_shard(
        _gpt(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=strategy, **kwargs,
    )


def bytes_worker(rank, world, *, strategy):
    model, opt = _shard(strategy)
    _step(model, opt, rank, world, 0)
    with mf.record_collectives() as rec:
        _step(model, opt, rank, world, 1)
    reference = _gpt()
    total = sum(p.numel() for p in reference.parameters()) * 4
    # gathered again in backward: every block but the last (kept from its forward)
    regathered = sum(p.numel() for p in reference.blocks[:-1].parameters()) * 4
    return dict(rec.bytes), total, regathered


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bytes_per_step_at_the_theoretical_minimum(pool2, strategy):
    moved, P, regathered = pool2.run(bytes_worker, strategy=strategy)[0]
    minimum = {
        # grads all-reduced once
        "no_shard": {"all_reduce": P},
        # grads reduce-scattered once, updated weights all-gathered once
        "optim": {"reduce_scatter": P, "all_gather": P},
        "optim_grads": {"reduce_scatter": P, "all_gather": P},
        # unit weights gathered in forward and again in backward, except the last
        # unit, kept from its forward to its backward; the rest (embeddings, final
        # norm) once per step; grads reduce-scattered once
        "optim_grads_params": {"reduce_scatter": P, "all_gather": P + regathered},
    }[strategy]
    assert set(moved) == set(minimum)
    for kind, expected in minimum.items():
        assert expected <= moved[kind] <= 1.02 * expected, (kind, moved[kind], expected)  # padding only


def accounting_worker(rank, world, *, strategy, steps):
    model, opt = _shard(strategy)
    acct = model.buffer_accounting
    persistent, peaks, temporaries = [], [], []
    for step in range(steps):
        acct.reset_peak()
        _step(model, opt, rank, world, step)
        persistent.append(dict(acct.persistent))
        peaks.append(acct.peak_temporary)
        temporaries.append(acct.temporary)
    state = sum(
        (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
        for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    P = sum(p.numel() for p in _gpt().parameters()) * 4
    return dict(persistent=persistent, peaks=peaks, temporaries=temporaries, state=state, P=P)


FORMULA = {  # per-rank persistent bytes / P (fp32 weights, fp32 grads): weights, grads
    "no_shard": (1, 1),
    "optim": (1, 1),
    "optim_grads": (1, None),
    "optim_grads_params": (None, None),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_bytes_follow_the_zero_formula(pool, strategy):
    for out in pool.run(accounting_worker, strategy=strategy, steps=2):
        world = len(pool._procs)
        P = out["P"]
        weights, grads = ((f or 1 / world) * P for f in FORMULA[strategy])
        held = out["persistent"][-1]
        assert weights <= held["model_weights"] <= 1.02 * weights
        assert grads <= held["main_grads"] <= 1.02 * grads
        assert held.get("main_weights", 0) == 0  # fp32: the model weights are the main weights


def test_optimizer_state_halves_from_2_to_4_ranks(pool2, pool4):
    two = sum(o["state"] for o in pool2.run(accounting_worker, strategy="optim", steps=1))
    four = sum(o["state"] for o in pool4.run(accounting_worker, strategy="optim", steps=1))
    assert two == four  # the same total, spread over twice the ranks
    per_rank_two = max(o["state"] for o in pool2.run(accounting_worker, strategy="optim", steps=1))
    per_rank_four = max(o["state"] for o in pool4.run(accounting_worker, strategy="optim", steps=1))
    assert per_rank_four <= 0.5 * per_rank_two * 1.1  # uneven pieces: within 10% of half


def test_zero2_peak_not_above_zero1(pool2):
    def peak(strategy):
        outs = pool2.run(accounting_worker, strategy=strategy, steps=2)
        return max(sum(o["persistent"][-1].values()) + o["peaks"][-1] for o in outs)

    assert peak("optim_grads") <= peak("optim")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_growth_over_50_steps(pool2, strategy):
    for out in pool2.run(accounting_worker, strategy=strategy, steps=50):
        assert all(p == out["persistent"][0] for p in out["persistent"])
        assert all(t == 0 for t in out["temporaries"])  # every temporary bucket was released
        assert len(set(out["peaks"][2:])) == 1  # the same peak every step after warm-up


def bucket_size_worker(rank, world):
    """One unit (the whole model) split into buckets: no temporary covers it all."""
    cfg = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads", bucket_size=8_000)
    model = mf.MegatronFSDP(_gpt(), ddp_config=cfg)
    opt = mf.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.buffer_accounting.reset_peak()
    _step(model, opt, rank, world, 0)
    groups = model.param_and_grad_buffer.grad_groups
    largest = max(g.layout.padded_numel for g in groups) * 4
    return model.buffer_accounting.peak_temporary, largest, len(groups), sum(g.layout.padded_numel for g in groups) * 4


def test_bucket_size_bounds_temporary_gradient_memory(pool2):
    peak, largest, groups, total = pool2.run(bucket_size_worker)[0]
    assert groups > 3
    assert peak <= 2 * largest < total
