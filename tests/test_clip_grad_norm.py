"""``MegatronFSDP.clip_grad_norm_`` ([Note: the norm under expert parallelism]) at world
4 with experts spread over 2 expert-parallel ranks (expert mesh (fsdp 2, ep 2), Megatron's
order): the total norm counts the dense gradients once and every expert's gradients
once, whichever rank holds them, and equals the norm computed from the ranks' whole
gradients gathered by hand; clipping scales every piece by the same coefficient, for the
2-norm and the inf norm and every sharding strategy. torch's ``clip_grad_norm_`` cannot
stack norms from two meshes and says so (no silent number).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp as mf

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Toy(nn.Module):
    """A dense linear, then this expert-parallel rank's own expert (allreduce=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 5)
        self.expert = nn.Linear(5, 7)
        for param in self.expert.parameters():
            param.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(self.dense(x))


def _model(ep_rank: int) -> Toy:
    torch.manual_seed(0)
    model = Toy()
    with torch.no_grad():  # each expert-parallel rank holds a different expert
        for param in model.expert.parameters():
            param.mul_(1.0 + ep_rank)
    return model


def _expected(rank: int, world: int, x: torch.Tensor, norm_type: float) -> tuple[float, dict]:
    """The norm from whole gradients: dense averaged over all ranks, each expert's summed
    over its expert data-parallel ranks / dp (the engine's scaling), gathered by hand."""
    model = _model(rank % 2)
    model(x).sum().backward()
    grads = {n: p.grad / world for n, p in model.named_parameters()}
    for name in ("dense.weight", "dense.bias"):
        dist.all_reduce(grads[name])
    everyone = [None] * world
    dist.all_gather_object(everyone, {n: g for n, g in grads.items() if n.startswith("expert")})
    experts = [sum(everyone[r][n] for r in range(world) if r % 2 == e) for e in (0, 1)
               for n in ("expert.weight", "expert.bias")]
    pieces = [grads["dense.weight"], grads["dense.bias"], *experts]
    if math.isinf(norm_type):
        return max(float(t.abs().max()) for t in pieces), grads
    return float(sum(t.pow(2).sum() for t in pieces).sqrt()), grads


def clip_worker(rank, world, *, strategy, norm_type):
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    expected, _ = _expected(rank, world, x, norm_type)
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    model = mf.fully_shard_model(_model(rank % 2), expt_device_mesh=experts, zero_dp_strategy=strategy)
    model(x).sum().backward()
    before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}  # this rank's pieces
    with pytest.raises(RuntimeError, match="same mesh"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type)
    max_norm = expected / 4  # clips: coefficient about 1/4
    total = model.clip_grad_norm_(max_norm, norm_type)
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    scaled = max(((p.grad.to_local() - before[n] * coef).abs().sum().item() for n, p in model.named_parameters()), default=0.0)
    return float(total), expected, scaled


@pytest.mark.parametrize("strategy, norm_type", [(s, 2.0) for s in STRATEGIES]
                         + [("no_shard", math.inf), ("optim_grads_params", math.inf)])
def test_clip_grad_norm_counts_every_expert_once(pool4, strategy, norm_type):
    for total, expected, scaled in pool4.run(clip_worker, strategy=strategy, norm_type=norm_type):
        assert abs(total - expected) <= 1e-5 * expected, (total, expected)
        assert scaled <= 1e-6, scaled
