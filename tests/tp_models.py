"""A small transformer-like model, its torchtitan-style tensor-parallel plan, and the
one-process reference the tensor-parallel tests train against."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

VOCAB, D, SEQ = 16, 8, 8  # SEQ divisible by the TP size (sequence parallelism splits it)


class TPBlock(nn.Module):
    """Pre-norm SwiGLU MLP block (w1, w3 column-parallel, w2 row-parallel)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, 2 * d)
        self.w3 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d)
        self.recompute: str = ""

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.recompute:  # "reentrant" or "non-reentrant" activation checkpointing
            return x + checkpoint(self._mlp, h, use_reentrant=self.recompute == "reentrant")
        return x + self._mlp(h)


class TPNet(nn.Module):
    def __init__(self, depth: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(depth))
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def apply_tp_plan(model: TPNet, tp_mesh: DeviceMesh, *, sp: bool) -> TPNet:
    """torchtitan's order: the plan per block, then the embedding, final norm and head.
    With ``sp`` the activations between blocks are split along the sequence."""
    seq = Shard(1) if sp else Replicate()
    tied = model.out.weight is model.emb.weight
    for block in model.blocks:
        plan = {
            "w1": ColwiseParallel(input_layouts=seq),
            "w3": ColwiseParallel(input_layouts=seq),
            "w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    plan_embedding_and_head(model, tp_mesh, sp=sp)
    if tied:  # both Shard(0) over the vocabulary: one DTensor parameter again
        model.out.weight = model.emb.weight
    return model


def plan_embedding_and_head(model: nn.Module, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    """The plan of ``model.emb`` (vocabulary-parallel), ``model.norm`` (sequence-parallel with
    ``sp``) and ``model.out`` (column-parallel, logits gathered)."""
    seq = Shard(1) if sp else Replicate()
    top = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "out": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)


@dataclasses.dataclass(frozen=True)
class Layout:
    """outer x dp x tp, tp fastest (Megatron-LM's rank order)."""

    dp: int
    tp: int
    outer: int = 1

    def mesh(self) -> DeviceMesh:
        if self.outer > 1:
            return init_device_mesh("cpu", (self.outer, self.dp, self.tp), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        return init_device_mesh("cpu", (self.dp, self.tp), mesh_dim_names=("dp_shard", "tp"))

    @property
    def replicas(self) -> int:
        return self.dp * self.outer

    def wrap_kwargs(self, mesh: DeviceMesh) -> dict:
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        if self.outer > 1:  # upstream's HSDP arguments: the outer dim and the whole data-parallel group
            kwargs["dp_outer_dim"] = "dp_outer"
            kwargs["hybrid_fsdp_group"] = mesh[("dp_outer", "dp_shard")]._flatten().get_group()
        return kwargs

    def replica_rank(self, mesh: DeviceMesh) -> int:
        """This rank's data-parallel index (the batch slice it trains on)."""
        shard = mesh["dp_shard"].get_local_rank()
        return (mesh["dp_outer"].get_local_rank() * self.dp if self.outer > 1 else 0) + shard


def batches(steps: int, replicas: int, micro: int, mbs: int = 2, seed: int = 1) -> list[torch.Tensor]:
    """Per step the global batch: (replicas * micro * mbs, SEQ + 1) tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (replicas * micro * mbs, SEQ + 1), generator=g) for _ in range(steps)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def train_reference(model: nn.Module, data: list[torch.Tensor], *, opt: str, clip: float, micro: int,
                    replicas: int) -> list[float]:
    """One process on the global batch: the mean loss of every micro batch of every
    replica. Returns the gradient norm of each step."""
    optimizer = make_optimizer(opt, model.parameters())
    norms = []
    for tokens in data:
        optimizer.zero_grad()
        chunks = tokens.chunk(replicas * micro)
        for chunk in chunks:
            (lm_loss(model(chunk[:, :-1]), chunk[:, 1:]) / len(chunks)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        optimizer.step()
    return norms
