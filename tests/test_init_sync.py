"""[Note: initial state from data-parallel rank 0] Ranks that build their models
differently (seeded by rank, as with Megatron-LM's --data-parallel-random-init)
train exactly like one process started from rank 0's weights, as under PyTorch DDP:
every wrapping entry point (fully_shard, HSDP/HFSDP meshes, meta-device init,
expert groups, Megatron-core's FullyShardedDataParallel, the experimental
per-module API) broadcasts rank 0's parameters and buffers; structurally different
models are refused on every rank.

Also [Note: gradient hooks on distributed parameters] on topologies
test_patterns_hooks.py does not reach (world 3, HSDP, the Megatron-core loop,
meta-device init): a tensor hook registered after wrapping runs on the rank's
local gradient before the reduction.
"""

from __future__ import annotations

import copy
import sys
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import conftest
import megatron_fsdp as mf
from megatron_fsdp import experimental
from megatron_fsdp.comm.distributed_index import build_hybrid_mesh
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from models import Block, Net, backward_microbatches, loss_fn, make_batches, make_optimizer, max_param_diff

TOL = 1e-5
STEPS = 3
SEED = 100  # rank r builds its model after torch.manual_seed(SEED + r): rank 0's is the reference's
MCORE_STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


# -- helpers -------------------------------------------------------------------------------------
def without_megatron_parallel_state():
    """A pooled worker may hold Megatron-core's parallel state from another test;
    hiding the module makes the whole world the data-parallel group (as in
    test_fsdp_ddp_adapter.py)."""
    return mock.patch.dict(sys.modules, {"megatron.core.parallel_state": None})


def _seeded_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(d=8)


def _meta_initialised(seed: int) -> Net:
    """Net as the engine's meta-device materialisation makes it on a rank seeded
    ``seed``: each module's ``reset_parameters()`` in ``modules()`` order (as
    fuzz_models.initialised_like_meta)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        net = Net(d=8)
    net = net.to_empty(device="cpu")
    torch.manual_seed(seed)
    for module in net.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    return net


def _triple_grad_hooks(model: nn.Module) -> None:
    """The two DDP habits: a hook on every parameter, and one more on a parameter
    found by name (blocks.1.fc1.weight's gradient ends up 9 times its own)."""
    for p in model.parameters():
        p.register_hook(lambda g: g * 3)
    dict(model.named_parameters())["blocks.1.fc1.weight"].register_hook(lambda g: g * 3)


def _train_one_process(model: nn.Module, batches, hooks: bool = False) -> nn.Module:
    """SGD on the whole global batch (the reference every run must equal)."""
    if hooks:
        _triple_grad_hooks(model)
    opt = make_optimizer("sgd")(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn("net", model(x), y).backward()
        opt.step()
    return model


def _train(model, opt, batches, rank, world) -> None:
    for x, y in batches:
        opt.zero_grad()
        backward_microbatches(model, x, y, rank, world)
        opt.step()


def _first_weight(model: nn.Module) -> float:
    return model.inp.weight[0, 0].item()


def _hybrid_kwargs(outer: int, outer_strategy) -> dict:
    return dict(device_mesh=build_hybrid_mesh("cpu", outer), dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                tp_dim="tp", hybrid_fsdp_group=dist.group.WORLD, outer_dp_sharding_strategy=outer_strategy)


def _trained_diff(model, reference) -> float:
    model.finish_param_sync()
    return max_param_diff(mf.get_full_state_dict(model), reference)


def _assert_rank0_init_trained(results) -> None:
    """Every rank equals the reference, and the ranks really started apart."""
    firsts = [first for first, _ in results]
    assert len(set(firsts)) == len(firsts), f"ranks built identical models: {firsts}"
    diffs = [diff for _, diff in results]
    assert max(diffs) < TOL, diffs


# -- fully_shard: every strategy, world 2 and 3, HSDP/HFSDP at world 6 ---------------------------------
def seeded_worker(rank, world, *, strategy, hybrid=None):
    batches = make_batches("net", STEPS, batch=4 * world)
    reference = _train_one_process(_seeded_net(SEED), batches)
    base = _seeded_net(SEED + rank)
    first = _first_weight(base)
    mesh_kwargs = _hybrid_kwargs(*hybrid) if hybrid else {}
    model, opt = mf.fully_shard(base, make_optimizer("sgd"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                **mesh_kwargs)
    _train(model, opt, batches, rank, world)
    return first, _trained_diff(model, reference)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_rank_seeded_init_trains_from_rank0(strategy, world):
    _assert_rank0_init_trained(conftest.get_pool(world).run(seeded_worker, strategy=strategy))


@pytest.mark.parametrize(
    "outer,outer_strategy", [(3, 0), (2, 0), (2, "optim")], ids=["hsdp-3x2", "hsdp-2x3", "hfsdp-2x3"]
)
def test_rank_seeded_init_hybrid(outer, outer_strategy):
    """Broadcast over the shard group, then the outer group: every one of the 6 ranks
    starts from global rank 0's weights."""
    results = conftest.get_pool(6).run(seeded_worker, strategy=3, hybrid=(outer, outer_strategy))
    _assert_rank0_init_trained(results)


# -- meta-device init: each module synced as it is materialised ------------------------------------------
def meta_seeded_worker(rank, world, *, strategy):
    batches = make_batches("net", STEPS, batch=4 * world)
    reference = _train_one_process(_meta_initialised(SEED), batches)
    unsynced = _meta_initialised(SEED + rank)  # what this rank materialises without the broadcast
    torch.manual_seed(SEED + rank)
    with torch.device("meta"):
        module = Net(d=8)
    model, opt = mf.fully_shard(module, make_optimizer("sgd"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                init_model_with_meta_device=True)
    _train(model, opt, batches, rank, world)
    return _first_weight(unsynced), _trained_diff(model, reference)


@pytest.mark.parametrize("strategy", [3, 0])
def test_meta_device_init_rank_seeded(pool2, strategy):
    _assert_rank0_init_trained(pool2.run(meta_seeded_worker, strategy=strategy))


# -- buffers ----------------------------------------------------------------------------------------------
def buffers_worker(rank, world, *, hybrid=None):
    torch.manual_seed(SEED)
    base = Net(d=8)
    base.blocks[0].register_buffer("scale", torch.full((3,), float(rank)))
    base.register_buffer("count", torch.arange(4) + 10 * rank)  # int64
    base.register_buffer("mask", torch.tensor([rank == 0, rank == 1]))  # bool: gloo has no bool broadcast
    before = (base.blocks[0].scale.tolist(), base.count.tolist(), base.mask.tolist())
    model = mf.fully_shard_model(base, fsdp_unit_modules=[Block], zero_dp_strategy=3,
                                 **(_hybrid_kwargs(*hybrid) if hybrid else {}))
    m = model.module
    after = (m.blocks[0].scale.tolist(), m.count.tolist(), m.mask.tolist())
    return before, after, (m.blocks[0].scale.dtype, m.count.dtype, m.mask.dtype)


@pytest.mark.parametrize("world,hybrid", [(3, None), (6, (2, 0))], ids=["world3", "hsdp-2x3"])
def test_buffers_take_rank0_values_at_wrap(world, hybrid):
    results = conftest.get_pool(world).run(buffers_worker, hybrid=hybrid)
    rank0_before = results[0][0]
    assert results[1][0] != rank0_before  # they did differ
    for before, after, dtypes in results:
        assert after == rank0_before, (before, after)
        assert dtypes == (torch.float32, torch.int64, torch.bool)


# -- expert parameters: the expert data-parallel groups ------------------------------------------------------
class SeededExpertNet(nn.Module):
    """tests/test_topology.ExpertNet with rank-dependent weights: the dense layer
    differs on every rank, expert ``e`` differs inside its group {2e, 2e+1}."""

    def __init__(self, rank: int, expert: int) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.dense = nn.Linear(5, 6)
        torch.manual_seed(100 + 10 * expert + rank)
        self.expert = nn.Linear(6, 3)
        for p in self.expert.parameters():
            p.allreduce = False  # Megatron's mark for expert parameters

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x)))


def expert_seeded_worker(rank, world):
    # Expert-parallel size 2: ranks {0, 1} hold expert 0, ranks {2, 3} expert 1.
    expt_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("ep", "fsdp", "tp"))
    expert = rank // 2
    batches = make_batches("net", STEPS, batch=4 * world)
    base = SeededExpertNet(rank, expert)
    firsts = (base.dense.weight[0, 0].item(), base.expert.weight[0, 0].item())
    model, opt = mf.fully_shard(base, make_optimizer("sgd"), zero_dp_strategy=3, expt_device_mesh=expt_mesh)
    _train(model, opt, batches, rank, world)
    model.finish_param_sync()
    got = mf.get_full_state_dict(model)

    # Reference: rank 0's dense layer, expert e as rank 2e built it; the global loss
    # is the mean of the four ranks' losses.
    refs = [SeededExpertNet(0, 0), SeededExpertNet(2, 1)]
    refs[1].dense = refs[0].dense
    params = list(refs[0].dense.parameters()) + [p for r in refs for p in r.expert.parameters()]
    sgd = torch.optim.SGD(params, lr=0.1)
    for x, y in batches:
        sgd.zero_grad()
        loss = sum(loss_fn("net", refs[r // 2](x.chunk(world)[r]), y.chunk(world)[r]) for r in range(world)) / world
        loss.backward()
        sgd.step()
    expected = {"dense.weight": refs[0].dense.weight, "dense.bias": refs[0].dense.bias,
                "expert.weight": refs[expert].expert.weight, "expert.bias": refs[expert].expert.bias}
    return firsts, {k: (got[k] - v.detach()).abs().max().item() for k, v in expected.items()}


def test_expert_parameters_start_from_their_groups_first_rank(pool4):
    results = pool4.run(expert_seeded_worker)
    dense_firsts = [firsts[0] for firsts, _ in results]
    expert_firsts = [firsts[1] for firsts, _ in results]
    assert len(set(dense_firsts)) == 4 and len(set(expert_firsts)) == 4, results
    for rank, (_, diffs) in enumerate(results):
        assert max(diffs.values()) < TOL, (rank, diffs)


# -- Megatron-core's FullyShardedDataParallel and its loop ------------------------------------------------
def _mcore_train(fsdp, opt, batches, rank, world) -> None:
    """Megatron-LM's loop: zero the grad buffer, forward/backward, finish the grad
    sync, step, refresh the compute weights."""
    for x, y in batches:
        fsdp.zero_grad_buffer()
        opt.zero_grad()
        backward_microbatches(fsdp, x, y, rank, world)
        fsdp.finish_grad_sync()
        opt.step()
        fsdp.install_optimized_model_weights()
    fsdp.finish_param_sync()


def _mcore_wrap(module, strategy):
    config = types.SimpleNamespace(calculate_per_token_loss=False, init_model_with_meta_device=False)
    ddp_config = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    with without_megatron_parallel_state():
        return FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=[Block])


def mcore_seeded_worker(rank, world, *, strategy):
    batches = make_batches("net", STEPS, batch=4 * world)
    reference = _train_one_process(_seeded_net(SEED), batches)
    base = _seeded_net(SEED + rank)
    first = _first_weight(base)
    fsdp = _mcore_wrap(base, strategy)
    fsdp.broadcast_params()  # Megatron-LM's habit for --data-parallel-random-init
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    _mcore_train(fsdp, opt, batches, rank, world)
    return first, max_param_diff(mf.get_full_state_dict(fsdp.module), reference)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", MCORE_STRATEGIES)
def test_mcore_adapter_rank_seeded_init(strategy, world):
    """Finding "broadcast_params under ZeRO-3": broadcast_params() does not touch
    sharded weights, so each rank kept its own slice of its own init (0.535 off at
    world 2 under optim_grads_params); the broadcast at wrap makes it exact."""
    _assert_rank0_init_trained(conftest.get_pool(world).run(mcore_seeded_worker, strategy=strategy))


# -- the experimental per-module API ------------------------------------------------------------------------
PLACEMENTS = {
    "zero3": experimental.Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)]),
    "no_shard": experimental.Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial("avg")],
                                        optimizer=[Replicate()]),
    # Two mesh axes (outer replicate x inner shard): synced along both.
    "hsdp": experimental.Placements(dp_axes=[0, 1], parameter=[Replicate(), Shard(0)],
                                    gradient=[Partial("avg"), Shard(0)], optimizer=[Replicate(), Shard(0)]),
}


def experimental_seeded_worker(rank, world, *, placement):
    batches = make_batches("net", STEPS, batch=4 * world)
    reference = _train_one_process(_seeded_net(SEED), batches)
    model = _seeded_net(SEED + rank)
    first = _first_weight(model)
    mesh = init_device_mesh("cpu", (2, world // 2) if placement == "hsdp" else (world,))
    with experimental.fully_shard_context() as context:  # blocks first, then the root
        for block in model.blocks:
            experimental.fully_shard(block, mesh=mesh, placements=PLACEMENTS[placement])
        experimental.fully_shard(model, mesh=mesh, placements=PLACEMENTS[placement])
    opt = make_optimizer("sgd")(model.parameters())
    experimental.fully_shard_optimizer(opt)
    for x, y in batches:
        opt.zero_grad()
        with experimental.microbatch(context, is_last=True):
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return first, max_param_diff(experimental.full_state_dict(model), reference)


@pytest.mark.parametrize(
    "placement,world", [("zero3", 2), ("zero3", 3), ("no_shard", 2), ("no_shard", 3), ("hsdp", 6)],
    ids=["zero3-world2", "zero3-world3", "no_shard-world2", "no_shard-world3", "hsdp-2x3"],
)
def test_experimental_rank_seeded_init(placement, world):
    _assert_rank0_init_trained(conftest.get_pool(world).run(experimental_seeded_worker, placement=placement))


# -- different models, and the cost ---------------------------------------------------------------------------
def mismatch_worker(rank, world):
    torch.manual_seed(SEED)
    try:
        mf.fully_shard(Net(d=8 if rank == 0 else 9), make_optimizer("sgd"), fsdp_unit_modules=[Block])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_structure_mismatch_is_refused_on_every_rank(pool2):
    for message in pool2.run(mismatch_worker):
        assert "built different models" in message, message


def count_worker(rank, world):
    torch.manual_seed(SEED + rank)
    module = Net(d=8)
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    with mf.record_collectives() as rec:
        mf.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=3)
    return list(rec.labels), rec.bytes["broadcast"], model_bytes


def test_wrap_broadcasts_once_per_dtype_bucket(pool2):
    for labels, broadcast_bytes, model_bytes in pool2.run(count_worker):
        broadcasts = [label for kind, label in labels if kind == "broadcast"]
        assert broadcasts == ["initial_state"], labels  # a fp32 Net: one flat bucket ...
        assert broadcast_bytes == model_bytes  # ... holding every parameter once


# -- gradient hooks registered after wrapping ------------------------------------------------------------------
def hooks_worker(rank, world, *, how, strategy=3):
    """``how``: "plain" (fully_shard), "hsdp" (outer 2), "mcore" (FullyShardedDataParallel's
    loop) or "meta" (init_model_with_meta_device=True). Every rank builds the same model."""
    batches = make_batches("net", STEPS, batch=4 * world)
    if how == "meta":
        reference = _train_one_process(_meta_initialised(SEED), batches, hooks=True)
        torch.manual_seed(SEED)
        with torch.device("meta"):
            module = Net(d=8)
    else:
        reference = _train_one_process(_seeded_net(SEED), batches, hooks=True)
        module = _seeded_net(SEED)
    if how == "mcore":
        model = _mcore_wrap(module, "optim_grads_params")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _triple_grad_hooks(model)
        _mcore_train(model, opt, batches, rank, world)
        got = mf.get_full_state_dict(model.module)
    else:
        mesh_kwargs = _hybrid_kwargs(2, 0) if how == "hsdp" else {}
        model, opt = mf.fully_shard(module, make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                    zero_dp_strategy=strategy, init_model_with_meta_device=how == "meta",
                                    **mesh_kwargs)
        _triple_grad_hooks(model)
        _train(model, opt, batches, rank, world)
        model.finish_param_sync()
        got = mf.get_full_state_dict(model)
    # Without the hooks the run would be this far off (so the hooks are not a no-op).
    unhooked = _train_one_process(_meta_initialised(SEED) if how == "meta" else _seeded_net(SEED), batches)
    diffs = {n: (got[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()}
    return diffs, max_param_diff(got, unhooked)


@pytest.mark.parametrize(
    "world,how,strategy",
    [(3, "plain", 0), (3, "plain", 3), (4, "hsdp", 3), (2, "mcore", 3), (2, "meta", 3)],
    ids=["world3-zero0", "world3-zero3", "hsdp-2x2", "mcore-world2", "meta-world2"],
)
def test_grad_hooks_after_wrapping(world, how, strategy):
    for diffs, off_without_hooks in conftest.get_pool(world).run(hooks_worker, how=how, strategy=strategy):
        assert max(diffs.values()) < TOL, diffs
        assert off_without_hooks > 100 * TOL, off_without_hooks


# -- [Note: buffers saved for backward] ------------------------------------------------------------
class PositionNet(nn.Module):
    """Tokens and a position-id buffer, each looked up in an embedding (whose backward
    reads the saved ids), as Hugging Face models keep ``position_ids``."""

    def __init__(self, vocab: int = 11, length: int = 3, d: int = 6) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(length, d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("position_ids", torch.arange(length), persistent=False)

    def forward(self, tokens):
        return self.head(torch.tanh(self.tokens(tokens) + self.positions(self.position_ids)))


def position_buffer_worker(rank, world, *, strategy):
    """Two forwards (the halves of this rank's share), then one backward: the buffer
    broadcast before the second forward must not write the ids the first one saved."""
    batches = make_batches("tied", STEPS, batch=4 * world)
    torch.manual_seed(0)
    reference = PositionNet()
    model, opt = mf.fully_shard(copy.deepcopy(reference), make_optimizer("sgd"), zero_dp_strategy=strategy)
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for x, y in batches:
        opt.zero_grad()
        halves = zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2))
        sum(loss_fn("tied", model(xh), yh) for xh, yh in halves).div(2).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn("tied", reference(x), y).backward()
        ref_opt.step()
    model.finish_param_sync()
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize("strategy", [0, 3])
def test_buffer_sync_leaves_saved_ids_alone(pool2, strategy):
    assert max(pool2.run(position_buffer_worker, strategy=strategy)) < TOL
