"""Context parallelism (CP) for the embedded GPT, with Megatron-LM's semantics: the ranks of
a CP group share every sequence, each holding two of its 2 x CP chunks, and together compute
exactly what the whole model computes for the whole sequence.

    tokens, labels, loss_mask (b, T)  --context_parallel_shard-->  (b, T / CP) on each CP rank
    apply_context_parallel(model, cp_mesh)       # in place, before FSDP (and after TP)
    logits = model(tokens_local)                 # (b, T / CP, vocab): the whole model's, for these tokens
    loss = context_parallel_loss(logits, labels_local, cp_mesh.get_group(), loss_mask_local)
    loss.backward()                              # FSDP averages the gradients over data x context ranks

[Note: load-balanced split] Causal attention makes late tokens dearer than early ones (a
token attends to every token before it), so a plain split in CP pieces would leave the last
rank most of the work. As Megatron-LM's ``get_batch_on_this_cp_rank``, the sequence is cut
into 2 x CP equal chunks and CP rank r holds chunks r and 2 x CP - 1 - r: one early, one late,
the same work on every rank. The length must be a multiple of 2 x CP (Megatron-LM asserts
``seq_length % (2 * context_parallel_size) == 0``); pad the sequences otherwise.

[Note: context-parallel attention] Every attention layer all-gathers the keys and values of
the CP group in one collective (K and V, after RoPE and the q/k norms, concatenated along the
channels; the key/value groups, not the query heads, so GQA sends g/h of the bytes), puts them
in position order, and lets its T / CP local queries attend to all T keys under the causal
mask of their global positions. Backward is the matching reduce-scatter (a sum): each rank
gets the gradient the whole group's queries send to its own keys and values. Per layer and
micro-batch: forward 1 all-gather, backward 1 reduce-scatter (full recomputation replays the
forward in backward: one all-gather more); ``kv_exchange_counts`` reports them. Cost per
layer: each rank receives (CP - 1) / CP of the sequence's K/V, 2 x b x g x T x d elements,
in forward and sends as much in backward, and holds the whole sequence's K/V (and their
gradient in backward) while the layer runs and as saved activations: O(T), where the local
queries, scores and outputs are O(T / CP). The alternative, a ring (TransformerEngine's and
Megatron-LM's default ``p2p`` exchange, torch's ``context_parallel``): CP - 1 point-to-point
steps of K/V blocks overlapped with the block attentions, merged by online softmax (the
running log-sum-exp), holding O(T / CP) of K/V at a time -- less memory and hidden
communication, at the price of a hand-written attention kernel and its backward. The gather
is TransformerEngine's ``all_gather`` CP mode, the simple exact one; the masked attention
computes all T / CP x T scores (half of them masked), which the load-balanced split keeps
equal across ranks.

[Note: context-parallel loss] Megatron-LM's rule for a loss averaged over tokens: each CP
rank sums its token losses (times the loss mask), the token count is summed over the CP group,
and the rank backpropagates ``local_sum / group_count * CP``; the engine's gradient average
over the data x context ranks then divides the CP factor out again, so the gradient is that
of each data-parallel rank's micro-batch mean, averaged over the data-parallel ranks -- what
data parallelism alone computes, whatever the loss mask (``context_parallel_loss``). This is
Megatron-LM's rule through core 0.12: ``pretrain_gpt.loss_func`` all-reduces [sum, count] over
the CP group and the schedule multiplies by ``context_parallel_world_size``. From core 0.13 on
(the pinned commit too) each CP rank divides its sum by its own count, which gives the same
gradient when the CP ranks count the same number of tokens (no loss mask) and a mean of
per-rank means otherwise.
``--calculate-per-token-loss`` (``context_parallel_token_loss``): each rank backpropagates
its local sum; the engine (``calculate_per_token_loss=True``) sums the gradients over the
data x context ranks and the training loop divides them by the global batch's token count,
the local counts summed over every data x context rank.

Refused (``context_parallel_problems``): multi-token prediction (its shifted labels and
embeddings cross chunk borders) and attention dropout (each rank would draw its own masks).
Mixture-of-experts layers are told the CP group (``MoELayer.set_context_parallel_group``):
their balancing losses count the whole sequences' tokens (router.py).
Multi-latent attention, learned positions, RoPE (any layout, partial) and YaRN are supported;
hidden dropout too (per-token masks, drawn per rank as under data parallelism).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from .config import GPTConfig
from .gpt import GPT
from .losses import token_cross_entropy

__all__ = [
    "CollectiveCounts",
    "ContextParallelLayout",
    "KeyValueGather",
    "apply_context_parallel",
    "check_sequence_length",
    "context_parallel_loss",
    "context_parallel_positions",
    "context_parallel_problems",
    "context_parallel_shard",
    "context_parallel_token_loss",
    "kv_exchange_counts",
]


# -- the split ([Note: load-balanced split]) --------------------------------------------------
def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """ValueError unless ``seq_len`` splits into 2 x ``cp_size`` equal chunks."""
    if cp_size < 1 or seq_len % (2 * cp_size):
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split over {cp_size} context-parallel ranks: the length must "
            f"be a multiple of 2 x context-parallel size = {2 * cp_size} (each rank holds two of {2 * cp_size} equal "
            "chunks, as Megatron-LM requires); pad or trim the sequences to such a length")


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a context-parallel group of {cp_size}; pass 0 .. "
                         f"{cp_size - 1}")


def context_parallel_shard(tensor: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's share of ``tensor`` along ``seq_dim`` (length T): chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of 2 x cp_size, concatenated (length T / cp_size). For tokens,
    labels, loss masks, position ids."""
    _check_rank(cp_rank, cp_size)
    check_sequence_length(tensor.shape[seq_dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=seq_dim)


def context_parallel_positions(seq_len: int, cp_rank: int, cp_size: int,
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """(seq_len / cp_size,) int64: the global positions of this CP rank's tokens."""
    return context_parallel_shard(torch.arange(seq_len, device=device), cp_rank, cp_size, seq_dim=0)


def _in_position_order(parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Every rank's share (rank order) -> the whole sequence along ``seq_dim``: rank r's first
    half is chunk r, its second half chunk 2 x CP - 1 - r."""
    halves = [part.chunk(2, dim=seq_dim) for part in parts]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim=seq_dim)


# -- the layout and the K/V exchange ([Note: context-parallel attention]) -----------------------
@dataclasses.dataclass(kw_only=True)
class CollectiveCounts:
    """Collectives one attention layer issued over its CP group since the last ``reset``."""

    all_gathers: int = 0
    """Forward: one per layer and forward (K and V together)."""
    reduce_scatters: int = 0
    """Backward: the K/V gradient, one per layer and backward."""
    gathered_bytes: int = 0
    """The all-gathers' outputs (the whole sequence's K/V)."""
    scattered_bytes: int = 0
    """The reduce-scatters' inputs."""

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = self.gathered_bytes = self.scattered_bytes = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextParallelLayout:
    """The CP group a model's sequences are shared over (``gpt.SequenceSplit``)."""

    group: dist.ProcessGroup
    rank: int
    """This rank's index in ``group``."""
    size: int

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """(local_length,) the global positions of a share of ``local_length`` tokens."""
        if local_length % 2:
            raise ValueError(
                f"{local_length} tokens on context-parallel rank {self.rank}: a rank's share is two equal chunks, so "
                f"an even number; pass context_parallel_shard(tokens, {self.rank}, {self.size}) of sequences whose "
                f"length is a multiple of {2 * self.size}")
        return context_parallel_positions(local_length * self.size, self.rank, self.size, device)


class _AllGatherSequence(torch.autograd.Function):
    """x (this rank's) -> (CP, *x.shape), every rank's x in rank order. Backward: the
    gradient summed over the group and scattered, each rank keeping its own piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, counts: CollectiveCounts, label: str):
        ctx.group, ctx.counts, ctx.label = group, counts, label
        flat = x.contiguous().view(-1)  # flat buffers: every backend takes (CP x n,) from (n,)
        out = flat.new_empty(size * flat.numel())
        with record_function(f"megatron_fsdp::cp_all_gather:{label}"):
            _all_gather(out, flat, group)
        counts.all_gathers += 1
        counts.gathered_bytes += out.numel() * out.element_size()
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat = grad.contiguous().view(-1)
        mine = flat.new_empty(flat.numel() // grad.shape[0])
        with record_function(f"megatron_fsdp::cp_reduce_scatter:{ctx.label}"):
            _reduce_scatter(mine, flat, ctx.group)
        ctx.counts.reduce_scatters += 1
        ctx.counts.scattered_bytes += flat.numel() * flat.element_size()
        return mine.view(grad.shape[1:]), None, None, None, None


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed the flat collectives; older releases have only the old names.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, op=dist.ReduceOp.SUM, group=group)


class KeyValueGather:
    """One attention layer's exchange (``mla.SequenceGather``): x with this rank's tokens along
    ``seq_dim`` -> x of the whole sequence in position order, in one all-gather."""

    def __init__(self, layout: ContextParallelLayout, label: str) -> None:
        self.layout, self.label = layout, label
        self.counts = CollectiveCounts()

    def __call__(self, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        layout = self.layout
        if layout.size == 1:
            return x
        gathered = _AllGatherSequence.apply(x, layout.group, layout.size, self.counts, self.label)  # (CP, *x.shape)
        return _in_position_order(list(gathered.unbind(0)), seq_dim)


# -- applying it -------------------------------------------------------------------------------
def context_parallel_problems(cfg: GPTConfig, cp: int) -> list[str]:
    """Why ``apply_context_parallel`` cannot share a GPT of ``cfg``'s sequences over ``cp``
    ranks (empty: it can). Pure; for the launcher's validation too."""
    unsupported = [
        (cfg.mtp_num_layers is not None, f"multi-token prediction (mtp_num_layers={cfg.mtp_num_layers})",
         "its depths shift tokens and labels by k places, across the chunk borders of the split; train MTP models "
         "at context-parallel size 1"),
        (cfg.attention_dropout > 0, f"attention dropout (attention_dropout={cfg.attention_dropout})",
         "each rank would draw its own mask over its rows of the attention matrix, not the whole model's; set "
         "attention_dropout=0 (--attention-dropout 0)"),
    ]
    problems = [f"{name} with context parallelism: {why}" for on, name, why in unsupported if on]
    if cfg.seq_length % (2 * cp):
        problems.append(f"seq_length={cfg.seq_length} is not a multiple of 2 x context-parallel size = {2 * cp}: "
                        "each rank holds two of 2 x CP equal chunks of every sequence (Megatron-LM's rule); choose "
                        "such a seq_length")
    return problems


def apply_context_parallel(model: GPT, cp_mesh: DeviceMesh) -> GPT:
    """Share ``model``'s sequences over the 1-D mesh ``cp_mesh`` (e.g. ``ParallelDims.cp_mesh``),
    in place; returns it. Afterwards ``model(tokens)`` takes this rank's
    ``context_parallel_shard`` of the tokens (b, T / CP) and returns their logits. Every rank
    of the mesh must hold the same weights; apply before FSDP wrapping (after tensor
    parallelism). Parameters are untouched."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_context_parallel takes the embedded GPT (megatron_fsdp.models.GPT), got "
                        f"{type(model).__name__}; apply it to the unwrapped GPT, before FSDP (other models need "
                        "their own attention exchange)")
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh has {cp_mesh.ndim} dimensions {cp_mesh.mesh_dim_names}; pass the 1-D "
                         "context-parallel sub-mesh, e.g. mesh['cp']")
    if model.context_parallel is not None:
        raise ValueError("the model is context-parallel already (apply_context_parallel was called on it); apply "
                         "it once")
    problems = context_parallel_problems(model.config, cp_mesh.size())
    if problems:
        raise NotImplementedError("cannot apply context parallelism: " + "; ".join(problems))
    layout = ContextParallelLayout(group=cp_mesh.get_group(), rank=cp_mesh.get_local_rank(), size=cp_mesh.size())
    model.context_parallel = layout
    for i, block in enumerate(model.blocks):
        block.attn.context_parallel = KeyValueGather(layout, f"blocks.{i}.attn")
    for layer in model.moe_layers():
        layer.set_context_parallel_group(layout.group)
    return model


def kv_exchange_counts(model: nn.Module) -> dict[str, CollectiveCounts]:
    """Attention layer name -> its CP collectives (``CollectiveCounts``), for the layers of a
    context-parallel model (wrapped or not)."""
    return {name: module.context_parallel.counts for name, module in model.named_modules()
            if isinstance(getattr(module, "context_parallel", None), KeyValueGather)}


# -- the loss ([Note: context-parallel loss]) ----------------------------------------------------
def context_parallel_token_loss(logits: torch.Tensor, labels: torch.Tensor,
                                loss_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (b, t, vocab), labels and loss_mask (b, t) of this rank's tokens -> (the fp32 sum
    of their masked cross-entropy, the count of counted tokens (int64, no gradient)). The
    ``--calculate-per-token-loss`` form: backpropagate the sum; the gradients are summed over
    the data x context ranks and divided by the global count by the training loop."""
    losses = token_cross_entropy(logits, labels)  # (b, t), fp32
    if loss_mask is None:
        return losses.sum(), torch.tensor(labels.numel(), dtype=torch.int64, device=losses.device)
    if loss_mask.shape != labels.shape:
        raise ValueError(f"loss_mask of shape {tuple(loss_mask.shape)} for labels of shape {tuple(labels.shape)}; "
                         "shard both alike (context_parallel_shard)")
    mask = loss_mask.float()
    return (losses * mask).sum(), mask.sum().detach().round().to(torch.int64)


def context_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, cp_group: Optional[dist.ProcessGroup],
                          loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The value to backpropagate: this rank's masked loss sum / the micro-batch's token count
    (summed over ``cp_group``) x CP. After the engine averages gradients over the data x
    context ranks, they are the gradient of each data-parallel rank's micro-batch token mean,
    averaged over the data-parallel ranks ([Note: context-parallel loss]). One all-reduce of
    the count over ``cp_group``. The micro-batch's mean loss is this value summed over the
    CP ranks, divided by CP (for logging)."""
    local_sum, local_count = context_parallel_token_loss(logits, labels, loss_mask)
    count = local_count.to(torch.float64)
    with record_function("megatron_fsdp::cp_all_reduce:token_count"):
        dist.all_reduce(count, group=cp_group)
    cp = dist.get_world_size(cp_group)
    return local_sum / count.clamp(min=1).to(local_sum.dtype) * cp
