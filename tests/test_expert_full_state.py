"""Full state dicts under expert parallelism ([Note: full state dicts under expert
parallelism]) at world 4, expert mesh (fsdp 2, ep 2): each expert-parallel rank holds
its own expert under its global name; ``get_full_state_dict`` gives every rank (or rank
0 alone) the whole model, every expert included, and ``load_full_state_dict`` of that
dict loads each rank's own experts and leaves the others, strictly, for every strategy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp as mf

STRATEGIES = ["no_shard", "optim_grads_params"]


class Toy(nn.Module):
    """A dense linear and expert ``ep_rank`` of two, keyed by its global index."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 6)
        self.experts = nn.ModuleDict({str(ep_rank): nn.Linear(6, 3)})
        for param in self.experts.parameters():
            param.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(iter(self.experts.values()))(self.dense(x))


def _whole() -> dict[str, torch.Tensor]:
    """The whole model's weights: the dense layer and both experts."""
    torch.manual_seed(0)
    dense, experts = nn.Linear(4, 6), [nn.Linear(6, 3) for _ in range(2)]
    out = {f"dense.{k}": v for k, v in dense.state_dict().items()}
    for e, expert in enumerate(experts):
        out.update({f"experts.{e}.{k}": v for k, v in expert.state_dict().items()})
    return out


def _wrapped(rank: int, strategy: str, weights: dict) -> nn.Module:
    model = Toy(rank % 2)
    model.load_state_dict({k: v for k, v in weights.items() if k.startswith("dense") or f".{rank % 2}." in k})
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    return mf.fully_shard_model(model, expt_device_mesh=experts, zero_dp_strategy=strategy)


def full_state_worker(rank, world, *, strategy):
    whole = _whole()
    model = _wrapped(rank, strategy, whole)
    everywhere = mf.get_full_state_dict(model)
    on_zero = mf.get_full_state_dict(model, rank0_only=True)
    fresh = _wrapped(rank, strategy, {k: torch.zeros_like(v) for k, v in whole.items()})
    mf.load_full_state_dict(fresh, everywhere)  # strict: the other rank's expert is left, not "unexpected"
    reloaded = mf.get_full_state_dict(fresh)

    def diff(got: dict) -> float:
        assert sorted(got) == sorted(whole), sorted(got)
        return max((got[k] - whole[k]).abs().max().item() for k in whole)

    return diff(everywhere), diff(on_zero) if rank == 0 else on_zero, diff(reloaded)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_state_dict_holds_every_expert(pool4, strategy):
    for rank, (everywhere, on_zero, reloaded) in enumerate(pool4.run(full_state_worker, strategy=strategy)):
        assert everywhere == 0.0 and reloaded == 0.0, (rank, everywhere, reloaded)
        assert on_zero == (0.0 if rank == 0 else {}), (rank, on_zero)


def checkpoint_worker(rank, world, *, strategy, directory):
    """Two AdamW steps, a DCP checkpoint after the first, and a fresh model and optimizer
    loaded from it taking the second step: the same weights only if every expert's state
    came back (a swapped expert state moves its weights differently)."""
    whole = _whole()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model = _wrapped(rank, strategy, whole)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    mf.save_checkpoint(directory, model, optimizer)
    fresh = _wrapped(rank, strategy, {k: torch.zeros_like(v) for k, v in whole.items()})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    mf.load_checkpoint(directory, fresh, fresh_opt)
    for net, opt in ((model, optimizer), (fresh, fresh_opt)):
        (net(x) * 3).sum().backward()
        opt.step()
    a, b = mf.get_full_state_dict(model), mf.get_full_state_dict(fresh)
    return sorted(a) == sorted(whole), max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_keeps_each_experts_optimizer_state(pool4, tmp_path, strategy):
    """[Note: optimizer state by parameter name]: torch's numbering names different experts
    on different expert-parallel ranks; keyed by name, every expert's AdamW state comes back."""
    for every_expert, diff in pool4.run(checkpoint_worker, strategy=strategy, directory=str(tmp_path / "ckpt")):
        assert every_expert and diff == 0.0, diff
