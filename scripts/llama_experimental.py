"""A Llama-style model sharded per block with ``megatron_fsdp.experimental``, in
torchtitan's shape: build on the meta device, ``parallelize_llama`` (one
``fully_shard`` per block, then the root), initialise the sharded weights with
``reset_parameters``, and train on the launcher's data path
(``megatron_fsdp.training.data``: the byte-level corpus in ``data/``).

    torchrun --nproc-per-node 2 scripts/llama_experimental.py --steps 20
    torchrun --nproc-per-node 2 scripts/llama_experimental.py --bf16 --microbatches 2
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from megatron_fsdp import MixedPrecisionPolicy
from megatron_fsdp.experimental import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)
from megatron_fsdp.training import data

logger = logging.getLogger("llama_experimental")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 256
    """Byte-level tokens, as the launcher's corpus."""
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 384
    seq_length: int = 64

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into {self.n_heads} heads of even size (RoPE pairs)")


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim), computed on the fly."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * freqs  # (seq, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)  # (b, heads, s, hd)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize_llama(model: Llama, mesh, *, bf16: bool = False):
    """Shard each block, then the root (embeddings, final norm, output head)."""
    zero3 = Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
    if bf16:
        model.to(torch.bfloat16)  # compute in bf16; fp32 main weights, bf16 main grads
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32)
    with fully_shard_context() as context:
        for block in model.layers:
            fully_shard(block, mesh=mesh, placements=zero3, mixed_precision_policy=policy)
        fully_shard(model, mesh=mesh, placements=zero3, mixed_precision_policy=policy)
    return context


def init_weights(model: nn.Module, seed: int) -> None:
    """Meta-device init: each module's reset_parameters writes its sharded weights."""
    torch.manual_seed(seed)
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def train(model, context, source, *, steps, micro_batch_size, microbatches, lr, rank, world, device,
          adam_eps: float = 1e-8) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=adam_eps, weight_decay=0.1)
    fully_shard_optimizer(optimizer)
    layout = data.BatchLayout(micro_batch_size=micro_batch_size, num_microbatches=microbatches,
                              dp_rank=rank, dp_size=world)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for m in range(microbatches):
            inputs, targets = data.get_microbatch(source, layout, step * layout.global_batch_size, m, device)
            with microbatch(context, is_last=m == microbatches - 1):
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / microbatches
                loss.backward()
            total += loss.detach()
        optimizer.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    cfg = LlamaConfig()
    with torch.device("meta"):
        model = Llama(cfg)
    context = parallelize_llama(model, mesh, bf16=args.bf16)
    init_weights(model, args.seed)
    tokens = data.load_corpus_tokens(None)
    windows, _, _ = data.split_windows(tokens.numel(), cfg.seq_length, [98.0, 2.0, 0.0])
    source = data.TextDataset(tokens, windows, cfg.seq_length, args.seed)
    losses = train(model, context, source, steps=args.steps, micro_batch_size=args.micro_batch_size,
                   microbatches=args.microbatches, lr=args.lr, rank=rank, world=world, device=device)
    if rank == 0:
        for step in range(0, len(losses), 5):
            logger.info("step %3d  loss %.4f", step, losses[step])
        logger.info("step %3d  loss %.4f", len(losses) - 1, losses[-1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
