"""The optimizer of ``--optimizer muon``: Muon on the hidden weight matrices, AdamW on
everything else, in one ``torch.optim.Optimizer`` (so the LR schedule, clipping,
checkpoints and megatron_fsdp's step hooks see one optimizer, as Megatron-LM's
ChainedOptimizer of the two looks to its training loop).

Which parameter gets what (Megatron-LM's ``_is_muon_excluded``): Muon for every 2-D
weight that is not marked ``is_embedding_or_output_parameter`` (nor ``use_muon=False``)
-- attention and MLP projections, each expert's matrices, the router, the shared
expert's gate, and a learned position table (megatron-core marks only the word
embedding and the output layer); AdamW with the ``--adam-*`` flags for the word
embedding, the output layer, norms and biases. Both follow the LR schedule; Muon's
matrices always take ``--weight-decay`` (they are neither biases nor 1-D).

[Note: Muon on flat pieces] Under ``--use-distributed-optimizer`` megatron_fsdp's
``optim`` strategy gives each rank a flat 1-D piece of every main weight, gradient
and optimizer state (piece_dtensor.py [Note: flat pieces]). Weight decay, the
momentum and Nesterov's mix are elementwise and run on the pieces (the momentum stays
sharded, as Adam's moments do); only the orthogonalisation needs the whole matrix.
Megatron-LM's layer-wise distributed optimizer gives each weight to one rank, which
steps it whole; here each sharded weight has an owner rank too (``assign_owners``:
largest Newton-Schulz cost first, to the least loaded rank), and per bucket of
weights:

    every rank   zero-filled flat (numel,) fp32 buffer with its piece of U written in
    reduce       to the owner: the sum of disjoint pieces is U itself, exactly
    owner        NS(U) * scale * extra, written back into the buffer
    broadcast    from the owner; every rank subtracts lr x its slice from its piece

Every rank runs the same collectives in the same order (gradient presence is the same
on every rank: [Note: gradient presence] in param_and_grad_buffer.py). The numbers are
those of a single process (the owner orthogonalises the same fp32 matrix). With whole
weights (PyTorch DDP, ``no_shard``) every rank orthogonalises every matrix, as
Megatron-LM's Muon without the distributed optimizer does.

The engine runs elementwise optimizers on the plain local pieces
(optimizer.py [Note: local pieces]); this class vouches for itself
(``megatron_fsdp_elementwise``) because it handles the one whole-matrix step above
itself, with each piece's place recorded when it is built (``MatrixLayout``, by
position in its param group, which the engine's swap keeps).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adam import adam

from ...optimizer import FLAT_START_ATTR, is_flat_piece
from .muon import FusedRows, MuonConfig

logger = logging.getLogger(__name__)

EXCHANGE_BUCKET_NUMEL = 1 << 26
"""Elements (fp32) of whole matrices a sharded step gathers at once: bounds the
temporary memory to ~256 MiB plus the largest matrix."""


def uses_muon(param: torch.Tensor) -> bool:
    """Megatron-LM's routing: Muon for 2-D weights other than the embedding and output
    layer (and those marked ``use_muon=False``); AdamW for the rest."""
    return (param.dim() == 2 and getattr(param, "use_muon", True)
            and not getattr(param, "is_embedding_or_output_parameter", False))


# -- where each Muon matrix lives -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PieceLayout:
    """This rank's flat piece of a sharded weight."""

    start: int
    """Offset of the piece in the weight's flat (row-major) order."""
    numel: int
    group: dist.ProcessGroup
    """The ranks whose pieces make up the weight."""
    owner: int
    """Rank in ``group`` that orthogonalises the whole matrix."""


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    shape: torch.Size
    """The whole weight's (rows = out, cols = in)."""
    fused: Optional[FusedRows]
    """Projections orthogonalised apart (the QKV split), or None."""
    piece: Optional[PieceLayout]
    """None: this rank holds the whole weight."""


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz step on a (rows, cols) matrix, up to a constant."""
    rows, cols = shape
    return rows * cols * min(rows, cols)


def assign_owners(costs: Sequence[int], size: int) -> list[int]:
    """Owner rank (0..size-1) of each matrix: the costliest first, each to the rank with
    the least cost so far (the lowest rank on ties). Deterministic: every rank computes
    the same assignment from the same shapes."""
    load = [0] * size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += costs[index]
    return owners


def _shard_group(param: DTensor) -> dist.ProcessGroup:
    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(dims) != 1:
        raise NotImplementedError(
            f"Muon on a weight of shape {tuple(param.shape)} sharded over mesh dimensions {dims} "
            f"(placements {param.placements}): only one sharded data-parallel dimension is implemented (the "
            "distributed optimizer without HSDP); drop --num-distributed-optimizer-instances or --use-megatron-fsdp")
    return param.device_mesh.get_group(dims[0])


def matrix_layouts(params: Sequence[torch.Tensor], fused: Mapping[torch.Tensor, FusedRows]) -> list[MatrixLayout]:
    """The layout of each of ``params`` (2-D weights, whole or megatron_fsdp flat pieces),
    with owners assigned per process group."""
    fused_by_id = {id(p): split for p, split in fused.items()}  # tensors hash by identity; no __eq__ calls
    pieces: dict[dist.ProcessGroup, list[int]] = {}
    rows: list[tuple[torch.Size, Optional[FusedRows], Optional[tuple[int, int, dist.ProcessGroup]]]] = []
    for index, param in enumerate(params):
        if param.dim() != 2:
            raise ValueError(f"Muon orthogonalises matrices, but was given a parameter of shape {tuple(param.shape)}; "
                             "route it to AdamW (uses_muon)")
        split = fused_by_id.get(id(param))
        if split is not None and split.rows != param.shape[0]:
            raise ValueError(f"a fused weight of shape {tuple(param.shape)} does not split as {split}")
        place = None
        if is_flat_piece(param):
            group = _shard_group(param)
            place = (getattr(param, FLAT_START_ATTR), param._local_tensor.numel(), group)
            pieces.setdefault(group, []).append(index)
        rows.append((param.shape, split, place))
    owner_of: dict[int, int] = {}
    for group, indices in pieces.items():
        costs = [newton_schulz_cost(params[i].shape) for i in indices]
        owner_of.update(zip(indices, assign_owners(costs, dist.get_world_size(group))))
    return [MatrixLayout(shape=shape, fused=split,
                         piece=None if place is None else PieceLayout(*place, owner=owner_of[i]))
            for i, (shape, split, place) in enumerate(rows)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor an in-place update must touch (a DTensor's local data)."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclasses.dataclass
class _Pending:
    """One matrix's step after its elementwise part: subtract lr x the update."""

    layout: MatrixLayout
    param: torch.Tensor
    """Local data: the whole weight, or this rank's flat piece."""
    update: torch.Tensor
    """U (after momentum and Nesterov), shaped like ``param``."""
    lr: float


# -- the optimizer ------------------------------------------------------------------------
class MuonAdamW(torch.optim.AdamW):
    """Muon for the param groups marked ``use_muon`` (2-D weights only), AdamW (torch's
    own kernel, the same numbers as ``torch.optim.AdamW``) for the others.

    ``fused_rows`` maps fused weights (the QKV projection) to their projections
    (``FusedRows``); ``muon`` holds the Muon flags. A Muon group's ``momentum`` key
    (default ``muon.momentum``) is saved with the state dict as Adam's ``betas`` are;
    its state is ``momentum_buffer``, shaped like the weight."""

    megatron_fsdp_elementwise = True
    """[Note: Muon on flat pieces]: run on the local pieces; the whole-matrix step is ours."""

    def __init__(self, params: Any, *, muon: MuonConfig,
                 fused_rows: Optional[Mapping[torch.Tensor, FusedRows]] = None,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.muon = muon
        self.layouts: list[Optional[list[MatrixLayout]]] = []
        """Per param group: each Muon weight's layout, by position (None: an AdamW group)."""
        for group in self.param_groups:
            group.setdefault("use_muon", False)
            if group["use_muon"]:
                group.setdefault("momentum", muon.momentum)
                self.layouts.append(matrix_layouts(group["params"], fused_rows or {}))
            else:
                self.layouts.append(None)
        self.register_load_state_dict_pre_hook(_check_loaded_groups)

    def __setstate__(self, state: dict) -> None:
        # Adam's __setstate__ (load_state_dict, unpickling) reads every state's "step";
        # Muon's momentum states have none, so they bypass it.
        everything = state["state"]
        muon = {p: s for p, s in everything.items() if "momentum_buffer" in s}
        super().__setstate__({**state, "state": defaultdict(dict, {p: s for p, s in everything.items()
                                                                  if p not in muon})})
        self.state.update(muon)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "layouts", None) is not None:  # after __init__: the layouts are positional
            raise NotImplementedError("MuonAdamW: param groups are fixed at construction; build a new optimizer")
        super().add_param_group(param_group)

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        """Adam's lazy state for AdamW groups; Muon's momentum buffer (zeros, like the
        weight) for the others. The signature is Adam's, which megatron_fsdp's eager
        state creation (optimizer.py ``init_optimizer_state``) calls."""
        if not group["use_muon"]:
            return super()._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                       state_steps)
        for p in group["params"]:
            if p.grad is not None and "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded: list[_Pending] = []
        for group, layouts in zip(self.param_groups, self.layouts):
            if layouts is None:
                self._adam_step(group)
                continue
            if len(layouts) != len(group["params"]):
                raise RuntimeError(f"MuonAdamW: a Muon group holds {len(group['params'])} parameters, built with "
                                   f"{len(layouts)}; param groups are fixed at construction")
            for p, layout in zip(group["params"], layouts):
                item = self._momentum_step(p, layout, group)
                if item is None:
                    continue
                if layout.piece is not None:
                    sharded.append(item)
                else:  # whole: at once, so at most one Nesterov temporary lives
                    orth = self.muon.orthogonalize(item.update.view(layout.shape), layout.fused)
                    item.param.add_(orth.view_as(item.param), alpha=-item.lr)
        exchange_and_update(sharded, self.muon)
        return loss

    def _adam_step(self, group: dict) -> None:
        """One AdamW group, exactly as ``torch.optim.Adam.step`` runs it (not by calling
        it: it may carry the step hooks of other AdamW instances, which would run ours twice)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])

    def _momentum_step(self, p: torch.Tensor, layout: MatrixLayout, group: dict) -> Optional[_Pending]:
        """Weight decay, momentum and Nesterov's mix of one Muon weight, elementwise on
        its local data; returns what is left to orthogonalise (None without a gradient)."""
        if p.grad is None:
            return None
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        weight, grad, momentum = _local(p), _local(p.grad), _local(state["momentum_buffer"])
        expected = layout.piece.numel if layout.piece is not None else layout.shape.numel()
        if weight.numel() != expected:
            raise RuntimeError(f"MuonAdamW: a weight of shape {tuple(layout.shape)} holds {weight.numel()} local "
                               f"elements here, built with {expected}")
        if wd != 0.0:
            weight.add_(weight, alpha=-lr * wd)  # decoupled, before the update (upstream's order)
        momentum.lerp_(grad, 1 - beta)
        update = grad.lerp(momentum, beta) if self.muon.nesterov else momentum
        return _Pending(layout=layout, param=weight, update=update, lr=lr)


def _check_loaded_groups(optimizer: MuonAdamW, state_dict: dict) -> None:
    """A state dict of another optimizer (an AdamW run's) would load its groups'
    settings over ours and silently turn Muon off: refused before anything loads."""
    saved = [bool(g.get("use_muon", False)) for g in state_dict.get("param_groups", [])]
    ours = [g["use_muon"] for g in optimizer.param_groups]
    if saved != ours:
        raise ValueError(
            f"the optimizer state to load has param groups with Muon {saved}, this --optimizer muon run {ours}: it "
            "was saved by another optimizer (or another model); add --no-load-optim to start the optimizer fresh")


# -- the sharded step -------------------------------------------------------------------------
def exchange_and_update(pending: Sequence[_Pending], muon: MuonConfig,
                        bucket_numel: int = EXCHANGE_BUCKET_NUMEL) -> None:
    """[Note: Muon on flat pieces] Orthogonalise sharded matrices on their owners and
    apply each rank's slice of the result, a bucket of matrices at a time."""
    start = 0
    while start < len(pending):
        end, total = start, 0
        while end < len(pending) and (end == start or total + pending[end].layout.shape.numel() <= bucket_numel):
            total += pending[end].layout.shape.numel()
            end += 1
        _exchange_bucket(pending[start:end], muon)
        start = end


def _exchange_bucket(bucket: Sequence[_Pending], muon: MuonConfig) -> None:
    buffers, handles = [], []
    for item in bucket:
        piece = item.layout.piece
        full = torch.zeros(item.layout.shape.numel(), dtype=torch.float32, device=item.param.device)
        full[piece.start:piece.start + piece.numel].copy_(item.update.reshape(-1))
        handles.append(dist.reduce(full, op=dist.ReduceOp.SUM, group=piece.group, group_dst=piece.owner,
                                   async_op=True))
        buffers.append(full)
    for handle in handles:
        handle.wait()
    handles = []
    for item, full in zip(bucket, buffers):
        piece = item.layout.piece
        if dist.get_rank(piece.group) == piece.owner:
            full.copy_(muon.orthogonalize(full.view(item.layout.shape), item.layout.fused).reshape(-1))
        handles.append(dist.broadcast(full, group=piece.group, group_src=piece.owner, async_op=True))
    for handle in handles:
        handle.wait()
    for item, full in zip(bucket, buffers):
        piece = item.layout.piece
        item.param.add_(full[piece.start:piece.start + piece.numel].to(item.param.dtype), alpha=-item.lr)


# -- the launcher's wiring -----------------------------------------------------------------------
_EMBEDDED_QKV = re.compile(r"(^|\.)attn\.qkv\.weight$")
"""The embedded GPT's fused projection (models/transformer.py ``CausalSelfAttention.qkv``)."""
_MCORE_QKV = "linear_qkv.weight"
"""megatron-core's, matched as Megatron-LM matches it (a substring of the name)."""


def qkv_split(name: str, args) -> Optional[FusedRows]:
    """The query/key/value (/gate) projections of a fused QKV weight named ``name``, in
    the layout of the model that names it that way, or None for any other weight."""
    heads, groups, channels = args.num_attention_heads, args.num_query_groups, args.kv_channels
    gate = bool(args.attention_output_gate)
    if _EMBEDDED_QKV.search(name):  # one block [q | k | v | gate]
        q, kv = heads * channels, groups * channels
        return FusedRows(blocks=1, pieces=(q, kv, kv) + ((q,) if gate else ()))
    if _MCORE_QKV in name:  # per key/value group [q | gate | k | v]
        q = heads // groups * channels
        return FusedRows(blocks=groups, pieces=(q,) + ((q,) if gate else ()) + (channels, channels))
    return None


def build_muon_optimizer(model: nn.Module, groups: list[dict], args) -> MuonAdamW:
    """``build_optimizer``'s param groups (weight decay and decoupled-LR buckets), each
    split into its Muon matrices and its AdamW rest."""
    names = {id(p): n for n, p in model.named_parameters()}
    split_groups, fused_rows = [], {}
    for group in groups:
        muon = [p for p in group["params"] if uses_muon(p)]
        rest = [p for p in group["params"] if not uses_muon(p)]
        settings = {k: v for k, v in group.items() if k != "params"}
        if muon:
            split_groups.append({**settings, "params": muon, "use_muon": True})
        if rest:
            split_groups.append({**settings, "params": rest, "use_muon": False})
        for p in muon:
            split = qkv_split(names.get(id(p), ""), args)
            if split is not None:
                fused_rows[p] = split
    if not any(g["use_muon"] for g in split_groups):
        logger.warning("--optimizer muon: the model has no 2-D weight for Muon; every parameter trains with AdamW")
    return MuonAdamW(split_groups, muon=MuonConfig.from_args(args), fused_rows=fused_rows, lr=args.lr,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
