"""Initialising weights after wrapping (piece_dtensor.py [Note: random fills of pieces]).

A model built on the meta device and initialised after ``fully_shard`` (FSDP2's
habit), or HF-style ``_init_weights`` applied late, calls ``nn.init`` on the sharded
parameters. The random fills draw the whole parameter and keep this rank's piece, so
the weights equal the same init of the unwrapped model bit for bit, and training
from them equals one process. Inits that need the whole tensor are refused first.
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
