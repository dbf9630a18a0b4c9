"""A wrapped model, its optimizer and its buffers are freed once the user drops them,
as with DDP and FSDP2. A GPU holding one model per configuration (a sweep, a notebook,
gpu_check's sections) ran out of memory when every wrapped model lived on."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import megatron_fsdp as mf
from megatron_fsdp import experimental
from models import Block, Net, loss_fn, make_batches
from test_experimental import make_mesh, placements_for, shard_net
from test_patterns import STRATEGIES


def _train(model, opt, world, rank, steps=2):
    for x, y in make_batches("net", steps, batch=2 * world):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()


def _dead_after_del(build) -> list[str]:
    """Names of the objects ``build()`` returned that survive ``del`` and a collection."""
    objects = build()
    refs = {name: weakref.ref(obj) for name, obj in objects.items()}
    del objects
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


def lifetime_worker(rank, world, *, api, strategy):
    def main_engine():
        torch.manual_seed(0)
        module = Net()
        model = mf.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        opt = mf.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        _train(model, opt, world, rank)
        model.finish_param_sync()
        buffer = model.param_and_grad_buffer.groups[0].model_weights.data
        return dict(model=model, module=module, optimizer=opt, buffer=buffer)

    def ddp_interface():
        torch.manual_seed(0)
        module = Net()
        config = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        model = mf.FullyShardedDataParallel(None, config, module, fsdp_unit_modules=[Block])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, world, rank)
        return dict(model=model, module=module, optimizer=opt)

    def experimental_api():
        torch.manual_seed(0)
        model = Net()
        context = shard_net(model, make_mesh(world, strategy), placements_for(strategy))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        experimental.fully_shard_optimizer(opt)  # registers hooks on it (returns None)
        _train(model, opt, world, rank)
        return dict(model=model, optimizer=opt, context=context)

    build = {"main": main_engine, "ddp_interface": ddp_interface, "experimental": experimental_api}[api]
    return _dead_after_del(build)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("api", ["main", "ddp_interface"])
def test_wrapped_model_is_freed_after_del(pool2, api, strategy):
    for alive in pool2.run(lifetime_worker, api=api, strategy=strategy):
        assert alive == [], f"still alive after del + gc.collect(): {alive}"


@pytest.mark.parametrize("strategy", ["no_shard", "zero3"])
def test_experimental_model_is_freed_after_del(pool2, strategy):
    for alive in pool2.run(lifetime_worker, api="experimental", strategy=strategy):
        assert alive == [], f"still alive after del + gc.collect(): {alive}"
