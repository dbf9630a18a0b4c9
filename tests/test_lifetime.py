"""The wrapped model as a Python object. It is freed, with its optimizer and buffers,
once the user drops it, as with DDP and FSDP2 (a GPU holding one model per
configuration, gpu_check's sections, ran out of memory when every wrapped model lived
on). Copies, pickles, moves and casts either work as under DDP or raise naming the
remedy (wrapped_model_guards.py)."""

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


def copy_worker(rank, world, *, strategy):
    """DDP's EMA habit, ema = copy.deepcopy(model.module), torch.save(model) and casts
    after wrapping: a clear error naming the remedy, which then works."""
    import copy
    import io

    torch.manual_seed(0)
    module = Net()
    ema = copy.deepcopy(module)  # the remedy's first half: copy before wrapping
    model = mf.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    opt = mf.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, world, rank)
    refused = {}
    for name, attempt in {
        "deepcopy(model)": lambda: copy.deepcopy(model),
        "deepcopy(model.module)": lambda: copy.deepcopy(model.module),
        "deepcopy(block)": lambda: copy.deepcopy(model.module.blocks[0]),
        "torch.save(model)": lambda: torch.save(model, io.BytesIO()),
        "torch.save(model.module)": lambda: torch.save(model.module, io.BytesIO()),
    }.items():
        try:
            attempt()
        except TypeError as exc:
            refused[name] = "deep-copy the module before wrapping" in str(exc)
    ema.load_state_dict(mf.get_full_state_dict(model))
    full = mf.get_full_state_dict(model)
    ema_equal = all(torch.equal(v, full[k]) for k, v in ema.state_dict().items())
    # A move or cast that changes nothing is DDP scripts' habit; others raise.
    assert model.to("cpu") is model and model.float() is model
    _train(model, opt, world, rank, steps=1)
    for name, attempt in {
        "model.double()": lambda: model.double(),
        "model.to(float16)": lambda: model.to(torch.float16),
        "model.module.half()": lambda: model.module.half(),
        "block.double()": lambda: model.module.blocks[0].double(),
    }.items():
        try:
            attempt()
        except TypeError as exc:
            refused[name] = "Move and cast the module before wrapping" in str(exc)
    # Unwrapped again, the module copies and casts as any module does.
    plain = model.unshard_module()
    copied = copy.deepcopy(plain)
    unwrapped_copy = all(torch.equal(a, b) for a, b in zip(copied.parameters(), plain.parameters()))
    unwrapped_copy &= plain.double().out.weight.dtype == torch.float64
    return refused, ema_equal, unwrapped_copy


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_copying_or_casting_a_wrapped_model_is_refused_with_the_remedy(pool2, strategy):
    for refused, ema_equal, unwrapped_copy in pool2.run(copy_worker, strategy=strategy):
        assert refused == dict.fromkeys(refused, True) and len(refused) == 9, refused
        assert ema_equal and unwrapped_copy


def experimental_copy_worker(rank, world, *, strategy):
    import copy
    import io

    torch.manual_seed(0)
    model = Net()
    ema = copy.deepcopy(model)
    shard_net(model, make_mesh(world, strategy), placements_for(strategy))
    messages = []
    for attempt in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
        try:
            attempt()
        except TypeError as exc:
            messages.append(str(exc))
    ema.load_state_dict(experimental.full_state_dict(model))
    return messages


@pytest.mark.parametrize("strategy", ["no_shard", "zero3"])
def test_copying_an_experimental_sharded_model_is_refused_with_the_remedy(pool2, strategy):
    for messages in pool2.run(experimental_copy_worker, strategy=strategy):
        assert len(messages) == 2 and all("experimental.full_state_dict(model)" in m for m in messages), messages
