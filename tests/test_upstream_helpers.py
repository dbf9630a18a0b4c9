"""``megatron_fsdp.utils`` / ``megatron_fsdp.uneven_dtensor``: the helpers
Megatron-LM imports from upstream, on DTensors with uneven shards."""

from __future__ import annotations

import io
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import megatron_fsdp as mf
from megatron_fsdp.uneven_dtensor import (
    gather_and_compute_chunk_metadata,
    preprocess_state_dict_for_uneven_dtensor,
    redistribute_uneven_dtensor_to_replicated,
    split_dtensor,
    uneven_dtensor_to_full_tensor,
    validate_uneven_dtensor,
)
from megatron_fsdp.utils import (
    find_megatron_fsdp,
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    make_fsdp_dtensor,
)
from models import Block, make_model


def _rows(world):
    """Uneven rows per rank: rank r holds r + 1 rows (not torch.chunk's split)."""
    return [r + 1 for r in range(world)]


def _uneven(rank, world, mesh, full):
    rows = _rows(world)
    start = sum(rows[:rank])
    local = full[start : start + rows[rank]].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def uneven_worker(rank, world, *, path):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    total = sum(_rows(world))
    full = torch.arange(total * 3, dtype=torch.float32).reshape(total, 3)
    dt = _uneven(rank, world, mesh, full)
    validate_uneven_dtensor(dt)
    meta = gather_and_compute_chunk_metadata(dt)
    gathered = uneven_dtensor_to_full_tensor(dt)
    replicated = redistribute_uneven_dtensor_to_replicated(dt)
    pieces = [uneven_dtensor_to_full_tensor(p) for p in split_dtensor(dt, [2, total - 2], dim=0)]
    # DCP with the real extents, then torch.save of the preprocessed state dict
    state = preprocess_state_dict_for_uneven_dtensor({"model": {"w": dt}})
    dcp.save(state, checkpoint_id=path)
    target = _uneven(rank, world, mesh, torch.zeros_like(full))
    dcp.load(preprocess_state_dict_for_uneven_dtensor({"model": {"w": target}}), checkpoint_id=path)
    buf = io.BytesIO()
    torch.save(state, buf)
    return dict(
        offset=meta.offsets[0] == sum(_rows(world)[:rank]),
        full=torch.equal(gathered, full),
        replicated=torch.equal(replicated.to_local(), full) and all(isinstance(p, Replicate) for p in replicated.placements),
        split=torch.equal(pieces[0], full[:2]) and torch.equal(pieces[1], full[2:]),
        dcp=torch.equal(uneven_dtensor_to_full_tensor(target), full),
    )


def test_uneven_dtensor_helpers(pool, tmp_path):
    for out in pool.run(uneven_worker, path=str(tmp_path / "ckpt")):
        assert all(out.values()), out


def hsdp_uneven_worker(rank, world):
    # (outer, shard) mesh with the rows split over both dims, outer first.
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "shard"))
    full = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 2)
    outer, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    halves = [(0, 6), (6, 10)]  # uneven outer split
    lo, hi = halves[outer]
    inner_rows = torch.arange(lo, hi).tensor_split(world // 2)[shard]
    local = full[inner_rows[0] : inner_rows[-1] + 1].clone() if len(inner_rows) else full[:0].clone()
    dt = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    return torch.equal(uneven_dtensor_to_full_tensor(dt), full)


def test_uneven_full_tensor_on_a_2d_mesh(pool4):
    assert all(pool4.run(hsdp_uneven_worker))


def test_tensor_parallel_helpers():
    column = nn.Parameter(torch.zeros(2))
    column.tensor_model_parallel, column.partition_dim = True, 0
    row = nn.Parameter(torch.zeros(2))
    row._tensor_parallel_mode = "row"
    plain = nn.Parameter(torch.zeros(2))
    assert get_mcore_tensor_parallel_partition_dim(column) == 0 and is_mcore_tensor_model_parallel(column)
    assert get_mcore_tensor_parallel_partition_dim(row) == 1
    assert get_mcore_tensor_parallel_partition_dim(plain) is None and not is_mcore_tensor_model_parallel(plain)


def find_worker(rank, world):
    model = mf.fully_shard_model(module=make_model("net"), fsdp_unit_modules=[Block])
    chain = types.SimpleNamespace(module=types.SimpleNamespace(module=model))
    return find_megatron_fsdp(chain) is model and find_megatron_fsdp(make_model("net")) is None


def test_find_megatron_fsdp(pool2):
    assert all(pool2.run(find_worker))


def make_fsdp_dtensor_worker(rank, world, *, path):
    """Upstream's make_fsdp_dtensor: uneven row shards (and a whole replicated
    tensor), validated, with DCP chunk metadata; DCP writes them at their real offsets
    and torch.save still pickles them."""
    from megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor as upstream_path
    from megatron_fsdp.utils import make_fsdp_dtensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    index = mf.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
    total = sum(_rows(world))
    full = torch.arange(total * 3, dtype=torch.float32).reshape(total, 3)
    param = nn.Parameter(torch.empty(total, 3))
    start = sum(_rows(world)[:rank])
    flat = full[start : start + _rows(world)[rank]].reshape(-1).clone()  # the local rows, flattened
    dt = make_fsdp_dtensor(flat, param, index, run_check=True, update_uneven_dtensor_chunk_meta=True)
    whole = make_fsdp_dtensor(full.reshape(-1).clone(), param, index, is_sharded_param=False)
    dcp.save({"w": dt, "r": whole}, checkpoint_id=path)
    target = {"w": torch.distributed.tensor.distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "r": torch.zeros_like(full)}
    dcp.load(target, checkpoint_id=path)
    buf = io.BytesIO()
    torch.save({"w": dt}, buf)
    try:
        make_fsdp_dtensor(flat, param, index, is_sharded_param=False)
        mismatch_error = world == 1
    except ValueError as exc:
        mismatch_error = "is_sharded_param" in str(exc)
    return dict(
        same_function=upstream_path is make_fsdp_dtensor,
        shape=dt.shape == full.shape and tuple(dt.to_local().shape) == (_rows(world)[rank], 3),
        placements=list(dt.placements) == [Shard(0)] and list(whole.placements) == [Replicate()],
        full=torch.equal(uneven_dtensor_to_full_tensor(dt), full),
        dcp=torch.equal(target["w"].full_tensor(), full) and torch.equal(target["r"], full),
        mismatch_error=mismatch_error,
    )


def test_make_fsdp_dtensor(pool2, tmp_path):
    for out in pool2.run(make_fsdp_dtensor_worker, path=str(tmp_path / "ckpt")):
        assert all(out.values()), out


def make_fsdp_dtensor_hsdp_worker(rank, world):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "shard"))
    param = nn.Parameter(torch.empty(4, 2))
    results = []
    for outer_shards in (False, True):
        index = mf.FSDPDistributedIndex(mesh, dp_shard_dim="shard", dp_outer_dim="outer", hsdp_outer_dp_shard=outer_shards)
        dt = make_fsdp_dtensor(torch.zeros(2), param, index)
        results.append([type(p).__name__ for p in dt.placements])
    return results


def test_make_fsdp_dtensor_hybrid_placements(pool4):
    for placements in pool4.run(make_fsdp_dtensor_hsdp_worker):
        assert placements == [["Replicate", "Shard"], ["Shard", "Shard"]]
