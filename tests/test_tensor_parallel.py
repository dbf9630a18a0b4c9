"""Tensor parallelism with FSDP (buffers/tensor_parallel.py [Note: tensor-parallel
parameters]): a model tensor-parallelised with PyTorch's DTensor plans on ``mesh["tp"]``
and wrapped over the data-parallel dimensions trains exactly like one process
training the same full model on the global batch, whatever the strategy, with
sequence parallelism, clipping, HSDP/HFSDP (3-D meshes), tied weights, activation
recomputation, frozen parameters, meta-device init and bf16 compute; its state dicts
are DTensors over the whole mesh; DCP checkpoints reshard across layouts.

World 4 (DP 2 x TP 2) runs by default; world 8 (DP 2 x TP 2 x outer 2, DP 4 x TP 2)
with ``MFSDP_TP_LONG=1``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile

import pytest
import torch
from torch.distributed.tensor import DTensor

import conftest
import megatron_fsdp as mf
from megatron_fsdp.comm.distributed_index import FSDPDistributedIndex
from megatron_fsdp.parallel_dims import ParallelDims
from tp_models import (Layout, TPBlock, TPNet, apply_tp_plan, batches, lm_loss, make_optimizer,
                       train_reference)

TOL = 1e-5
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LONG = os.environ.get("MFSDP_TP_LONG") == "1"


# -- wrapping through each entry point ----------------------------------------------------------
def _wrap(entry: str, model, layout: Layout, mesh, *, strategy, opt: str, outer_strategy=0, policy=None):
    kwargs = dict(layout.wrap_kwargs(mesh), fsdp_unit_modules=[TPBlock], zero_dp_strategy=strategy)
    if layout.outer > 1:
        kwargs["outer_dp_sharding_strategy"] = outer_strategy
    if policy is not None:
        kwargs["mixed_precision_policy"] = policy
    if entry == "fully_shard":  # an optimizer built on the TP plan's DTensor parameters, as upstream users do
        return mf.fully_shard(model, make_optimizer(opt, model.parameters()), **kwargs)
    if entry == "MegatronFSDP":
        index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        config = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        wrapped = mf.MegatronFSDP(model, dist_index=index, ddp_config=config, fsdp_unit_modules=[TPBlock])
        return wrapped, make_optimizer(opt, wrapped.parameters())
    wrapped = mf.fully_shard_model(model, **kwargs)
    return wrapped, make_optimizer(opt, wrapped.parameters())


def _train(wrapped, optimizer, data, layout: Layout, mesh, *, micro: int, clip: float, entry: str) -> list[float]:
    replica = layout.replica_rank(mesh)
    norms = []
    for tokens in data:
        mine = tokens.chunk(layout.replicas)[replica]
        for chunk in mine.chunk(micro):
            (lm_loss(wrapped(chunk[:, :-1]), chunk[:, 1:]) / micro).backward()
        if entry == "MegatronFSDP":
            wrapped.finish_grad_sync()
        norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip if clip else math.inf)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _compare(wrapped, ref) -> dict:
    """Full weights against the reference, and the state dict's DTensors against the full weights."""
    full = mf.get_full_state_dict(wrapped)
    diff = max((full[name] - p.detach()).abs().max().item() for name, p in ref.named_parameters())
    sd_diff, meshes = 0.0, set()
    for key, value in wrapped.state_dict().items():
        name = key.removeprefix("module.")
        if name in full:
            assert isinstance(value, DTensor), key
            meshes.add(tuple(value.device_mesh.mesh_dim_names))
            sd_diff = max(sd_diff, (value.full_tensor() - full[name]).abs().max().item())
    return dict(diff=diff, sd_diff=sd_diff, meshes=sorted(meshes))


def parity_worker(rank, world, *, layout: Layout, strategy, opt="sgd", sp=False, clip=0.0, entry="fully_shard_model",
                  tied=False, recompute="", frozen=False, outer_strategy=0, steps=3, micro=2):
    torch.manual_seed(0)
    ref = TPNet(tied=tied)
    for block in ref.blocks:
        block.recompute = recompute
    model = copy.deepcopy(ref)
    mesh = layout.mesh()
    apply_tp_plan(model, mesh["tp"], sp=sp)
    if frozen:  # after the plan: torch's SequenceParallel makes new parameters that require gradients
        for net in (ref, model):
            net.blocks[0].norm.requires_grad_(False)
            net.blocks[1].w3.requires_grad_(False)
    wrapped, optimizer = _wrap(entry, model, layout, mesh, strategy=strategy, opt=opt, outer_strategy=outer_strategy)
    data = batches(steps, layout.replicas, micro)
    norms = _train(wrapped, optimizer, data, layout, mesh, micro=micro, clip=clip, entry=entry)
    ref_norms = train_reference(ref, data, opt=opt, clip=clip, micro=micro, replicas=layout.replicas)
    result = _compare(wrapped, ref)
    result["norm_diff"] = max(abs(a - b) for a, b in zip(norms, ref_norms))
    return result


def _assert_exact(results):
    for r in results:
        assert r["diff"] < TOL, r
        assert r["sd_diff"] < TOL, r
        assert r["norm_diff"] < TOL, r
        assert all(m[-1] == "tp" for m in r["meshes"]), r  # DTensors over the data-parallel dims and tp


W4 = Layout(dp=2, tp=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("opt,sp,clip", [("sgd", False, 0.0), ("adamw", True, 0.05)], ids=["sgd", "adamw-sp-clip"])
def test_dp2_tp2_equals_one_process(pool4, strategy, opt, sp, clip):
    _assert_exact(pool4.run(parity_worker, layout=W4, strategy=strategy, opt=opt, sp=sp, clip=clip))


@dataclasses.dataclass(frozen=True)
class DimsLayout:
    """``ParallelDims``' meshes as the parity worker reads a ``Layout``: with CP the dense
    parameters shard over the flattened data x context dimension ([Note: sharding over
    data x context]); this model has no attention, so its CP ranks train on samples of
    their own, which averages over dp x cp exactly as a context-parallel model's parts do."""

    dims: ParallelDims
    outer: int = 1

    def mesh(self):
        return self.dims.build_mesh("cpu")

    @property
    def replicas(self) -> int:
        return self.dims.dp * self.dims.cp

    def wrap_kwargs(self, mesh) -> dict:
        return self.dims.wrap_kwargs(mesh, self.dims.data_parallel_group(mesh))

    def replica_rank(self, mesh) -> int:
        return mesh[self.dims.shard_dim].get_local_rank()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_tp_over_the_data_context_dimension(pool4, strategy):
    """DP 1 x CP 2 x TP 2: sharded over the flattened (dp_shard, cp) dimension, DTensors over (dp_shard_cp, tp)."""
    layout = DimsLayout(ParallelDims(world=4, tp=2, cp=2))
    results = pool4.run(parity_worker, layout=layout, strategy=strategy, opt="adamw", sp=True, clip=0.05)
    _assert_exact(results)
    assert all(r["meshes"] == [("dp_shard_cp", "tp")] for r in results), results


@pytest.mark.parametrize("entry", ["fully_shard", "MegatronFSDP"])
def test_entry_points(pool4, entry):
    _assert_exact(pool4.run(parity_worker, layout=W4, strategy="optim_grads_params", opt="adamw", sp=True, entry=entry))


@pytest.mark.parametrize("case", [dict(tied=True), dict(recompute="non-reentrant"), dict(recompute="reentrant"),
                                  dict(frozen=True)], ids=["tied", "recompute", "recompute-reentrant", "frozen"])
def test_model_features(pool4, case):
    _assert_exact(pool4.run(parity_worker, layout=W4, strategy="optim_grads_params", sp=True, **case))


LONG_LAYOUTS = [
    dict(layout=Layout(dp=2, tp=2, outer=2), outer_strategy=0),  # HSDP
    dict(layout=Layout(dp=2, tp=2, outer=2), outer_strategy=1),  # HFSDP
    dict(layout=Layout(dp=4, tp=2)),
]


@pytest.mark.skipif(not LONG, reason="world-8 layouts: MFSDP_TP_LONG=1")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", LONG_LAYOUTS, ids=["hsdp", "hfsdp", "dp4"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_world8_layouts(strategy, case, opt):
    if case.get("outer_strategy") == 1 and strategy != "optim_grads_params":
        pytest.skip("HFSDP shards the optimizer across the outer group under ZeRO-3 only")
    _assert_exact(conftest.get_pool(8).run(parity_worker, strategy=strategy, opt=opt, sp=True, clip=0.05, **case))


# -- bf16 compute, fp32 main weights ------------------------------------------------------------
def bf16_worker(rank, world, *, strategy, steps=3):
    """bf16 compute with fp32 main weights: through TP and without (DP 4), each against the
    same training in fp32. The TP run's error is bf16 rounding: of the size of the DP-only
    run's, not a wrong weight."""
    results = {}
    for tp, dtype in ((2, torch.bfloat16), (1, torch.bfloat16), (1, torch.float32)):
        torch.manual_seed(0)
        model = TPNet().to(dtype)
        layout = Layout(dp=world // tp, tp=tp)
        mesh = layout.mesh()
        if tp > 1:
            apply_tp_plan(model, mesh["tp"], sp=True)
        policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                         grad_comm_dtype="bf16")
        wrapped, optimizer = _wrap("fully_shard_model", model, layout, mesh, strategy=strategy, opt="sgd",
                                   policy=policy)
        micro = world // layout.replicas  # the same global batch in every layout
        _train(wrapped, optimizer, batches(steps, layout.replicas, micro), layout, mesh, micro=micro, clip=0.0,
               entry="fully_shard_model")
        results[(tp, dtype)] = mf.get_full_state_dict(wrapped)
    exact = results[(1, torch.float32)]

    def error(key):
        return max((results[key][k].float() - exact[k]).abs().max().item() for k in exact)

    return error((2, torch.bfloat16)), error((1, torch.bfloat16)), {str(v.dtype) for v in results[(2, torch.bfloat16)].values()}


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_bf16_compute_fp32_main(pool4, strategy):
    for tp_error, dp_error, dtypes in pool4.run(bf16_worker, strategy=strategy):
        assert dtypes == {"torch.float32"}
        assert 0 < tp_error < 2 * dp_error, (tp_error, dp_error)


# -- meta-device init -------------------------------------------------------------------------
def meta_worker(rank, world):
    """A TP model built on the meta device, planned there and materialised at wrapping
    equals the eagerly built full model (same seed on every rank) bit for bit: each
    TP parameter is drawn whole and keeps its piece ([Note: meta init of tensor-parallel
    parameters])."""
    torch.manual_seed(0)
    ref = TPNet()
    layout = W4
    mesh = layout.mesh()
    with torch.device("meta"):
        model = TPNet()
    apply_tp_plan(model, mesh["tp"], sp=True)
    torch.manual_seed(0)
    wrapped = mf.fully_shard_model(model, init_model_with_meta_device=True, fsdp_unit_modules=[TPBlock],
                                   **layout.wrap_kwargs(mesh))
    full = mf.get_full_state_dict(wrapped)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


def test_meta_device_init(pool4):
    assert max(pool4.run(meta_worker)) == 0.0


# -- checkpoints across layouts ---------------------------------------------------------------
def _train_few(layout: Layout, tp_plan: bool, steps: int, seed_offset: int = 0, entry: str = "fully_shard"):
    torch.manual_seed(0)
    model = TPNet()
    mesh = layout.mesh()
    if tp_plan:
        apply_tp_plan(model, mesh["tp"], sp=False)
    wrapped, optimizer = _wrap(entry, model, layout, mesh, strategy="optim_grads_params", opt="adamw")
    data = batches(steps, layout.replicas, 1, seed=1 + seed_offset)
    _train(wrapped, optimizer, data, layout, mesh, micro=1, clip=0.0, entry="fully_shard_model")
    return wrapped, optimizer


def save_worker(rank, world, *, path, layout: Layout):
    wrapped, optimizer = _train_few(layout, layout.tp > 1, steps=2)
    mf.save_checkpoint(path, wrapped, optimizer)
    full = mf.get_full_state_dict(wrapped)
    return full if rank == 0 else None


def load_worker(rank, world, *, path, layout: Layout):
    """Load the checkpoint into another layout, train one more step; returns the full weights
    before and after that step (the latter compares against the saving layout's continuation)."""
    # A plain optimizer that never stepped (bound at its first step: optimizer.py [Note: plain optimizers]).
    wrapped, optimizer = _train_few(layout, layout.tp > 1, steps=0, entry="fully_shard_model")
    mf.load_checkpoint(path, wrapped, optimizer)
    loaded = mf.get_full_state_dict(wrapped)
    _one_more_step(wrapped, optimizer, layout)
    return loaded, mf.get_full_state_dict(wrapped)


def _one_more_step(wrapped, optimizer, layout: Layout) -> None:
    """One step on the same global batch (4 micro batches of 2) in any layout."""
    micro = 4 // layout.replicas
    _train(wrapped, optimizer, batches(1, layout.replicas, micro, seed=7), layout, layout.mesh(), micro=micro,
           clip=0.0, entry="fully_shard")


def continue_worker(rank, world, *, layout: Layout):
    """The saving layout trained on: 2 steps, then the step load_worker runs."""
    wrapped, optimizer = _train_few(layout, layout.tp > 1, steps=2)
    _one_more_step(wrapped, optimizer, layout)
    return mf.get_full_state_dict(wrapped)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("target", ["dp4-tp1", "dp1-tp2"])
def test_checkpoint_reshards_across_layouts(target):
    """Saved at DP 2 x TP 2; loaded at DP 4 x TP 1 (world 4) and DP 1 x TP 2 (world 2): the
    model and the optimizer state (AdamW's moments) carry over, so one more step equals the
    saving layout's next step. And the reverse: saved at DP 4 x TP 1, loaded at DP 2 x TP 2."""
    world, layout = (4, Layout(dp=4, tp=1)) if target == "dp4-tp1" else (2, Layout(dp=1, tp=2))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = conftest.get_pool(4).run(save_worker, path=path, layout=W4)[0]
        expected = conftest.get_pool(4).run(continue_worker, layout=W4)[0]
        loaded, stepped = conftest.get_pool(world).run(load_worker, path=path, layout=layout)[0]
    assert _max_diff(saved, loaded) == 0.0
    # Same global batch, another reduction order: AdamW's eps=1e-4 keeps this at rounding.
    assert _max_diff(expected, stepped) < TOL


def test_checkpoint_reshards_into_tp():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = conftest.get_pool(4).run(save_worker, path=path, layout=Layout(dp=4, tp=1))[0]
        loaded, _ = conftest.get_pool(4).run(load_worker, path=path, layout=W4)[0]
    assert _max_diff(saved, loaded) == 0.0


# -- refusals -------------------------------------------------------------------------------
def refusal_worker(rank, world, *, case):
    torch.manual_seed(0)
    model = TPNet()
    mesh = W4.mesh()
    apply_tp_plan(model, mesh["tp"], sp=False)
    kwargs = W4.wrap_kwargs(mesh)
    if case == "no-tp-dim":
        kwargs.pop("tp_dim")
    try:
        mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], **kwargs)
    except ValueError as exc:
        return str(exc), type(model.out.weight).__name__
    return None, None


@pytest.mark.parametrize("case", ["no-tp-dim"])
def test_tp_model_without_tp_dim_is_refused(pool4, case):
    for message, still in pool4.run(refusal_worker, case=case):
        assert message is not None and "tp_dim" in message and "DTensor" in message
        assert still == "DTensor"  # nothing changed: the model keeps its DTensor parameters


def expert_refusal_worker(rank, world):
    torch.manual_seed(0)
    model = TPNet()
    mesh = W4.mesh()
    apply_tp_plan(model, mesh["tp"], sp=False)
    model.blocks[1].w2.weight.allreduce = False  # Megatron's mark of an expert parameter (the plan made a new one)
    try:
        mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], **W4.wrap_kwargs(mesh))
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_expert_parameters_with_tp_are_refused(pool4):
    for message in pool4.run(expert_refusal_worker):
        assert message is not None and "expert" in message and "tensor-parallel size of 1" in message


def other_mesh_worker(rank, world):
    """A plan on a mesh that is not the wrapper's tp dimension (here: every rank) is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = apply_tp_plan(TPNet(), init_device_mesh("cpu", (world,)), sp=False)
    try:
        mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], **W4.wrap_kwargs(W4.mesh()))
    except ValueError as exc:
        return str(exc)
    return None


def test_plan_on_another_mesh_is_refused(pool4):
    for message in pool4.run(other_mesh_worker):
        assert message is not None and "not the wrapper's tensor-parallel mesh" in message


# -- the same torchtitan-style script through PyTorch FSDP2 ------------------------------------
def fsdp2_worker(rank, world, *, opt, steps=3, micro=2):
    """TP plan on each block, then per-block sharding over the data-parallel dimension:
    PyTorch FSDP2 (2-D) and megatron_fsdp train to the same weights."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    full = {}
    for engine in ("fsdp2", "megatron_fsdp"):
        torch.manual_seed(0)
        model = TPNet()
        mesh = W4.mesh()
        apply_tp_plan(model, mesh["tp"], sp=True)
        if engine == "fsdp2":
            for block in model.blocks:
                fsdp2_shard(block, mesh=mesh["dp_shard"])
            wrapped = fsdp2_shard(model, mesh=mesh["dp_shard"])
        else:
            wrapped = mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], **W4.wrap_kwargs(mesh))
        optimizer = make_optimizer(opt, wrapped.parameters())
        _train(wrapped, optimizer, batches(steps, W4.replicas, micro), W4, mesh, micro=micro, clip=0.05,
               entry=engine)
        if engine == "fsdp2":
            full[engine] = {n: p.full_tensor() for n, p in wrapped.named_parameters()}
        else:
            full[engine] = mf.get_full_state_dict(wrapped)
    return max((full["fsdp2"][n] - full["megatron_fsdp"][n]).abs().max().item() for n in full["fsdp2"])


@pytest.mark.parametrize("opt", [pytest.param("sgd", marks=pytest.mark.skipif(not LONG, reason="MFSDP_TP_LONG=1")),
                                 "adamw"])
def test_same_script_as_fsdp2(pool4, opt):
    assert max(pool4.run(fsdp2_worker, opt=opt)) < TOL


# -- initialising after wrapping -----------------------------------------------------------
def init_after_wrap_worker(rank, world, *, strategy):
    """``nn.init`` on the sharded parameters draws each whole parameter and keeps this rank's
    piece of its TP piece: the weights equal the same init of the unwrapped model."""
    torch.manual_seed(0)
    ref = TPNet()
    model = copy.deepcopy(ref)
    mesh = W4.mesh()
    apply_tp_plan(model, mesh["tp"], sp=True)
    wrapped = mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], zero_dp_strategy=strategy,
                                   **W4.wrap_kwargs(mesh))
    for net in (ref, wrapped):
        torch.manual_seed(5)
        for p in net.parameters():
            torch.nn.init.normal_(p, std=0.3)
    full = mf.get_full_state_dict(wrapped)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_init_after_wrapping(pool4, strategy):
    assert max(pool4.run(init_after_wrap_worker, strategy=strategy)) == 0.0


def full_load_worker(rank, world):
    """Plain full tensors (a pretrained model's weights) load into a TP model: each rank
    keeps its TP piece's share."""
    torch.manual_seed(0)
    model = TPNet()
    mesh = W4.mesh()
    apply_tp_plan(model, mesh["tp"], sp=True)
    wrapped = mf.fully_shard_model(model, fsdp_unit_modules=[TPBlock], **W4.wrap_kwargs(mesh))
    torch.manual_seed(9)
    pretrained = TPNet().state_dict()
    wrapped.load_state_dict(pretrained)
    full = mf.get_full_state_dict(wrapped)
    return max((full[n] - v).abs().max().item() for n, v in pretrained.items())


def test_full_state_dict_loads_into_tp_model(pool4):
    assert max(pool4.run(full_load_worker)) == 0.0
