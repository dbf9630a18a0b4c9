"""Expert parallelism (EP) for the embedded GPT's mixture of experts, with megatron-core's
semantics (``MoEAlltoAllTokenDispatcher``, dropless unless a capacity is set): the E experts of
every MoE layer are spread over the EP ranks, E / EP each, and the tokens travel to them.

    model = GPT(cfg)                                       # whole, on every rank, same seed
    mesh = init_device_mesh("cuda", (W // EP, EP), mesh_dim_names=("fsdp", "ep"))
    apply_expert_parallel(model, mesh["ep"])               # in place, before FSDP wrapping
    model = fully_shard_model(model, expt_device_mesh=mesh, ...)  # experts shard over "fsdp"

[Note: expert-parallel layout] EP rank r keeps the consecutive block of global experts
[r E / EP, (r + 1) E / EP) of every MoE layer (megatron-core's ``local_expert_indices``) and
registers each under its global index (``ExpertShard``), so parameter and state-dict names are
the expert-parallel-size-1 model's (``blocks.0.mlp.experts.5.fc.weight``): a checkpoint names
every expert once whatever the EP size, and resumes at another. The model is built whole and
the other experts are dropped, so the kept ones hold exactly the values the whole model drew.
EP groups are consecutive ranks and the ranks holding the same experts (the expert
data-parallel group, over which the engine shards and reduces them) are strided by EP:
Megatron-LM's expert rank order, global rank = expert-data-parallel rank x EP + EP rank, the
mesh above read row-major. Everything else -- attention, the router, shared experts -- stays
replicated over all ranks. An expert's gradient is summed by the engine over its expert
data-parallel ranks and divided by the whole data-parallel size, as megatron-core's
``expert_gradient_scaling_factor``: each EP rank's copy already holds the gradient of the
tokens of all EP ranks it served.

[Note: the token exchange] Per MoE layer and forward (``AllToAllDispatcher``), after the
dense router has chosen each token's experts on its own rank and ``MoELayer`` has grouped the
picks by global expert (moe.py, [Note: the routed picks]):
1. the counts: one all-to-all of the rows per expert, each rank sending every EP rank the
   counts of that rank's experts (E / EP numbers), so each learns the rows it will receive
   from each rank for each of its experts (megatron-core all-gathers the whole count matrix
   over its TP x EP group; with TP 1 this part of it is all a rank uses);
2. the dispatch: one all-to-all with uneven splits sends each rank the rows of its experts,
   the routing weight of each row riding along in the same message (the rows' and the
   weights' bytes side by side, so a wider router dtype arrives exact; megatron-core sends
   the weights in a second all-to-all). The received rows are grouped by source rank, then
   expert; they are regrouped by expert (source order kept), every local expert runs on its
   rows (on zero rows if need be, so it always gets a gradient) with the weights applied
   inside it as at EP 1, and the outputs are put back in the received order;
3. the combine: one all-to-all returns each row's output to the rank it came from, where the
   layer sums each token's picks.
Backward is the same exchanges reversed: the combine's gradient goes out with the forward's
dispatch splits, the dispatch's (rows and weights in one message) comes back with the
combine's; the counts need no backward. So per layer and micro batch: forward 3 all-to-alls
(counts, dispatch, combine), backward 2 (combine, dispatch); full recomputation replays the
forward's 3 inside backward. ``expert_exchange_counts`` reports them; each runs under a
``megatron_fsdp::ep_all_to_all:<layer>:<step>`` profiler label. gloo's ``all_to_all_single``
takes uneven splits (torch 2.13, checked by the tests), so CPU and CUDA share this path.

[Note: meta-device build of a shard] A model built under ``torch.device("meta")`` is
materialised by the engine module by module, each drawing its initial values from the random
stream in construction order; a rank that dropped experts would skip their draws and shift
every later module's values. So each ``ExpertShard`` of a meta model holds two ``InitReplay``
children, before and after its experts, that draw (and discard) the values of the experts
other ranks hold, in their places: the weights equal the whole model's, bit for bit, as an
eager build's do. The replays hold an empty non-persistent buffer only, so checkpoints do not
see them.

Refused (``expert_parallel_problems``): a model without MoE layers, E not divisible by EP, a
world size EP does not divide. Forced load balancing follows megatron-core: each EP rank draws
its noise from seed + 1024 + 100 x EP rank (forced_routing.py), so it differs from EP 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from .config import GPTConfig, MoELoadBalancing
from .forced_routing import share_stream
from .gpt import GPT
from .moe import MoELayer, RunExperts
from .router import ExpertCapacity, TokenDropPolicy

__all__ = [
    "AllToAllDispatcher",
    "ExchangeCounts",
    "ExpertParallelLayout",
    "ExpertShard",
    "apply_expert_parallel",
    "expert_exchange_counts",
    "expert_parallel_problems",
    "local_experts",
    "regroup_by_expert",
    "set_expert_capacity",
]


# -- validation and the layout ---------------------------------------------------------------
def expert_parallel_problems(cfg: GPTConfig, ep_size: int, world_size: Optional[int] = None) -> list[str]:
    """Why ``apply_expert_parallel`` cannot spread a GPT of ``cfg`` over ``ep_size`` ranks
    (empty: it can). Pure; ``world_size``: also check that EP divides it."""
    if not isinstance(ep_size, int) or ep_size < 1:
        return [f"expert-parallel size {ep_size!r} must be a positive integer (1: every rank holds every expert)"]
    experts = cfg.num_moe_experts
    if experts is None:
        return [f"expert-parallel size {ep_size} needs a mixture-of-experts model (num_moe_experts is None); set "
                "num_moe_experts (--num-experts) or use expert-parallel size 1"]
    problems = []
    if not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        problems.append(f"moe_layer_freq={cfg.moe_layer_freq!r} makes no layer a mixture of experts; give at least "
                        "one layer experts or use expert-parallel size 1")
    if experts % ep_size:
        problems.append(f"num_moe_experts={experts} is not divisible by expert-parallel size {ep_size} (every EP "
                        f"rank holds an equal block of experts, as in Megatron-LM); use a divisor of {experts}")
    if world_size is not None and world_size % ep_size:
        problems.append(f"expert-parallel size {ep_size} does not divide the world size {world_size} (EP groups are "
                        f"consecutive ranks, expert data-parallel groups strided by EP); use a divisor of "
                        f"{world_size}")
    return problems


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` holds (megatron-core's order)."""
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertParallelLayout:
    """The EP group of this rank and its place in it."""

    group: dist.ProcessGroup
    rank: int
    """This rank's index in ``group`` (its EP rank)."""
    size: int
    num_experts: int
    """E, the experts of one MoE layer over all EP ranks."""

    def __deepcopy__(self, memo: dict) -> "ExpertParallelLayout":
        return self  # a copy of the model runs on the same ranks; process groups cannot be copied

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size

    @property
    def local(self) -> range:
        return local_experts(self.num_experts, self.size, self.rank)


# -- this rank's experts -----------------------------------------------------------------------
class InitReplay(nn.Module):
    """Draws, and discards, the initial values of experts another rank holds when the
    engine materialises a meta-device model ([Note: meta-device build of a shard])."""

    def __init__(self, dropped: list[nn.Module]) -> None:
        super().__init__()
        self.dropped = dropped  # a plain list: not submodules, so not parameters of this rank
        self.register_buffer("pending", torch.empty(0, device="meta"), persistent=False)

    def reset_buffers(self) -> None:
        device = self.pending.device
        for expert in self.dropped:
            expert.to_empty(device=device)
            for module in expert.modules():  # a module's own init, then its children's: construction order
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
            expert.to_empty(device="meta")  # frees the values
        self.pending = torch.empty(0, device=device)


class ExpertShard(nn.Module):
    """The experts one EP rank holds of one MoE layer, registered under their global indices
    ([Note: expert-parallel layout]); iterating yields them in order."""

    def __init__(self, experts: nn.ModuleList, local: range) -> None:
        super().__init__()
        self.global_indices = list(local)
        meta = any(p.is_meta for p in experts.parameters())
        if meta:
            self.replay_before = InitReplay([experts[i] for i in range(local.start)])
        for index in local:
            self.add_module(str(index), experts[index])
        if meta:
            self.replay_after = InitReplay([experts[i] for i in range(local.stop, len(experts))])

    def __iter__(self):
        return iter(self._modules[str(index)] for index in self.global_indices)

    def __len__(self) -> int:
        return len(self.global_indices)


# -- the collectives ([Note: the token exchange]) ------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class ExchangeCounts:
    """All-to-alls one MoE layer issued over its EP group since the last ``reset``."""

    counts: int = 0
    """Forward: the rows-per-expert exchange, one per forward."""
    dispatches: int = 0
    """Forward: rows (and their routing weights) to the experts' ranks, one per forward."""
    combines: int = 0
    """Forward: expert outputs back to the rows' ranks, one per forward."""
    combine_grads: int = 0
    """Backward: the outputs' gradient to the experts' ranks, one per backward."""
    dispatch_grads: int = 0
    """Backward: the rows' and weights' gradient back, one per backward."""
    rows_sent: int = 0
    """Rows this rank sent in its dispatches (to itself included)."""

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def record(self, kind: str) -> None:
        """One exchange of ``kind``: counts, dispatch, combine, combine_grad or dispatch_grad."""
        name = _KIND_FIELDS[kind]
        setattr(self, name, getattr(self, name) + 1)


_KIND_FIELDS = {"counts": "counts", "dispatch": "dispatches", "combine": "combines",
                "combine_grad": "combine_grads", "dispatch_grad": "dispatch_grads"}


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    """send (EP, L) int64: rows this rank has for each local expert of each EP rank -> (EP, L):
    rows each EP rank has for this rank's experts. One equal-split all-to-all."""
    received = torch.empty_like(send)
    with record_function(f"megatron_fsdp::ep_all_to_all:{label}:counts"):
        dist.all_to_all_single(received.view(-1), send.contiguous().view(-1), group=group)
    return received


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with standard strides. ``contiguous()`` is not enough for the gradients autograd
    hands an exchange: an expanded zero with no rows passes for contiguous with stride 0."""
    tensor = tensor.contiguous()
    if tensor.numel() == 0 or (tensor.dim() and tensor.stride(-1) != 1):
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
    return tensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """(m, ...) -> (m, bytes of one row) uint8, the same memory read as bytes."""
    return _dense(tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))).view(torch.uint8)


def exchange_rows(tensors: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                  group: dist.ProcessGroup, label: str) -> list[torch.Tensor]:
    """Row-aligned tensors (m, ...) -> the rows other ranks send (sum(recv_splits), ...), rank r
    getting ``send_splits[r]`` consecutive rows. One all-to-all: several tensors travel as the
    bytes of each row side by side, so each keeps its dtype exactly."""
    rows = sum(recv_splits)
    if len(tensors) == 1:
        source = _dense(tensors[0])
        packed, out = source, source.new_empty((rows, *source.shape[1:]))
    else:
        packed = torch.cat([_as_bytes(t) for t in tensors], dim=1)  # (m, bytes per row)
        out = packed.new_empty((rows, packed.shape[1]))
    with record_function(f"megatron_fsdp::ep_all_to_all:{label}"):
        dist.all_to_all_single(out, packed, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    if len(tensors) == 1:
        return [out]
    unpacked, start = [], 0
    for t in tensors:
        width = _as_bytes(t[:0]).shape[1]
        # A fresh tensor of standard strides: a slice (even one "contiguous" row) keeps the
        # packed row's offset and stride, which need not be multiples of the element size.
        piece = out.new_empty((rows, width)).copy_(out[:, start:start + width]).view(t.dtype)
        unpacked.append(piece.reshape(rows, *t.shape[1:]))
        start += width
    return unpacked


class _AllToAll(torch.autograd.Function):
    """``exchange_rows`` whose backward is the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, plan: tuple, *tensors: torch.Tensor):
        send_splits, recv_splits, group, counts, label, kind = plan
        ctx.plan = plan
        ctx.like = [(t.dtype, t.device, t.shape[1:]) for t in tensors]
        counts.record(kind)
        return tuple(exchange_rows(list(tensors), send_splits, recv_splits, group, f"{label}:{kind}"))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        send_splits, recv_splits, group, counts, label, kind = ctx.plan
        rows = sum(recv_splits)
        grads = [g if g is not None else torch.zeros((rows, *shape), dtype=dtype, device=device)
                 for g, (dtype, device, shape) in zip(grads, ctx.like)]
        counts.record(f"{kind}_grad")
        back = exchange_rows(list(grads), recv_splits, send_splits, group, f"{label}:{kind}_grad")
        return (None, *back)


def _all_to_all(tensors: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                layout: ExpertParallelLayout, counts: "ExchangeCounts", label: str, kind: str) -> tuple:
    return _AllToAll.apply((send_splits, recv_splits, layout.group, counts, label, kind), *tensors)


# -- the dispatcher ----------------------------------------------------------------------------
def regroup_by_expert(received: torch.Tensor) -> torch.Tensor:
    """received (EP, L): rows from each source rank for each local expert, laid out source
    rank by source rank, expert by expert within each -> (m,) int64 index that reorders the
    rows expert by expert, source rank by source rank within each (its ``argsort`` undoes it)."""
    sizes = received.t().reshape(-1)  # chunk sizes in the target order (expert-major)
    flat = received.reshape(-1)
    source_starts = (flat.cumsum(0) - flat).view_as(received).t().reshape(-1)
    target_starts = sizes.cumsum(0) - sizes
    shift = torch.repeat_interleave(source_starts - target_starts, sizes)
    return torch.arange(shift.numel(), device=received.device) + shift


class AllToAllDispatcher:
    """One MoE layer's ``moe.ExpertDispatch`` over its EP group ([Note: the token exchange])."""

    def __init__(self, layout: ExpertParallelLayout, label: str) -> None:
        self.layout, self.label = layout, label
        self.counts = ExchangeCounts()

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                 run_experts: RunExperts) -> torch.Tensor:
        """rows (m, hidden) grouped by global expert, weights (m,), counts (E,) -> outputs (m, hidden)."""
        layout = self.layout
        send = counts.view(layout.size, layout.num_local)  # (EP, L): rows for each rank's experts
        self.counts.record("counts")
        received = exchange_counts(send, layout.group, self.label)  # (EP, L): rows for mine, per source
        send_splits, recv_splits = send.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        self.counts.rows_sent += sum(send_splits)
        got_rows, got_weights = _all_to_all([rows, weights], send_splits, recv_splits, layout, self.counts,
                                            self.label, "dispatch")
        if layout.num_local > 1:
            order = regroup_by_expert(received)
            got_rows, got_weights = got_rows.index_select(0, order), got_weights.index_select(0, order)
        outputs = run_experts(got_rows, got_weights, received.sum(dim=0).tolist())  # (m', hidden)
        if layout.num_local > 1:
            outputs = outputs.index_select(0, torch.argsort(order))  # back to the received order
        (back,) = _all_to_all([outputs], recv_splits, send_splits, layout, self.counts, self.label, "combine")
        return back


# -- applying it -------------------------------------------------------------------------------
def _moe_layers(model: GPT) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def _check(model: GPT, ep_mesh: DeviceMesh) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"apply_expert_parallel takes the embedded GPT (megatron_fsdp.models.GPT), got "
                        f"{type(model).__name__}; apply it to the unwrapped GPT, before FSDP wrapping")
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1 or ep_mesh.mesh_dim_names != ("ep",):
        names = getattr(ep_mesh, "mesh_dim_names", None)
        raise ValueError(f"ep_mesh must be the 1-D expert-parallel sub-mesh named 'ep', got {names}; pass "
                         "mesh['ep'] of the expert mesh (e.g. init_device_mesh(..., (W // EP, EP), "
                         "mesh_dim_names=('fsdp', 'ep')))")
    layers = _moe_layers(model)
    if any(layer.dispatcher is not None or isinstance(layer.experts, ExpertShard) for _, layer in layers):
        raise ValueError("the model is expert-parallel already (apply_expert_parallel was called on it); apply it "
                         "once, to a whole model")
    problems = expert_parallel_problems(model.config, ep_mesh.size(), dist.get_world_size())
    if not layers and not problems:
        problems = ["the model has no MoE layer; use expert-parallel size 1"]
    if problems:
        raise ValueError("cannot apply expert parallelism: " + "; ".join(problems))


def apply_expert_parallel(model: GPT, ep_mesh: DeviceMesh) -> GPT:
    """Spread every MoE layer's experts over the 1-D mesh ``ep_mesh`` (named "ep"), in place;
    returns the model. Each layer keeps its EP rank's block of experts under their global names
    and exchanges tokens with the other EP ranks ([Note: expert-parallel layout], [Note: the
    token exchange]). Every rank must hold the same whole model (same seed, or a meta-device
    build); apply before FSDP wrapping, and wrap with ``expt_device_mesh`` whose "ep" dimension
    is ``ep_mesh``. ValueError (before any change) for what ``expert_parallel_problems`` refuses."""
    _check(model, ep_mesh)
    layout = ExpertParallelLayout(group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank(), size=ep_mesh.size(),
                                  num_experts=model.config.num_moe_experts)
    if layout.size == 1:
        return model
    for name, layer in _moe_layers(model):
        layer.experts = ExpertShard(layer.experts, layout.local)
        layer.dispatcher = AllToAllDispatcher(layout, label=name)
    if model.forced_routing is not None:
        stream = model.forced_routing.for_expert_parallel_rank(layout.rank)
        model.forced_routing = share_stream([layer.router for _, layer in _moe_layers(model)], stream)
    return model


def expert_exchange_counts(model: nn.Module) -> dict[str, ExchangeCounts]:
    """MoE layer name in the unwrapped GPT -> its EP all-to-alls (``ExchangeCounts``), for an
    expert-parallel model (wrapped or not)."""
    return {m.dispatcher.label: m.dispatcher.counts for m in model.modules()
            if isinstance(m, MoELayer) and isinstance(m.dispatcher, AllToAllDispatcher)}


def set_expert_capacity(model: nn.Module, factor: Optional[float], drop_policy: "TokenDropPolicy | str" = "probs",
                        pad_to_capacity: bool = False) -> None:
    """Megatron-LM's ``--moe-expert-capacity-factor`` / ``--moe-token-drop-policy`` /
    ``--moe-pad-expert-input-to-capacity`` on every MoE layer of ``model`` (router.py,
    [Note: expert capacity]); ``factor`` None or negative (Megatron-LM's convention): dropless.
    The same numbers at every expert-parallel size: the capacity is per rank's tokens."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("set_expert_capacity: the model has no MoE layer")
    if factor is None or factor < 0:
        if pad_to_capacity:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (Megatron-LM's "
                             "rule); pass a positive factor or drop the padding")
        capacity = None
    else:
        capacity = ExpertCapacity(factor=factor, drop_policy=drop_policy, pad_to_capacity=pad_to_capacity)
    if capacity is not None and any(layer.balancing is MoELoadBalancing.SINKHORN for layer in layers):
        raise ValueError("moe_expert_capacity_factor does not work with moe_router_load_balancing_type='sinkhorn' "
                         "(megatron-core's rule: aux_loss, seq_aux_loss, global_aux_loss or none); pick one of those "
                         "or stay dropless")
    for layer in layers:
        layer.capacity = capacity
