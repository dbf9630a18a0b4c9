"""Expert parallelism in the embedded MoE (models/expert_parallel.py): a GPT whose experts are
spread over EP ranks and which is trained through ``megatron_fsdp.fully_shard`` (dense
parameters sharded over all ranks, experts over the expert data-parallel mesh) equals one
process training the whole EP-1 model on the global batch -- fp32, 3 steps of 2 micro batches,
every parameter and expert bias within 1e-5 (the experts of all ranks gathered) -- for the
Switch aux loss and DeepSeek-V3's expert bias, at EP 2 and 4, every sharding strategy, HSDP,
``average_in_collective``, a meta-device build and token dropping; the all-to-alls per layer
are counted; the balancing losses under context parallelism are the whole sequences'; what
is not supported is refused before anything changes.

The reference runs each rank's micro batches as that rank does (the balancing loss and the
capacity are per forward), as tests/test_models_parity.py's ``_reference``.

World 4 runs a representative set by default; ``MFSDP_EPCP_LONG=1`` runs the whole grid.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_fsdp as mf
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock, finish_global_batch, gpt_loss
from megatron_fsdp.models.expert_parallel import (ExchangeCounts, ExpertParallelLayout, ExpertShard, _all_to_all,
                                                  apply_expert_parallel, expert_exchange_counts,
                                                  expert_parallel_problems, local_experts, regroup_by_expert,
                                                  set_expert_capacity)
from megatron_fsdp.models.forced_routing import ForcedRoutingStream
from megatron_fsdp.models.moe import MoELayer, group_by_expert
from megatron_fsdp.models.router import ExpertCapacity, TokenDropPolicy, keep_within_capacity
from ep_models import MICRO, STEPS, ExpertLayout, global_batches, moe_config, train_reference
from models import make_optimizer, max_param_diff

TOL = 1e-5
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LONG = bool(os.environ.get("MFSDP_EPCP_LONG"))
long_only = pytest.mark.skipif(not LONG, reason="the whole grid runs with MFSDP_EPCP_LONG=1")


# -- index math (no process group) ---------------------------------------------------------------
def test_local_experts_are_consecutive_blocks():
    assert [list(local_experts(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(local_experts(4, 1, 0)) == [0, 1, 2, 3]


def test_regroup_by_expert_orders_received_rows_expert_major():
    g = torch.Generator().manual_seed(0)
    for ep, local in [(2, 2), (4, 2), (3, 4), (2, 1)]:
        received = torch.randint(0, 4, (ep, local), generator=g)
        received[0, -1] = 0  # an empty chunk
        # the received rows, labelled (source, expert, position), source-major
        labels = [(s, e, i) for s in range(ep) for e in range(local) for i in range(int(received[s, e]))]
        order = regroup_by_expert(received)
        assert [labels[j] for j in order.tolist()] == sorted(labels, key=lambda t: (t[1], t[0], t[2]))
        assert torch.equal(order[torch.argsort(order)], torch.arange(len(labels)))


def test_group_by_expert_keeps_token_order_within_each_expert():
    indices = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])  # (n=4, k=2)
    keep = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    picks = group_by_expert(indices, keep, 3)
    assert picks.counts.tolist() == [2, 1, 3]
    assert picks.token.tolist() == [0, 1, 2, 0, 2, 3]
    assert picks.flat.tolist() == [1, 2, 5, 0, 4, 7]


def _megatron_drop(probs_dense: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float) -> torch.Tensor:
    """megatron-core's ``apply_router_token_dropping`` mask (n, E), "probs" policy: the installed
    megatron-core's own function when it imports, else its rule written out."""
    try:
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
    except ImportError:
        capacity = math.ceil((routing_map.shape[0] * topk / routing_map.shape[1]) * factor)
        if capacity > probs_dense.shape[0]:
            return routing_map
        chosen = torch.topk(probs_dense, k=capacity, dim=0, sorted=False).indices
        return routing_map & torch.zeros_like(routing_map).scatter(0, chosen, True)
    return apply_router_token_dropping(probs_dense, routing_map, topk, factor, drop_policy="probs")[1]


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5, 4.0])
def test_capacity_drops_what_megatron_core_drops(factor):
    g = torch.Generator().manual_seed(int(factor * 10))
    b, t, k, experts = 3, 8, 2, 4
    n = b * t
    logits = torch.randn(n, experts, generator=g)
    probs, indices = logits.softmax(-1).topk(k, dim=-1)
    dense = torch.zeros(n, experts).scatter(1, indices, probs)
    routing_map = dense > 0
    cap = ExpertCapacity(factor=factor)
    assert cap.capacity(n, k, experts) == math.ceil((n * k / experts) * factor)
    keep = cap.keep(probs, indices, experts, sequences=b)
    mine = torch.zeros(n, experts, dtype=torch.bool)
    if keep is None:
        mine = routing_map
    else:
        mine.scatter_(1, indices, keep)
    assert torch.equal(mine, _megatron_drop(dense, routing_map, k, factor))
    # position: megatron-core's rows are (t, b) and its documented rule keeps the earliest of
    # them; its topk of the 0/1 map leaves the order among ties unspecified (on CPU it does not
    # pick the earliest), so the documented rule is checked directly
    position = ExpertCapacity(factor=factor, drop_policy="position")
    keep = position.keep(probs, indices, experts, sequences=b)
    capacity = position.capacity(n, k, experts)
    for e in range(experts):
        rows = (indices == e).any(-1).nonzero().flatten().tolist()  # batch-major rows of expert e
        in_megatron_order = sorted(rows, key=lambda i: ((i % t) * b + i // t))
        kept = set(in_megatron_order[:capacity])
        got = {i for i in rows if keep is None or bool(keep[i][indices[i] == e].item())}
        assert got == kept, (e, got, kept)


def test_capacity_settings_are_validated():
    assert ExpertCapacity(factor=1.0, drop_policy="position").drop_policy is TokenDropPolicy.POSITION
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="must be a positive number"):
            ExpertCapacity(factor=bad)
    with pytest.raises(ValueError, match="'probs', 'position'"):
        ExpertCapacity(factor=1.0, drop_policy="random")
    with pytest.raises(ValueError, match="no MoE layer"):
        set_expert_capacity(torch.nn.Linear(2, 2), 1.0)
    torch.manual_seed(0)
    sinkhorn = GPT(moe_config("aux", 4, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="sinkhorn"))
    with pytest.raises(ValueError, match="sinkhorn"):
        set_expert_capacity(sinkhorn, 1.0)
    model = GPT(moe_config("aux", 4))
    with pytest.raises(ValueError, match="needs moe_expert_capacity_factor"):
        set_expert_capacity(model, None, pad_to_capacity=True)
    set_expert_capacity(model, -1.0)  # Megatron-LM's "dropless"
    assert all(layer.capacity is None for layer in model.moe_layers())


def test_keep_within_capacity_breaks_ties_by_position():
    keep = keep_within_capacity(torch.tensor([1.0, 2.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 1]), 2, capacity=2)
    assert keep.tolist() == [True, True, False, True]


def test_padding_to_capacity_changes_only_the_expert_bias_counts():
    torch.manual_seed(0)
    model = GPT(moe_config("bias", 4))
    padded = copy.deepcopy(model)
    set_expert_capacity(model, 1.0)
    set_expert_capacity(padded, 1.0, pad_to_capacity=True)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (model, padded):
        loss = gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        outs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][n], outs[1][1][n]) for n in outs[0][1])
    counts = padded.blocks[0].mlp.router.local_tokens_per_expert
    assert counts.tolist() == [16.0] * 4  # capacity ceil(32 x 2 / 4 x 1.0) = 16 each, as megatron-core counts
    assert model.blocks[0].mlp.router.local_tokens_per_expert.sum() < 64  # the drop is counted


def test_problems_name_the_value_and_the_fix():
    cfg = moe_config("aux", 6)
    assert expert_parallel_problems(cfg, 2, world_size=4) == []
    (divisible,) = expert_parallel_problems(cfg, 4)
    assert "num_moe_experts=6" in divisible and "divisor of 6" in divisible
    (world,) = expert_parallel_problems(cfg, 3, world_size=4)
    assert "does not divide the world size 4" in world
    (dense,) = expert_parallel_problems(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                                  seq_length=8, vocab_size=16), 2)
    assert "needs a mixture-of-experts model" in dense
    assert "positive integer" in expert_parallel_problems(cfg, 0)[0]
    assert "no layer" in expert_parallel_problems(moe_config("aux", 4, moe_layer_freq=[0, 0]), 2)[0]


def test_forced_routing_moves_to_megatron_cores_expert_rank_seed():
    stream = ForcedRoutingStream(5 + 1024)
    assert stream.for_expert_parallel_rank(0).seed == 1029 and stream.for_expert_parallel_rank(3).seed == 1329


# -- parity at world 4 ---------------------------------------------------------------------------
def _wrap(model: GPT, layout: ExpertLayout, expert_mesh, *, strategy: str, optimizer: str, meta: bool,
          average_in_collective: bool):
    return mf.fully_shard(model, make_optimizer(optimizer), fsdp_unit_modules=[TransformerBlock],
                          zero_dp_strategy=strategy, expt_device_mesh=expert_mesh,
                          init_model_with_meta_device=meta, average_in_collective=average_in_collective,
                          **layout.dense_kwargs())


class _AllToAllCalls(TorchDispatchMode):
    """Counts the c10d all-to-alls issued inside the block, whoever issues them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.c10d.alltoall_base_.default
        return func(*args, **(kwargs or {}))


def _train(fsdp_model, opt, batches, rank: int, world: int, calls: Optional[_AllToAllCalls] = None) -> None:
    """This rank's micro batches of each global batch, the expert bias updated once per step;
    the first step's all-to-alls counted into ``calls``."""
    for step, tokens in enumerate(batches):
        with calls if calls is not None and step == 0 else contextlib.nullcontext():
            _train_step(fsdp_model, opt, tokens, rank, world)


def _train_step(fsdp_model, opt, tokens, rank: int, world: int) -> None:
    opt.zero_grad()
    for i, micro in enumerate(tokens.chunk(world)[rank].chunk(MICRO)):
        with fsdp_model.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
            (gpt_loss(fsdp_model(micro[:, :-1]), micro[:, 1:]) / MICRO).backward()
    finish_global_batch(fsdp_model)
    opt.step()


def _initial_values_equal(fsdp_model, whole: GPT) -> bool:
    """Whether the wrapped model starts from the whole model's values, bit for bit."""
    full = mf.get_full_state_dict(fsdp_model)
    return sorted(full) == sorted(whole.state_dict()) and all(torch.equal(full[k], v)
                                                                for k, v in whole.state_dict().items())


def parity_worker(rank, world, *, variant, experts, ep, strategy, optimizer, outer=1, meta=False,
                  average_in_collective=False, capacity=None):
    cfg = moe_config(variant, experts)
    singles = [dist.new_group([r]) for r in range(world)]  # the reference's counts stay its own
    torch.manual_seed(0)
    whole = GPT(cfg)
    batches = global_batches(world, cfg.vocab_size)
    reference = train_reference(whole, batches, optimizer, world, singles[rank], capacity) if rank == 0 else None
    layout = ExpertLayout(world=world, ep=ep, outer=outer)
    expert_mesh = layout.expert_mesh()
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(cfg)
    apply_expert_parallel(model, expert_mesh["ep"])
    kept = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in model.named_parameters() if ".experts." in n})
    if capacity is not None:
        set_expert_capacity(model, **capacity)
    model.set_moe_aux_loss_scale(1.0 / MICRO)
    fsdp_model, opt = _wrap(model, layout, expert_mesh, strategy=strategy, optimizer=optimizer, meta=meta,
                            average_in_collective=average_in_collective)
    start_equal = _initial_values_equal(fsdp_model, whole) if meta else None
    calls = _AllToAllCalls()
    _train(fsdp_model, opt, batches, rank, world, calls)
    full = mf.get_full_state_dict(fsdp_model, rank0_only=True)
    result = dict(kept=kept, start_equal=start_equal, step_all_to_alls=calls.calls,
                  exchanges={name: vars(c).copy() for name, c in expert_exchange_counts(fsdp_model).items()})
    if rank == 0:
        result["param_diff"] = max_param_diff(full, reference)
        result["moved"] = max_param_diff(full, whole)  # how far training took the weights
        result["bias_moved"] = max([full[n].abs().max().item() for n in full if n.endswith("expert_bias")] + [0.0])
        result["buffer_diff"] = max([(full[n] - b).abs().max().item() for n, b in reference.named_buffers()
                                     if n in full] + [0.0])
    return result


def _check_parity(results, *, experts, ep, variant):
    assert results[0]["param_diff"] < TOL and results[0]["moved"] > 1e-3, results[0]
    assert results[0]["buffer_diff"] < TOL, results[0]["buffer_diff"]
    if variant == "bias":
        assert results[0]["bias_moved"] > 0, results[0]  # the expert bias took its steps
    per_rank = experts // ep
    for rank, result in enumerate(results):
        assert result["kept"] == sorted(str(e) for e in range(rank % ep * per_rank, (rank % ep + 1) * per_rank))
        assert result["start_equal"] in (None, True), rank
    _check_exchange_counts(results, recomputed=variant == "aux_recompute")


def _check_exchange_counts(results, recomputed: bool = False):
    """Per MoE layer and micro batch: forward 1 counts exchange, 1 dispatch, 1 combine; backward
    1 combine-gradient and 1 dispatch-gradient all-to-all (full recomputation replays the
    forward's three inside backward)."""
    steps = STEPS * MICRO
    forwards = 2 * steps if recomputed else steps
    for result in results:  # and c10d saw exactly those in step 1: 2 layers x MICRO x (3 or 6 forward + 2)
        assert result["step_all_to_alls"] == 2 * MICRO * ((6 if recomputed else 3) + 2), result["step_all_to_alls"]
        assert sorted(result["exchanges"]) == ["blocks.0.mlp", "blocks.1.mlp"], result["exchanges"]
        for counts in result["exchanges"].values():
            assert {k: v for k, v in counts.items() if k != "rows_sent"} == dict(
                counts=forwards, dispatches=forwards, combines=forwards, combine_grads=steps,
                dispatch_grads=steps), counts


def _rows_sent(results, layer="blocks.0.mlp") -> int:
    return sum(r["exchanges"][layer]["rows_sent"] for r in results)


DEFAULT_CASES = [  # (variant, experts, ep, strategy, optimizer)
    ("aux", 4, 2, "optim_grads_params", "adamw"),
    ("bias", 8, 4, "no_shard", "sgd"),
    ("seq_aux", 8, 4, "optim", "adamw"),
    ("global_aux", 8, 2, "optim_grads", "sgd"),
    ("aux_recompute", 8, 4, "optim_grads_params", "adamw"),
]


@pytest.mark.parametrize("variant,experts,ep,strategy,optimizer", DEFAULT_CASES,
                         ids=lambda v: str(v))
def test_expert_parallel_trains_like_one_process(pool4, variant, experts, ep, strategy, optimizer):
    results = pool4.run(parity_worker, variant=variant, experts=experts, ep=ep, strategy=strategy,
                        optimizer=optimizer)
    _check_parity(results, experts=experts, ep=ep, variant=variant)
    # the dispatches carry every token's k picks (dropless): forwards x ranks x tokens x k
    assert _rows_sent(results) == (2 if variant == "aux_recompute" else 1) * STEPS * MICRO * 4 * 16 * 2


@long_only
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("variant,experts,ep", [("aux", 4, 2), ("bias", 8, 4), ("aux", 8, 4), ("bias", 4, 2),
                                                ("seq_aux", 4, 2), ("global_aux", 8, 2)])
def test_expert_parallel_grid(pool4, variant, experts, ep, strategy, optimizer):
    results = pool4.run(parity_worker, variant=variant, experts=experts, ep=ep, strategy=strategy,
                        optimizer=optimizer)
    _check_parity(results, experts=experts, ep=ep, variant=variant)


def test_average_in_collective_keeps_expert_gradients_sum_over_dp(pool4):
    """With AVG collectives the expert group (2 ranks) is smaller than the data-parallel size (4):
    the engine's pre-factor keeps expert gradients the sum over all tokens / 4."""
    results = pool4.run(parity_worker, variant="aux", experts=4, ep=2, strategy="optim_grads", optimizer="sgd",
                        average_in_collective=True)
    _check_parity(results, experts=4, ep=2, variant="aux")


@pytest.mark.parametrize("strategy", ["optim_grads_params"] + (["no_shard", "optim", "optim_grads"] if LONG else []))
def test_hsdp_with_expert_parallelism(pool4, strategy):
    """Dense HSDP (2 replicas x 2 shards) with EP 2: the expert data-parallel ranks {0, 2},
    {1, 3} split into 2 outer blocks of 1 shard rank (Megatron-LM's partial expert
    data-parallel groups with 2 distributed-optimizer instances)."""
    results = pool4.run(parity_worker, variant="bias", experts=4, ep=2, strategy=strategy, optimizer="adamw",
                        outer=2)
    _check_parity(results, experts=4, ep=2, variant="bias")


@pytest.mark.parametrize("ep,experts", [(2, 4)] + ([(4, 8)] if LONG else []))
def test_meta_device_build_starts_from_the_whole_models_values(pool4, ep, experts):
    results = pool4.run(parity_worker, variant="aux", experts=experts, ep=ep, strategy="optim_grads_params",
                        optimizer="adamw", meta=True)
    assert all(r["start_equal"] for r in results)
    _check_parity(results, experts=experts, ep=ep, variant="aux")


CAPACITY_CASES = [(2, dict(factor=1.0, drop_policy="probs"))] + ([
    (2, dict(factor=1.0, drop_policy="position")), (4, dict(factor=1.25, drop_policy="probs")),
    (4, dict(factor=0.5, drop_policy="position", pad_to_capacity=True)),
] if LONG else [])


@pytest.mark.parametrize("ep,capacity", CAPACITY_CASES, ids=str)
def test_token_dropping_is_the_same_at_every_expert_parallel_size(pool4, ep, capacity):
    experts = 2 * ep
    results = pool4.run(parity_worker, variant="bias" if ep == 4 else "aux", experts=experts, ep=ep,
                        strategy="optim_grads_params", optimizer="adamw", capacity=capacity)
    assert results[0]["param_diff"] < TOL and results[0]["buffer_diff"] < TOL, results[0]
    _check_exchange_counts(results)
    assert _rows_sent(results) < STEPS * MICRO * 4 * 16 * 2  # some picks were dropped


# -- the exchange on gloo --------------------------------------------------------------------------
def exchange_worker(rank, world, *, sends):
    """Uneven splits (empty ones included) of bf16 rows and fp32 weights in one message, and
    the backward's reverse exchange, on gloo. ``sends[r][q]``: rows rank r sends rank q."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    layout = ExpertParallelLayout(group=mesh.get_group(), rank=rank, size=world, num_experts=2 * world)
    send_splits, recv_splits = sends[rank], [sends[q][rank] for q in range(world)]
    m = sum(send_splits)
    rows = (torch.arange(m * 3, dtype=torch.float32).view(m, 3) / 7 + 100 * rank).to(torch.bfloat16).requires_grad_()
    weights = (torch.arange(m, dtype=torch.float32) / 3 + 0.1 + 10 * rank).requires_grad_()
    counts = ExchangeCounts()
    got_rows, got_weights = _all_to_all([rows, weights], send_splits, recv_splits, layout, counts, "test",
                                        "dispatch")
    everyone = [None] * world
    dist.all_gather_object(everyone, (rows.detach().float(), weights.detach(), send_splits))
    expected_rows, expected_weights = [], []
    for src, (r, w, splits) in enumerate(everyone):
        start = sum(splits[:rank])
        expected_rows.append(r[start:start + splits[rank]])
        expected_weights.append(w[start:start + splits[rank]])
    exact = (torch.equal(got_rows.float(), torch.cat(expected_rows)) and got_rows.dtype == torch.bfloat16
             and torch.equal(got_weights, torch.cat(expected_weights)) and got_weights.dtype == torch.float32)
    (got_rows.float().sum(dim=1) * 2 + got_weights * 3).sum().backward()  # d/drow = 2, d/dweight = 3
    grads_back = torch.equal(rows.grad.float(), torch.full((m, 3), 2.0)) and torch.equal(weights.grad,
                                                                                          torch.full((m,), 3.0))
    return exact, grads_back, (counts.dispatches, counts.dispatch_grads)


@pytest.mark.parametrize("sends", [[[1, 3], [0, 2]], [[0, 3], [0, 2]]], ids=["uneven", "one_receives_nothing"])
def test_uneven_exchange_on_gloo_is_exact_both_ways(pool2, sends):
    for exact, grads_back, counts in pool2.run(exchange_worker, sends=sends):
        assert exact and grads_back and counts == (1, 1)


# -- checkpoints across expert-parallel sizes ------------------------------------------------------
def _build(cfg: GPTConfig, world: int, ep: int, optimizer: str):
    torch.manual_seed(0)
    model = GPT(cfg)
    layout = ExpertLayout(world=world, ep=ep)
    expert_mesh = layout.expert_mesh()
    if ep > 1:
        apply_expert_parallel(model, expert_mesh["ep"])
    model.set_moe_aux_loss_scale(1.0 / MICRO)
    return _wrap(model, layout, expert_mesh, strategy="optim_grads_params", optimizer=optimizer, meta=False,
                 average_in_collective=False)


def reshard_worker(rank, world, *, path, save_ep, load_ep, optimizer):
    """2 steps at EP ``save_ep``, a checkpoint of the model and optimizer (``save_checkpoint``:
    DCP, the optimizer state keyed by global parameter names for MoE models), resumed at EP
    ``load_ep`` for the third step: the 3-step single-process result."""
    cfg = moe_config("aux", 8)
    singles = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    whole = GPT(cfg)
    batches = global_batches(world, cfg.vocab_size)
    reference = train_reference(whole, batches, optimizer, world, singles[rank]) if rank == 0 else None
    model, opt = _build(cfg, world, save_ep, optimizer)
    _train(model, opt, batches[:2], rank, world)
    mf.save_checkpoint(path, model, opt)
    resumed, opt2 = _build(cfg, world, load_ep, optimizer)
    mf.load_checkpoint(path, resumed, opt2)
    _train(resumed, opt2, batches[2:], rank, world)
    full = mf.get_full_state_dict(resumed, rank0_only=True)
    return max_param_diff(full, reference) if rank == 0 else None


@pytest.mark.parametrize("save_ep,load_ep", [(2, 4)] + ([(4, 1), (1, 2)] if LONG else []))
def test_checkpoint_resumes_at_another_expert_parallel_size(pool4, tmp_path, save_ep, load_ep):
    diff = pool4.run(reshard_worker, path=str(tmp_path / "ckpt"), save_ep=save_ep, load_ep=load_ep,
                     optimizer="adamw")[0]
    assert diff < TOL, diff


# -- context parallelism: the MoE hook ------------------------------------------------------------
CP_VARIANTS = ["aux", "seq_aux", "global_aux", "bias_aux"]


def cp_worker(rank, world, *, variant):
    """Two ranks, each holding a contiguous half of every sequence, against one rank holding
    them whole; the loss and gradients after the data x context average (here: CP only)."""
    changes = dict(moe_aux_loss_coeff=0.1) if variant == "bias_aux" else {}
    cfg = moe_config("bias" if variant == "bias_aux" else variant, 4, **changes)
    singles = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    whole = copy.deepcopy(layer)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, cfg.hidden_size, generator=g)  # (b, T, hidden)
    weight = torch.randn(2, 16, cfg.hidden_size, generator=g)
    whole.router.data_parallel_group = singles[rank]
    ((whole(x) * weight).sum() / x[..., 0].numel()).backward()
    layer.set_context_parallel_group(dist.group.WORLD)
    layer.router.data_parallel_group = dist.group.WORLD  # the data x context ranks
    mine = slice(rank * 8, (rank + 1) * 8)
    # context_parallel_loss's rule: the local sum over the micro batch's count x CP
    ((layer(x[:, mine]) * weight[:, mine]).sum() / x[..., 0].numel() * world).backward()
    diffs = {}
    for (name, p), q in zip(layer.named_parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        diffs[name] = (grad / world - q.grad).abs().max().item()  # the engine's average over dp x cp
    share = layer.last_aux_loss.clone()
    dist.all_reduce(share)
    out = dict(grad_diff=max(diffs.values()), aux=share.item(), whole_aux=whole.last_aux_loss.item())
    if layer.router.local_tokens_per_expert is not None:
        counts = layer.router.local_tokens_per_expert.clone()
        dist.all_reduce(counts)
        out["counts_equal"] = torch.equal(counts, whole.router.local_tokens_per_expert)
    return out


@pytest.mark.parametrize("variant", CP_VARIANTS)
def test_balancing_under_context_parallelism_is_the_whole_sequences(pool2, variant):
    for result in pool2.run(cp_worker, variant=variant):
        assert result["grad_diff"] < 1e-6, result
        assert abs(result["aux"] - result["whole_aux"]) < 1e-6 * max(1.0, abs(result["whole_aux"])), result
        assert result.get("counts_equal", True), result


# -- refusals -------------------------------------------------------------------------------------
def refusal_worker(rank, world):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("fsdp", "ep"))
    torch.manual_seed(0)
    errors = {}

    def attempt(name, model, ep_mesh):
        before = {n: p.clone() for n, p in model.named_parameters()} if isinstance(model, torch.nn.Module) else {}
        try:
            apply_expert_parallel(model, ep_mesh)
        except (ValueError, TypeError) as exc:
            unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and len(before) == len(
                dict(model.named_parameters()))
            errors[name] = (type(exc).__name__, str(exc), unchanged)
        else:
            errors[name] = ("no error", "", True)

    attempt("indivisible", GPT(moe_config("aux", 3)), mesh["ep"])
    attempt("dense", GPT(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
                                   vocab_size=16)), mesh["ep"])
    attempt("not_gpt", torch.nn.Linear(2, 2), mesh["ep"])
    attempt("wrong_dim", GPT(moe_config("aux", 4)), mesh["fsdp"])
    twice = GPT(moe_config("aux", 4))
    apply_expert_parallel(twice, mesh["ep"])
    assert isinstance(twice.blocks[0].mlp.experts, ExpertShard) and len(twice.blocks[0].mlp.experts) == 2
    attempt("twice", twice, mesh["ep"])
    torch.manual_seed(5)
    forced = GPT(moe_config("aux", 4, moe_router_force_load_balancing=True))
    apply_expert_parallel(forced, mesh["ep"])
    streams = {id(layer.router.forced_routing) for layer in forced.moe_layers()}
    errors["forced_seed"] = (forced.forced_routing.seed, streams == {id(forced.forced_routing)})
    return errors


def test_unsupported_layouts_are_refused_before_any_change(pool2):
    results = pool2.run(refusal_worker)
    errors = results[0]
    kind, message, unchanged = errors["indivisible"]
    assert kind == "ValueError" and "num_moe_experts=3 is not divisible by expert-parallel size 2" in message
    assert unchanged
    assert errors["dense"][0] == "ValueError" and "needs a mixture-of-experts model" in errors["dense"][1]
    assert errors["not_gpt"][0] == "TypeError" and "embedded GPT" in errors["not_gpt"][1]
    assert errors["wrong_dim"][0] == "ValueError" and "named 'ep'" in errors["wrong_dim"][1]
    assert errors["twice"][0] == "ValueError" and "expert-parallel already" in errors["twice"][1]
    for rank, result in enumerate(results):
        assert result["forced_seed"] == (5 + 1024 + 100 * rank, True)  # megatron-core's EP-rank stream


def test_exchange_counts_reset():
    counts = ExchangeCounts(counts=2, dispatches=2, rows_sent=7)
    counts.record("dispatch_grad")
    assert counts.dispatch_grads == 1
    counts.reset()
    assert vars(counts) == vars(ExchangeCounts())
