"""Initialising weights after wrapping (piece_dtensor.py [Note: random fills of pieces]).

A model built on the meta device and initialised after ``fully_shard`` (FSDP2's
habit), or HF-style ``_init_weights`` applied late, calls ``nn.init`` on the sharded
parameters. The random fills draw the whole parameter and keep this rank's piece, so
the weights equal the same init of the unwrapped model bit for bit, and training
from them equals one process, on both engines (the experimental one gave every rank the
same numbers for its rows). Inits that need the whole tensor are refused first.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron_fsdp
from models import Block, loss_fn, make_batches, make_model

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def late_init(module: nn.Module) -> None:
    """What users apply after wrapping: torch's inits and HF's ``.data.normal_``."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        module.bias.data.normal_(mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.uniform_(module.weight, 0.5, 1.5)
        nn.init.zeros_(module.bias)
    for name, p in module.named_parameters(recurse=False):
        if name not in ("weight", "bias") and p.dim() >= 2:
            nn.init.kaiming_normal_(p)


def full_weights(model) -> dict:
    return {k: v.clone() for k, v in megatron_fsdp.get_full_state_dict(model).items()}


def post_wrap_init_worker(rank: int, world: int, strategy: str) -> dict:
    base = make_model("net")
    reference = make_model("net")
    model, opt = megatron_fsdp.fully_shard(base, lambda ps: torch.optim.SGD(ps, lr=0.1), fsdp_unit_modules=[Block],
                                           zero_dp_strategy=strategy)
    torch.manual_seed(7)  # the same RNG state on every rank, as torch.manual_seed(seed) gives
    with torch.no_grad():
        model.module.apply(late_init)
    torch.manual_seed(7)
    with torch.no_grad():
        reference.apply(late_init)
    init = full_weights(model)
    init_diff = max((init[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    changed = max((init[k] - v).abs().max().item() for k, v in make_model("net").state_dict().items())

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in make_batches("net", 3, 4 * world):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
    trained = full_weights(model)
    train_diff = max((trained[k] - v).abs().max().item() for k, v in reference.state_dict().items())

    refusals = {}
    if strategy != "no_shard":
        before = full_weights(model)
        for name, init_fn in {
            "trunc_normal_": lambda p: nn.init.trunc_normal_(p, std=0.02),
            "orthogonal_": nn.init.orthogonal_,
        }.items():
            with pytest.raises(NotImplementedError) as err, torch.no_grad():
                init_fn(model.module.inp.weight)
            refusals[name] = str(err.value)
        with pytest.raises(NotImplementedError) as err:
            model.module.inp.weight.grad.normal_()  # a gradient piece: no place in a whole tensor
        refusals["grad"] = str(err.value)
        after = full_weights(model)
        refusals["unchanged"] = max((after[k] - v).abs().max().item() for k, v in before.items())
    return {"init": init_diff, "changed": changed, "train": train_diff, "refusals": refusals}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_init_after_wrapping_equals_the_unwrapped_init(pool4, strategy):
    for result in pool4.run(post_wrap_init_worker, strategy=strategy):
        assert result["changed"] > 0.1  # the init did replace the construction-time weights
        assert result["init"] == 0.0  # bit for bit the unwrapped model's init
        assert result["train"] <= 1e-6
        refusals = result["refusals"]
        if strategy == "no_shard":
            continue
        assert "trunc_normal_" in refusals["trunc_normal_"] and "before wrapping" in refusals["trunc_normal_"]
        assert "orthogonal_" in refusals["orthogonal_"] and "meta device" in refusals["orthogonal_"]
        assert "gradient" in refusals["grad"]
        assert refusals["unchanged"] == 0.0  # each refusal came before any write


# -- the experimental API: reset_parameters() after fully_shard ---------------------------------
def experimental_meta_init_worker(rank, world, *, steps=3):
    """The experimental API's meta-device build: fully_shard, then every module's
    reset_parameters() writes the sharded rows, as the README's Llama example does."""
    from megatron_fsdp.experimental import full_state_dict
    from models import Net, make_batches, max_param_diff, train_reference
    from test_experimental import make_mesh, placements_for, shard_net, train_sharded


    torch.manual_seed(7)
    with torch.device("meta"):
        model = Net(d=8, depth=3)
    context = shard_net(model, make_mesh(world, "zero3"), placements_for("zero3"))
    torch.manual_seed(7)
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    no_meta = not any(p.is_meta for p in model.parameters())
    initial = full_state_dict(model)
    torch.manual_seed(7)
    eager_init = Net(d=8, depth=3).state_dict()  # an unsharded build draws the same numbers
    init_diff = max((initial[k] - v).abs().max().item() for k, v in eager_init.items())
    try:  # redrawn by rejection over the whole tensor: refused before any write
        with torch.no_grad():
            torch.nn.init.trunc_normal_(model.blocks[0].fc1.weight, std=0.02)
        trunc_refused = False
    except NotImplementedError as exc:
        trunc_refused = "trunc_normal_" in str(exc) and "nothing was written" in str(exc)
    trunc_refused = trunc_refused and torch.equal(full_state_dict(model)["blocks.0.fc1.weight"],
                                                  initial["blocks.0.fc1.weight"])
    # Single-process reference from the very weights the sharded init produced.
    eager = Net(d=8, depth=3)
    eager.load_state_dict(initial)
    bound_ok = all(initial[f"blocks.{i}.fc1.weight"].abs().max() <= 8 ** -0.5 + 1e-7 for i in range(3))
    distinct = not torch.equal(initial["blocks.0.fc1.weight"], initial["blocks.1.fc1.weight"])
    batches = make_batches("net", steps, batch=4 * world)
    reference = train_reference(eager, "net", batches, "adamw")
    train_sharded(model, context, batches, "adamw", rank, world)
    return {
        "no_meta": no_meta,
        "init_diff": init_diff,
        "trunc_refused": trunc_refused,
        "bound_ok": bound_ok,
        "distinct": distinct,
        "initial": initial["blocks.0.fc1.weight"],
        "diff": max_param_diff(full_state_dict(model), reference),
    }


def test_experimental_meta_device_init_via_reset_parameters(pool):
    results = pool.run(experimental_meta_init_worker)
    for result in results:
        assert result["no_meta"] and result["bound_ok"] and result["distinct"], result
        # Each rank's rows are its part of the whole draw: before, every rank filled its
        # rows from the same RNG state, so the row blocks were copies of each other.
        assert result["init_diff"] == 0.0, result["init_diff"]
        assert result["trunc_refused"], result
        assert result["diff"] < 1e-5, result
    assert all(torch.equal(results[0]["initial"], r["initial"]) for r in results)
