"""Upstream 0.6.1's ``megatron_fsdp.experimental`` API, recorded by
``scripts/record_upstream_api.py --experimental`` in
``tests/data/upstream_experimental_api_0.6.1.json``: every export, parameter and placement
field exists here with upstream's default, and code written for that release (no
``fully_shard_context``, its own ``Replicate`` / ``Partial``, ``microbatch(model, is_last)``)
trains exactly as the main-branch form and as one process."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial as TorchPartial, Replicate as TorchReplicate

import megatron_fsdp.experimental as experimental
from megatron_fsdp.experimental import (
    Flat, Partial, Placements, Replicate, full_state_dict, fully_shard, fully_shard_context, fully_shard_optimizer,
    microbatch,
)
from models import loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference

API = json.loads((Path(__file__).parent / "data" / "upstream_experimental_api_0.6.1.json").read_text())
FIFTH_POSITIONAL = {"fully_shard": ("use_symm_mem", "grad_divisor")}
"""Where this package's positional order differs from 0.6.1's: (upstream's name, ours). A
boolean in that position is refused (``test_a_positional_use_symm_mem_is_refused``)."""


def test_every_export_exists():
    missing = [name for name in API["exports"] if not hasattr(experimental, name)]
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(API["functions"]))
def test_entry_point_parameters(name):
    ours = inspect.signature(getattr(experimental, name)).parameters
    for index, param in enumerate(API["functions"][name]):
        assert param["name"] in ours, f"{name}: upstream's parameter {param['name']!r} is missing"
        if param["default"] is not None:
            assert ours[param["name"]].default is not inspect.Parameter.empty
            assert repr(ours[param["name"]].default) == param["default"], (name, param)
        if param["kind"] == "positional_or_keyword" and (name, index) != ("fully_shard", 4):
            assert list(ours)[index] in (param["name"], "context"), (name, index, list(ours))


def test_dbuffer_constructor_parameters():
    ours = inspect.signature(experimental.DBuffer.__init__).parameters
    theirs = [p["name"] for p in API["inits"]["DBuffer"]]
    assert [n for n in ours if n != "self"][: len(theirs)] == theirs


def test_placement_fields_and_defaults():
    assert [p["name"] for p in API["dataclasses"]["Placements"]] == list(Placements.__dataclass_fields__)
    assert Partial().reduce_op == dist.ReduceOp.SUM and API["dataclasses"]["Partial"][0]["name"] == "reduce_op"
    assert Replicate() == Replicate() and isinstance(Flat(), experimental.placement.Shard)


def test_upstream_placements_become_torch_placements():
    placements = Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial()], optimizer=[Flat()])
    assert placements.parameter == (TorchReplicate(),) and placements.gradient == (TorchPartial("avg"),)
    assert Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial(dist.ReduceOp.AVG)],
                      optimizer=[Flat()]).gradient == (TorchPartial("avg"),)
    with pytest.raises(NotImplementedError, match="averages gradients"):
        Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial(dist.ReduceOp.MAX)], optimizer=[Flat()])


# -- 0.6.1 code, run here (world 2) ------------------------------------------------------
def _upstream_061_placements(kind: str) -> Placements:
    if kind == "zero3":
        return Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    return Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial()], optimizer=[Flat()])


def _train(model, batches, rank, world, use_module: bool, context=None):
    optimizer = make_optimizer("adamw")(model.parameters())
    fully_shard_optimizer(optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with microbatch(model if use_module else context, is_last=i == 1):
                (loss_fn("net", model(xm), ym) / 2).backward()
        optimizer.step()


def upstream_061_worker(rank, world, *, kind):
    """0.6.1's usage against one process and against this package's main-branch usage."""
    mesh = init_device_mesh("cpu", (world,))
    batches = make_batches("net", 3, batch=4 * world * 2)
    results = {}
    model = make_model("net", d=8, depth=3)
    reference = train_reference(model, "net", batches, "adamw")
    for block in model.blocks:  # 0.6.1: no context; returns None there (the module here)
        fully_shard(block, mesh, _upstream_061_placements(kind), None, use_symm_mem=False)
    fully_shard(model, mesh, _upstream_061_placements(kind))
    _train(model, batches, rank, world, use_module=True)
    upstream_style = full_state_dict(model)
    results["vs_one_process"] = max_param_diff(upstream_style, reference)

    main_model = make_model("net", d=8, depth=3)
    main_placements = _upstream_061_placements(kind)
    with fully_shard_context() as context:
        for block in main_model.blocks:
            fully_shard(block, mesh=mesh, placements=main_placements)
        fully_shard(main_model, mesh=mesh, placements=main_placements)
    _train(main_model, batches, rank, world, use_module=False, context=context)
    main_style = full_state_dict(main_model)
    results["bit_equal_to_main_form"] = all(torch.equal(upstream_style[k], main_style[k]) for k in main_style)
    return results


@pytest.mark.parametrize("kind", ["zero3", "zero1"])
def test_upstream_061_code_trains_exactly(pool2, kind):
    for result in pool2.run(upstream_061_worker, kind=kind):
        assert result["vs_one_process"] <= 1e-5, result
        assert result["bit_equal_to_main_form"], result


def refusal_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    placements = _upstream_061_placements("zero3")
    messages = []
    for kwargs, args in (({"use_symm_mem": True}, ()), ({}, (None, True))):
        try:
            fully_shard(make_model("net", d=8, depth=1), mesh, placements, *args, **kwargs)
        except (NotImplementedError, TypeError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def test_unsupported_upstream_options_are_refused(pool2):
    """use_symm_mem=True names itself; 0.6.1's positional use_symm_mem is not taken for grad_divisor."""
    for messages in pool2.run(refusal_worker):
        assert len(messages) == 2, messages
        assert messages[0].startswith("NotImplementedError") and "use_symm_mem=True" in messages[0]
        assert messages[1].startswith("TypeError") and "pass it by keyword (use_symm_mem=...)" in messages[1]
