"""``--async-save`` (``dcp_checkpoint.AsyncSaver``): what is written is the state at the save,
although training goes on while DCP writes, under every strategy; and the state is staged
once: only the tensors that share storage with the live model or optimizer are copied
(dcp_checkpoint.py, [Note: one host copy])."""

from __future__ import annotations

import pytest
import torch

import megatron_fsdp as mf
from megatron_fsdp.training.checkpoint import dcp_checkpoint

STRATEGIES = ["no_shard", "optim", "optim_grads_params"]


def _model(strategy):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    return mf.fully_shard(net, lambda ps: torch.optim.AdamW(ps, lr=1e-2), fsdp_unit_modules=[torch.nn.Linear],
                          zero_dp_strategy=strategy)


def _step(model, opt, seed):
    opt.zero_grad()
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
    opt.step()


def async_save_worker(rank, world, *, strategy, root):
    model, opt = _model(strategy)
    _step(model, opt, rank)
    saved = {k: v.clone() for k, v in mf.get_full_state_dict(model).items()}
    copied = []
    original = dcp_checkpoint._OneHostCopy._private

    def counting(self, value):
        staged = original(self, value)
        copied.append(staged is not value)
        return staged

    dcp_checkpoint._OneHostCopy._private = counting
    try:
        saver = dcp_checkpoint.AsyncSaver()
        saver.save(root, 1, model, opt, {"iteration": 1})
    finally:
        dcp_checkpoint._OneHostCopy._private = original
    for seed in (10, 11):  # training goes on while the save is written
        _step(model, opt, seed + rank)
    saver.finalize()
    fresh, fresh_opt = _model(strategy)
    dcp_checkpoint.load(root, fresh, fresh_opt)
    loaded = mf.get_full_state_dict(fresh)
    diff = max((loaded[k] - saved[k]).abs().max().item() for k in saved)
    moved = max((mf.get_full_state_dict(model)[k] - saved[k]).abs().max().item() for k in saved)
    return {"diff": diff, "moved": moved, "copied": sum(copied), "tensors": len(copied)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_async_save_writes_the_state_at_the_save(pool2, tmp_path, strategy):
    for result in pool2.run(async_save_worker, strategy=strategy, root=str(tmp_path)):
        assert result["moved"] > 1e-3, result  # training changed the live weights after the save
        assert result["diff"] == 0.0, result  # yet the checkpoint holds the weights at the save
        assert 0 < result["copied"] < result["tensors"], result  # only the live-aliasing tensors copied
