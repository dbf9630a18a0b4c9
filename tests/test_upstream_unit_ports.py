"""What upstream Megatron-FSDP's own unit tests (mfsdp_v1 and mfsdp_v2) rely on,
checked here in our terms on CPU/gloo: the 4-d (outer, shard, cp, tp) mesh with a
sharded outer optimizer, meta init and deferred sync toggled per microbatch; upstream's
buffer attribute names (``parameter_groups``, ``main_weight_buffer``, ...) and
``mixed_precision_context``; a root module that is its own unit; half-frozen models;
the Megatron-core adapter's dtype fields; and the experimental API's ``model.to()``
after sharding a child, DBuffer's ``allocation_stream`` and storage release, and the
Flat-suffix rule. Numbers are compared to one process at 1e-5 (fp32)."""

from __future__ import annotations

import copy
import math
import sys
import types
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import megatron_fsdp as mf
from megatron_fsdp import MixedPrecisionPolicy, fully_shard, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron_fsdp.experimental import DBuffer, Flat, Placements
from megatron_fsdp.experimental import fully_shard as exp_fully_shard
from megatron_fsdp.experimental import fully_shard_context
from megatron_fsdp.experimental.placement import validate_placements
from models import Block, Net, loss_fn, make_batches, make_model

TOL = 1e-5


def _adam(params, **kw):
    return torch.optim.Adam(params, lr=0.01, eps=1e-4, **kw)


def _full(model) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in mf.get_full_state_dict(model).items()}


def _diff(full: dict, reference: nn.Module) -> float:
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


# -- v1: 4-d mesh, sharded outer optimizer, meta init, sync toggled per microbatch ------------
def hfsdp_4d_worker(rank, world):
    mesh = init_device_mesh("cpu", (2, world // 2, 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    mesh[("dp_outer", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
    torch.manual_seed(0)  # every rank must build (or materialize) the same weights
    with torch.device("meta"):
        module = Net()
    model, optimizer = fully_shard(
        module=module,
        optimizer=_adam(module.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        hybrid_fsdp_group=mesh["hsdp"].get_group(),
        fsdp_unit_modules=[Block],
        zero_dp_strategy="optim_grads_params",
        outer_dp_sharding_strategy="optim",
        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=None),
        init_model_with_meta_device=True,
        report_nan_in_param_grad=True,
        maxpool_double_buffer=True,
    )
    # The reference starts from the materialized weights, so the check is independent
    # of how meta init draws them.
    reference = Net()
    reference.load_state_dict(_full(model))
    ref_opt = _adam(reference.parameters())
    batches = make_batches("net", 4, 8)
    for step in range(2):
        ref_opt.zero_grad()
        for micro, (x, y) in enumerate(batches[2 * step : 2 * step + 2]):
            loss_fn("net", reference(x), y).backward()
            model.set_model_auto_sync(micro == 1)  # reduce only on the last microbatch
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        ref_opt.step()
        optimizer.step()
        optimizer.zero_grad()
    return _diff(_full(model), reference)


def test_hfsdp_on_a_4d_mesh_with_meta_init_and_deferred_sync(pool4):
    for diff in pool4.run(hfsdp_4d_worker):
        assert diff < TOL, diff


# -- v1: upstream's buffer names and mixed_precision_context ----------------------------------------
def buffer_names_worker(rank, world, *, params_dtype, grads_dtype):
    model = fully_shard_model(
        module=make_model("net"),
        fsdp_unit_modules=[Block],
        zero_dp_strategy="optim_grads",
        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=params_dtype, main_grads_dtype=grads_dtype),
    )
    buffer = model.param_and_grad_buffer
    groups = buffer.parameter_groups
    main = groups[0].main_weight_buffer
    index = buffer.param_to_param_group
    in_own_group = buffer.param_to_param_group is index and all(  # built once: a lookup per parameter is linear
        any(p is q for q in (*groups[index[p]].params, *groups[index[p]].dist_params)) for p in model.parameters()
    )
    optimizer = fully_shard_optimizer(_adam(model.parameters()))
    x, y = make_batches("net", 1, 8)[0]
    before = model.mp_policy
    with model.mixed_precision_context(MixedPrecisionPolicy(grad_comm_dtype=torch.float16)):
        inside = model.mp_policy.grad_comm_dtype
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(
        main_dtype=None if main is None else main.data.dtype,
        grad_dtype=groups[0].main_grad_buffer.data.dtype,
        model_dtype=groups[0].model_weight_buffer.data.dtype,
        units=sorted({-1 if g.fsdp_unit_id is None else g.fsdp_unit_id for g in groups}),
        in_own_group=in_own_group,
        context=(inside, model.mp_policy == before),
    )


@pytest.mark.parametrize(
    "params_dtype, grads_dtype", [(None, None), (torch.float64, torch.float32)], ids=["defaults", "f64_main_f32_grads"]
)
def test_upstream_buffer_names_and_policy_context(pool2, params_dtype, grads_dtype):
    for out in pool2.run(buffer_names_worker, params_dtype=params_dtype, grads_dtype=grads_dtype):
        assert out["main_dtype"] == params_dtype, out
        assert out["grad_dtype"] == (grads_dtype or torch.float32) and out["model_dtype"] == torch.float32, out
        assert out["units"] == [-1, 0, 1, 2] and out["in_own_group"], out  # root (-1) + one per Block
        assert out["context"] == (torch.float16, True), out


# -- v1: a root that is its own unit; half-frozen models -----------------------------------------
class Square(nn.Module):
    """Weight and bias owned by the root module itself."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, d))
        self.bias = nn.Parameter(torch.empty(d))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.uniform_(self.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def root_unit_worker(rank, world, *, strategy, optimizer):
    torch.manual_seed(3)
    reference = Square()
    model = fully_shard_model(module=copy.deepcopy(reference), fsdp_unit_modules=[Square], zero_dp_strategy=strategy)
    make = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
    ref_opt = make(reference.parameters(), lr=0.01, weight_decay=0.1)
    opt = fully_shard_optimizer(make(model.parameters(), lr=0.01, weight_decay=0.1))
    g = torch.Generator().manual_seed(11)
    xs, ys = torch.randn(2, world, 3, generator=g), torch.randn(2, world, 3, generator=g)
    first_output = (model(xs[0]) - reference(xs[0])).abs().max().item()
    losses = []
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        opt.zero_grad()
        loss, ref_loss = F.mse_loss(model(x[rank : rank + 1]), y[rank : rank + 1]), F.mse_loss(reference(x), y)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(abs(mean.item() / world - ref_loss.item()))
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    return max(first_output, *losses, _diff(_full(model), reference))


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_root_module_as_its_own_unit(pool2, strategy, optimizer):
    for diff in pool2.run(root_unit_worker, strategy=strategy, optimizer=optimizer):
        assert diff < TOL, diff


def frozen_worker(rank, world, *, meta):
    base = make_model("net")
    frozen = [n for n, _ in base.named_parameters()][: len(list(base.parameters())) // 2]
    reference = copy.deepcopy(base)
    for n, p in reference.named_parameters():
        p.requires_grad_(n not in frozen)
    if meta:
        with torch.device("meta"):
            module = Net()
    else:
        module = copy.deepcopy(reference)
    for n, p in module.named_parameters():
        p.requires_grad_(n not in frozen)
    torch.manual_seed(0)  # meta init materializes the same weights on every rank
    model = fully_shard_model(
        module=module, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads", init_model_with_meta_device=meta
    )
    reference.load_state_dict(_full(model))
    kept = [n for n, p in model.module.named_parameters() if not p.requires_grad] == frozen
    count = len(list(model.parameters())) == len(list(base.parameters()))
    ref_opt, opt = _adam(reference.parameters()), fully_shard_optimizer(_adam(model.parameters()))
    for x, y in make_batches("net", 2, 8):
        for m, o, xx, yy in ((reference, ref_opt, x, y), (model, opt, x.chunk(world)[rank], y.chunk(world)[rank])):
            o.zero_grad()
            loss_fn("net", m(xx), yy).backward()
            o.step()
    return kept and count, _diff(_full(model), reference)


@pytest.mark.parametrize("meta", [False, True], ids=["eager", "meta"])
def test_half_frozen_model(pool2, meta):
    for ok, diff in pool2.run(frozen_worker, meta=meta):
        assert ok and diff < TOL, diff


# -- v1: Megatron-core adapter's dtype fields reach mp_policy -------------------------------------
def adapter_dtypes_worker(rank, world):
    out = []
    combos = [(torch.float32, None, None), (torch.bfloat16, None, None), (torch.float16, torch.float32, None),
              (torch.float32, torch.bfloat16, torch.bfloat16), (None, None, None)]
    config = types.SimpleNamespace(calculate_per_token_loss=False, init_model_with_meta_device=False)
    with mock.patch.dict(sys.modules, {"megatron.core.parallel_state": None}):
        default = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
        fsdp = FullyShardedDataParallel(config, default, make_model("net"), fsdp_unit_modules=[nn.Linear])
        out.append((fsdp.mp_policy.main_params_dtype, fsdp.mp_policy.main_grads_dtype, fsdp.mp_policy.grad_comm_dtype))
        dense_mesh = fsdp.megatron_fsdp_dist_index.expt_device_mesh
        fsdp.stop_communication()
        for params, grads, comm in combos[1:]:
            ddp_config = mf.DistributedDataParallelConfig(
                data_parallel_sharding_strategy="optim_grads_params", megatron_fsdp_main_params_dtype=params,
                megatron_fsdp_main_grads_dtype=grads, megatron_fsdp_grad_comm_dtype=comm,
            )
            fsdp = FullyShardedDataParallel(config, ddp_config, make_model("net"), fsdp_unit_modules=[nn.Linear])
            policy = fsdp.mp_policy
            out.append((policy.main_params_dtype, policy.main_grads_dtype, policy.grad_comm_dtype))
    return out == combos and dense_mesh is None, out


def test_adapter_forwards_dtype_fields(pool2):
    for ok, out in pool2.run(adapter_dtypes_worker):
        assert ok, out


# -- v2: the experimental API ------------------------------------------------------------------
def _flat():
    return Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])


def move_after_shard_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    x = torch.ones(2, 4)
    expected = model(x)
    with fully_shard_context(device=torch.device("cpu")):
        exp_fully_shard(model[1], mesh=mesh, placements=_flat())
    sharded = model[1].weight
    model.to("cpu")  # changes nothing for the sharded child, converts the rest
    same = model[1].weight is sharded and isinstance(sharded, DTensor)
    output = (model(x) - expected).abs().max().item()
    try:
        model[1].to(torch.float64)
        refused = ""
    except TypeError as error:
        refused = str(error)
    unchanged = model[1].weight is sharded and sharded.dtype == torch.float32
    return same, output, refused, unchanged


def test_experimental_to_after_sharding_a_child(pool2):
    for same, output, refused, unchanged in pool2.run(move_after_shard_worker):
        assert same and output < TOL and unchanged
        assert "Move and cast the module before" in refused and "float64" in refused, refused


def dbuffer_stream_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    tensors = [torch.arange(12.0).reshape(4, 3), torch.arange(5.0) + 50]
    full = DBuffer.distribute_tensors(tensors, mesh, [Replicate()])
    numel = full.layout.size // world
    marker = object()  # stands for a CUDA stream: kept, not inspected
    piece = DBuffer.from_local(
        full.local_buffer.narrow(0, rank * numel, numel), mesh, [Flat()], full.layout.tensor_shapes,
        allocation_stream=marker,
    )
    gathered = piece.allgather(0)
    replicated = DBuffer.from_local(
        full.local_buffer, mesh, [Replicate()], full.layout.tensor_shapes, allocation_stream=marker
    )
    scattered = replicated.scatter(0, Flat())  # a view of the same storage: same stream
    # Releasing and reallocating keeps the storage object, so views made before
    # still alias the buffer afterwards (the data pointer itself may move on CPU).
    view = full.get_local_tensor(0)
    full.release_storage()
    released = full.local_buffer.untyped_storage().nbytes() == 0
    full.reallocate_storage()
    full.local_buffer.fill_(7.0)
    return dict(
        cpu_stream=full.allocation_stream is None,
        kept=piece.allocation_stream is marker and scattered.allocation_stream is marker,
        values=all(torch.equal(gathered.get_local_tensor(i), t) for i, t in enumerate(tensors)),
        aliased=released and view.data_ptr() == full.local_buffer.data_ptr() and bool((view == 7.0).all()),
        partial=DBuffer.distribute_tensors(tensors, mesh, [Partial("avg")]).allreduce(0).allocation_stream is None,
    )


def test_dbuffer_allocation_stream_and_storage_release(pool2):
    for out in pool2.run(dbuffer_stream_worker):
        assert all(out.values()), out


def test_flat_axes_must_be_a_suffix():
    assert validate_placements([Replicate(), Flat()]) == (Replicate(), Flat())
    with pytest.raises(ValueError, match="Flat placements must be a suffix"):
        validate_placements([Flat(), Replicate()])
