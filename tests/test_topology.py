"""Topologies and model handling on 4 gloo ranks: HSDP/HFSDP on a 2x2 mesh, expert
groups, fsdp_no_shard, meta-device init, fine-grained gathering."""

from __future__ import annotations

import re

import pytest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from grids import grid
import megatron_fsdp as mf
from megatron_fsdp.comm.distributed_index import build_hybrid_mesh
from models import Block, add_decay_into_grads, backward_microbatches, loss_fn, make_batches, make_model, make_optimizer, max_param_diff, train_reference

TOL = 1e-5


def _hybrid(strategy, outer, optimizer="sgd", **kwargs):
    mesh = build_hybrid_mesh("cpu", 2)
    return mf.fully_shard(
        make_model("net"),
        make_optimizer(optimizer),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        hybrid_fsdp_group=dist.group.WORLD,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
        outer_dp_sharding_strategy=outer,
        **kwargs,
    )


def _train(model, opt, batches, rank, world, microbatches=1):
    for x, y in batches:
        opt.zero_grad()
        backward_microbatches(model, x, y, rank, world, microbatches)
        opt.step()


def hybrid_parity_worker(rank, world, *, strategy, outer, optimizer):
    batches = make_batches("net", 4, batch=4 * world * 2)
    reference = train_reference(make_model("net"), "net", batches, optimizer)
    model, opt = _hybrid(strategy, outer, optimizer)
    _train(model, opt, batches, rank, world, microbatches=2)
    state_bytes = sum(
        (v.to_local() if isinstance(v, DTensor) else v).numel() * 4
        for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    optimizer_numel = sum(g.optimizer_layout.shard_numel for g in model.param_and_grad_buffer.groups)
    return max_param_diff(mf.get_full_state_dict(model), reference), state_bytes, optimizer_numel


@pytest.mark.parametrize("optimizer", grid(["sgd", "adamw"], ("adamw",)))  # AdamW amplifies a wrong gradient most
@pytest.mark.parametrize(
    "strategy,outer",
    [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"), ("optim_grads", "no_shard"),
     ("optim", "no_shard"), ("no_shard", "no_shard")],
    ids=["hsdp-zero3", "hfsdp", "hsdp-zero2", "hsdp-zero1", "hsdp-zero0"],
)
def test_hybrid_parity(pool4, strategy, outer, optimizer):
    for diff, _, _ in pool4.run(hybrid_parity_worker, strategy=strategy, outer=outer, optimizer=optimizer):
        assert diff < TOL


def attached_zero_worker(rank, world, *, strategy, outer):
    """[Note: zeroed gradients that stay attached] on a 2x2 mesh: zero_grad_buffer()
    (odd steps) or zero_grad(set_to_none=False), a decay term written into the zeroed
    .grad, two microbatches: equal to the same loop in one process."""
    batches = make_batches("net", 4, batch=4 * world * 2)
    reference = make_model("net")
    ref_opt = make_optimizer("sgd")(reference.parameters())
    model, opt = _hybrid(strategy, outer)
    for step, (x, y) in enumerate(batches):
        ref_opt.zero_grad(set_to_none=False)
        add_decay_into_grads(reference)
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
        model.zero_grad_buffer() if step % 2 else opt.zero_grad(set_to_none=False)
        add_decay_into_grads(model)
        backward_microbatches(model, x, y, rank, world, microbatches=2)
        opt.step()
    return max_param_diff(mf.get_full_state_dict(model), reference)


@pytest.mark.parametrize(
    "strategy,outer", [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"), ("optim", "no_shard"),
                       ("no_shard", "no_shard")], ids=["hsdp-zero3", "hfsdp", "hsdp-zero1", "hsdp-zero0"],
)
def test_hybrid_grads_written_after_zeroing(pool4, strategy, outer):
    for diff in pool4.run(attached_zero_worker, strategy=strategy, outer=outer):
        assert diff < TOL, diff


def test_hfsdp_halves_optimizer_state(pool4):
    hsdp = pool4.run(hybrid_parity_worker, strategy=3, outer="no_shard", optimizer="adamw")
    hfsdp = pool4.run(hybrid_parity_worker, strategy=3, outer="optim", optimizer="adamw")
    for (_, hsdp_state, hsdp_main), (_, hfsdp_state, hfsdp_main) in zip(hsdp, hfsdp):
        assert hfsdp_main * 2 == hsdp_main  # per rank: the optimizer's share of every buffer
    # Optimizer state: summed over ranks (pieces are uneven per parameter, exact in total).
    assert sum(s for _, s, _ in hfsdp) * 2 == sum(s for _, s, _ in hsdp)


def outer_once_worker(rank, world, *, strategy, outer):
    model, opt = _hybrid(strategy, outer)
    batches = make_batches("net", 2, batch=4 * world * 2)
    _train(model, opt, batches[:1], rank, world, microbatches=2)
    with mf.record_collectives() as rec:
        _train(model, opt, batches[1:], rank, world, microbatches=2)
    outer_ops = [kind for kind, label in rec.labels if label.startswith("outer:")]
    return outer_ops, len(model.param_and_grad_buffer.grad_groups)


@pytest.mark.parametrize("strategy,outer", [(3, "no_shard"), (3, "optim"), (2, "no_shard")])
def test_outer_reduction_once_per_step(pool4, strategy, outer):
    for outer_ops, groups in pool4.run(outer_once_worker, strategy=strategy, outer=outer):
        if outer == "optim":  # reduce-scatter of grads, all-gather of weights after the step
            assert sorted(outer_ops) == ["all_gather"] * groups + ["reduce_scatter"] * groups
        else:
            assert outer_ops == ["all_reduce"] * groups


def outer_overlap_worker(rank, world, *, strategy, outer):
    model, opt = _hybrid(strategy, outer, overlap_grad_reduce=True)
    batches = make_batches("net", 2, batch=4 * world)
    _train(model, opt, batches[:1], rank, world)
    opt.zero_grad()
    x, y = batches[1]
    with mf.record_collectives() as rec:
        backward_microbatches(model, x, y, rank, world, 1)
    labels = [label for kind, label in rec.labels if kind != "all_gather"]
    first_outer = min(i for i, label in enumerate(labels) if label.startswith("outer:"))
    last_inner = max(i for i, label in enumerate(labels) if not label.startswith("outer:"))
    return first_outer < last_inner


@pytest.mark.parametrize("strategy,outer", [(3, "no_shard"), (3, "optim"), (2, "no_shard")])
def test_outer_reduction_overlaps_backward(pool4, strategy, outer):
    """[Note: overlapped outer reduction] The first group's outer collective is issued
    while other groups' shard-level reductions are still to come, not after backward
    (parity of these configurations: test_hybrid_parity). ZeRO-2/3 bound the
    reductions in flight, so the first one is finalised (and its outer collective
    issued) when the second is launched; ZeRO-0/1 reduce in place and finalise when
    their completion is seen, which on gloo may be only at the end."""
    assert all(pool4.run(outer_overlap_worker, strategy=strategy, outer=outer))


def hybrid_checkpoint_save(rank, world, *, path, outer):
    model, opt = _hybrid(3, outer, "adamw")
    _train(model, opt, make_batches("net", 4, batch=8)[:2], rank, world)
    mf.save_checkpoint(path, model, opt)


def fsdp_resume(rank, world, *, path):
    model, opt = mf.fully_shard(make_model("net"), make_optimizer("adamw"), fsdp_unit_modules=[Block])
    mf.load_checkpoint(path, model, opt)
    batches = make_batches("net", 4, batch=8)
    _train(model, opt, batches[2:], rank, world)
    return max_param_diff(mf.get_full_state_dict(model), train_reference(make_model("net"), "net", batches, "adamw"))


@pytest.mark.parametrize("outer", ["no_shard", "optim"], ids=["hsdp", "hfsdp"])
def test_hybrid_checkpoint_resumes_as_fsdp(pool4, pool2, tmp_path, outer):
    path = str(tmp_path / "ckpt")
    pool4.run(hybrid_checkpoint_save, path=path, outer=outer)
    assert max(pool2.run(fsdp_resume, path=path)) < TOL


# -- expert parameters -----------------------------------------------------------------
class ExpertNet(nn.Module):
    """A dense layer shared by all ranks and one expert per expert-parallel rank."""

    def __init__(self, expert: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(5, 6)
        torch.manual_seed(100 + expert)
        self.expert = nn.Linear(6, 3)
        for p in self.expert.parameters():
            p.allreduce = False  # Megatron's mark for expert parameters

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x)))


def expert_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    # Expert-parallel size 2: ranks {0, 1} hold expert 0, ranks {2, 3} expert 1.
    expt_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("ep", "fsdp", "tp"))
    expert = rank // 2
    batches = make_batches("net", 3, batch=4 * world)
    model, opt = mf.fully_shard(ExpertNet(expert), make_optimizer("sgd"), zero_dp_strategy=3, expt_device_mesh=expt_mesh)
    _train(model, opt, batches, rank, world)
    got = mf.get_full_state_dict(model)

    # Reference: the global loss is the mean of the four ranks' losses.
    refs = [ExpertNet(0), ExpertNet(1)]
    refs[1].dense.load_state_dict(refs[0].dense.state_dict())
    params = list(refs[0].dense.parameters()) + [p for r in refs for p in r.expert.parameters()]
    sgd = torch.optim.SGD(params, lr=0.1)
    for x, y in batches:
        sgd.zero_grad()
        refs[1].dense = refs[0].dense
        loss = sum(loss_fn("net", refs[r // 2](x.chunk(world)[r]), y.chunk(world)[r]) for r in range(world)) / world
        loss.backward()
        sgd.step()
    expected = {"dense.weight": refs[0].dense.weight, "dense.bias": refs[0].dense.bias,
                "expert.weight": refs[expert].expert.weight, "expert.bias": refs[expert].expert.bias}
    return max((got[k] - v.detach()).abs().max().item() for k, v in expected.items())


def test_expert_parameters_use_the_expert_group(pool4):
    assert max(pool4.run(expert_worker)) < TOL


def expert_without_mesh_worker(rank, world):
    try:
        mf.fully_shard_model(ExpertNet(0))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_expert_parameters_need_an_expert_mesh(pool2):
    assert "expt_device_mesh" in pool2.run(expert_without_mesh_worker)[0]


# -- fsdp_no_shard -----------------------------------------------------------------------
def freeze_block1(model):
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)


def no_shard_worker(rank, world, *, strategy, single_param):
    batches = make_batches("net", 3, batch=4 * world)
    reference = train_reference(make_model("net"), "net", batches, "adamw", freeze_block1)
    base = make_model("net")
    freeze_block1(base)
    if single_param:
        mf.fsdp_no_shard(base.blocks[1].fc1.weight)
    else:
        mf.fsdp_no_shard(base.blocks[1])
    model, opt = mf.fully_shard(base, make_optimizer("adamw"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    with mf.record_collectives() as rec:
        _train(model, opt, batches, rank, world)
    marked = [g for g in model.param_and_grad_buffer.groups if any(n.startswith("blocks.1.fc1.weight") for n in g.names)]
    gathered_labels = {label for kind, label in rec.labels if kind == "all_gather"}
    with model.compute_params_registered() as module:
        weight = module.blocks[1].fc1.weight.detach().clone()  # the compute parameter: full on every rank
    gathered = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(gathered, weight)
    return dict(
        diff=max_param_diff(mf.get_full_state_dict(model), reference),
        gathered_marked=any(g.label in gathered_labels for g in marked),
        full_everywhere=all(torch.equal(gathered[0], t) for t in gathered),
        unit_names=[u.name for u in model.units],
    )


@pytest.mark.parametrize("single_param", [False, True], ids=["module", "parameter"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_fsdp_no_shard_frozen_submodule(pool, strategy, single_param):
    for out in pool.run(no_shard_worker, strategy=strategy, single_param=single_param):
        assert out["diff"] < TOL
        assert not out["gathered_marked"]
        assert out["full_everywhere"]
        if not single_param:  # a fully marked unit gets no gathering hooks
            assert "blocks.1" not in out["unit_names"]


def no_shard_trainable_worker(rank, world):
    """A trainable marked module: replicated, gradients still reduced (all-reduce)."""
    batches = make_batches("net", 3, batch=4 * world)
    reference = train_reference(make_model("net"), "net", batches, "adamw")
    base = make_model("net")
    mf.fsdp_no_shard(base.out)
    model, opt = mf.fully_shard(base, make_optimizer("adamw"), fsdp_unit_modules=[Block])
    _train(model, opt, batches, rank, world)
    clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # mixed placements in one optimizer
    return max_param_diff(mf.get_full_state_dict(model), reference), float(clipped)


def test_fsdp_no_shard_trainable(pool2):
    for diff, norm in pool2.run(no_shard_trainable_worker):
        assert diff < TOL and norm > 0


# -- meta-device init --------------------------------------------------------------------
class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.weight.sum()


def meta_worker(rank, world, *, strategy, kind):
    eager = make_model(kind)
    torch.manual_seed(0)
    with torch.device("meta"):
        from models import Net, TiedNet

        model = Net() if kind == "net" else TiedNet()
    model.blocks[0].fc1.weight.tensor_model_parallel = True  # a Megatron attribute
    mf.fsdp_no_shard(model.blocks[1])
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, init_model_with_meta_device=True)
    full = mf.get_full_state_dict(fsdp)
    equal = all(torch.equal(full[n], p.detach()) for n, p in eager.named_parameters())
    total = sum(p.numel() * 4 for p in eager.parameters())
    x = torch.randn(3, 5) if kind == "net" else torch.randint(0, 11, (3, 4))
    with torch.no_grad():
        same_forward = torch.allclose(fsdp(x), eager(x), atol=1e-6)
    return dict(
        equal=equal,
        same_forward=same_forward,
        peak=fsdp.init_peak_param_bytes,
        total=total,
        attribute=getattr(model.blocks[0].fc1.weight, "tensor_model_parallel", False),
        mark=mf.param_marks.is_fsdp_no_shard(model.blocks[1].fc1.weight),
    )


@pytest.mark.parametrize("kind", ["net", "tied"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_meta_device_init_equals_eager(pool2, strategy, kind):
    for out in pool2.run(meta_worker, strategy=strategy, kind=kind):
        assert out["equal"] and out["same_forward"]
        assert 0 < out["peak"] < out["total"]  # one module at a time, never the whole model
        assert out["attribute"] and out["mark"]


def meta_no_reset_worker(rank, world):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    try:
        mf.fully_shard_model(model, init_model_with_meta_device=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_meta_module_without_reset_parameters_is_named(pool2):
    message = pool2.run(meta_no_reset_worker)[0]
    assert "'1' (NoReset)" in message and "reset_parameters" in message


# -- fine-grained gathering --------------------------------------------------------------
def fine_grained_worker(rank, world):
    batches = make_batches("net", 3, batch=4 * world)
    reference = train_reference(make_model("net"), "net", batches, "sgd")
    model, opt = mf.fully_shard(
        make_model("net"), make_optimizer("sgd"), fsdp_unit_modules=[Block], enable_fine_grained_param_gather=True
    )
    _train(model, opt, batches, rank, world)
    return max_param_diff(mf.get_full_state_dict(model), reference), [u.name for u in model.units]


def test_fine_grained_param_gather(pool2):
    for diff, names in pool2.run(fine_grained_worker):
        assert diff < TOL
        assert names[:3] == ["blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2"]


# -- bad input -----------------------------------------------------------------------------
def bad_topology_worker(rank, world, *, case):
    try:
        if case == "dim":
            mf.fully_shard_model(make_model("net"), device_mesh=build_hybrid_mesh("cpu", 2), dp_shard_dim="fsdp_dim")
        elif case == "divide":
            build_hybrid_mesh("cpu", 3)
        elif case == "hfsdp":
            _hybrid("optim_grads", "optim")
        elif case == "hybrid_group":
            mf.fully_shard_model(make_model("net"), device_mesh=build_hybrid_mesh("cpu", 2), dp_shard_dim="dp_shard",
                                 dp_outer_dim="dp_outer")
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("dim", r"dp_shard_dim='fsdp_dim' is not a dimension of the device mesh.*dp_outer.*dp_shard"),
        ("divide", r"num_distributed_optimizer_instances=3 does not divide the world size 4.*\[1, 2, 4\]"),
        ("hfsdp", r"HFSDP.*optim_grads_params.*'optim_grads'"),
        ("hybrid_group", r"dp_outer_dim='dp_outer' and hybrid_fsdp_group=None go together"),
    ],
)
def test_bad_topology_input(pool4, case, pattern):
    message = pool4.run(bad_topology_worker, case=case)[0]
    assert re.search(pattern, message), message
