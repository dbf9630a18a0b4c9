"""Small models and a single-process reference trainer shared by the tests."""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IN, OUT, VOCAB = 5, 3, 11


class Block(nn.Module):
    """Residual MLP block; sizes chosen so nothing divides evenly by 2 or 4."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d + 1)
        self.fc2 = nn.Linear(2 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class SkipNet(nn.Module):
    """Net with blocks a step may skip (``skip``: block indices, or a function of the
    rank) and a head no forward ever uses."""

    def __init__(self, d: int = 7, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.unused = nn.Linear(d, OUT)
        self.out = nn.Linear(d, OUT)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                h = block(h)
        return self.out(h)


class Net(nn.Module):
    def __init__(self, d: int = 7, depth: int = 3, recompute: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, OUT)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.recompute else block(h)
        return self.out(h)


class TiedNet(nn.Module):
    """Token model whose output head shares the embedding matrix (two units use it)."""

    def __init__(self, d: int = 7, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(kind: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "net":
        return Net(**kwargs)
    if kind == "tied":
        return TiedNet(**kwargs)
    raise ValueError(kind)


def make_batches(kind: str, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "tied":
        return [
            (torch.randint(0, VOCAB, (batch, 3), generator=g), torch.randint(0, VOCAB, (batch, 3), generator=g))
            for _ in range(steps)
        ]
    return [(torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)) for _ in range(steps)]


def loss_fn(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "tied":
        return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
    return F.mse_loss(output, target)


def make_optimizer(name: str) -> Callable:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.0)
    if name == "sgd_momentum":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adamw":
        # eps=1e-4: Adam amplifies reduction-order noise in near-zero gradients.
        return lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)
    raise ValueError(name)


def backward_microbatches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int,
                          microbatches: int = 1, dtype: Optional[torch.dtype] = None) -> None:
    """Forward/backward this rank's share of a global batch of the "net" model in
    ``microbatches`` pieces, all but the last under ``model.no_sync()``, with the
    loss averaged over the pieces (so the gradient equals the whole share's)."""
    xs, ys = x.chunk(world)[rank].chunk(microbatches), y.chunk(world)[rank].chunk(microbatches)
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        if dtype is not None:
            xm, ym = xm.to(dtype), ym.to(dtype)
        with model.no_sync() if i < len(xs) - 1 else torch.enable_grad():
            (loss_fn("net", model(xm), ym) / len(xs)).backward()


def train_steps(model: nn.Module, opt, batches, rank: int, world: int, microbatches: int = 1) -> None:
    """A wrapped model's plain loop on this rank's shares of ``batches``."""
    for x, y in batches:
        opt.zero_grad()
        backward_microbatches(model, x, y, rank, world, microbatches)
        opt.step()


def train_reference(
    model: nn.Module, kind: str, batches, optimizer: str, freeze: Optional[Callable[[nn.Module], None]] = None
) -> nn.Module:
    """Single-process training on the whole global batch."""
    model = copy.deepcopy(model)
    if freeze:
        freeze(model)
    opt = make_optimizer(optimizer)(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(kind, model(x), y).backward()
        opt.step()
    return model


def max_param_diff(full_state: dict, reference: nn.Module) -> float:
    diffs = [(full_state[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters()]
    return max(diffs)


# -- units returning structured outputs (tests of backward_outputs.py) ----------------------------------
@dataclasses.dataclass
class BlockOutput:
    h: torch.Tensor
    aux: torch.Tensor


class Opaque:
    def __init__(self, h, aux):
        self.h, self.aux = h, aux


BlockTuple = collections.namedtuple("BlockTuple", ["h", "aux"])


class StructuredBlock(torch.nn.Module):
    """A unit returning its activation and an auxiliary loss in some container."""

    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = torch.nn.Linear(8, 8), kind

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return {"dict": lambda: {"h": h, "aux": h.sum()}, "namedtuple": lambda: BlockTuple(h, h.sum()),
                "dataclass": lambda: BlockOutput(h, h.sum()), "opaque": lambda: Opaque(h, h.sum())}[self.kind]()


class StructuredNet(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.blocks = torch.nn.ModuleList([StructuredBlock(kind) for _ in range(3)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        aux = 0.0
        for block in self.blocks:
            out = block(x)
            x, extra = (out["h"], out["aux"]) if isinstance(out, dict) else (out.h, out.aux)
            aux = aux + extra
        return self.head(x).mean() + 0.01 * aux


def structured_case(kind: str, world: int, steps: int = 3):
    """A seeded StructuredNet, its inputs, and a copy trained in one process (SGD,
    lr 0.1) on the mean of the ranks' losses: what a wrapped run must equal."""
    torch.manual_seed(0)  # every rank the same initial weights
    model = StructuredNet(kind)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4 * world, 8, generator=g) for _ in range(steps)]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in inputs:
        ref_opt.zero_grad()
        (sum(reference(part) for part in x.chunk(world)) / world).backward()
        ref_opt.step()
    return model, inputs, reference


@torch.no_grad()
def add_decay_into_grads(model: nn.Module, rate: float = 0.01) -> None:
    """A hand-written decay term added into every present ``.grad`` (before backward,
    after a zeroing that keeps gradients attached)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.add_(p, alpha=rate)

