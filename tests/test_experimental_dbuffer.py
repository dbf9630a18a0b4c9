"""DBuffer and its row-aligned layout: pure index math (no process group), then the
redistributions, ``out=`` buffers and storage release on the gloo pool."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from megatron_fsdp import record_collectives
from megatron_fsdp.experimental import DBuffer, Flat
from megatron_fsdp.experimental.layout import GlobalLayout
from megatron_fsdp.experimental.placement import changed_mesh_axis, specialize_placements, validate_placements

SHAPES = [(15, 7), (15,), (7, 15), (7,), (3, 4, 5), (1,), (6,)]


# -- pure ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_every_shard_boundary_falls_between_rows(seed):
    rng = random.Random(seed)
    shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
    dp = rng.choice([1, 2, 3, 4, 8])
    layout = GlobalLayout.build(shapes, dp)
    shard = layout.size // dp
    assert layout.size % dp == 0
    for shape, start in zip(layout.tensor_shapes, layout.tensor_to_offset):
        row = math.prod(shape[1:])
        assert start % row == 0
        for boundary in range(0, layout.size + 1, shard):
            if start < boundary < start + shape.numel():
                assert (boundary - start) % row == 0, (shape, start, boundary)
    # Tensors do not overlap, and every rank's overlaps tile each tensor exactly.
    for index, shape in enumerate(layout.tensor_shapes):
        parts = [layout.overlap(index, r * shard, shard) for r in range(dp)]
        assert sum(p.numel for p in parts if p is not None) == shape.numel()


def test_layout_refuses_scalars_and_empty_rows():
    with pytest.raises(ValueError, match="0-d"):
        GlobalLayout.build([()], 2)
    with pytest.raises(ValueError, match="zero-sized"):
        GlobalLayout.build([(3, 0)], 2)
    with pytest.raises(ValueError, match="overlaps"):
        GlobalLayout((torch.Size([4]), torch.Size([4])), (0, 2), 8)


def test_local_range_nests_flat_axes():
    layout = GlobalLayout.build([(16,)], 4)
    # [Flat, Flat] on a 2x2 mesh: the last axis splits first (coarsest).
    assert layout.local_range([2, 2], [1, 0], [True, True]) == (4, 4)
    assert layout.local_range([2, 2], [0, 1], [True, True]) == (8, 4)
    assert layout.local_range([2, 2], [1, 1], [False, True]) == (8, 8)


def test_placements():
    assert Flat() == Shard(0)
    assert specialize_placements([Replicate(), Shard(0)]) == (Replicate(), Flat())
    assert isinstance(specialize_placements([Shard(0)])[0], Flat)
    with pytest.raises(NotImplementedError, match="Shard\\(0\\)"):
        specialize_placements([Shard(1)])
    with pytest.raises(ValueError, match="must come last"):
        validate_placements([Flat(), Replicate()])
    assert changed_mesh_axis([Flat(), Replicate()], [Flat(), Replicate()]) is None
    assert changed_mesh_axis([Replicate(), Flat()], [Partial("avg"), Flat()]) == 0
    with pytest.raises(NotImplementedError, match="one axis at a time"):
        changed_mesh_axis([Flat(), Flat()], [Replicate(), Replicate()])


# -- distributed -----------------------------------------------------------------------------
def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def dbuffer_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    tensors = _tensors()
    out = {}
    sharded = DBuffer.distribute_tensors(tensors, mesh, [Flat()], name="t")
    out["local_numel"] = sharded.local_buffer.numel()
    out["layout_size"] = sharded.layout.size
    # Flat -> Replicate (all-gather) restores every tensor; a DTensor view has the global shape.
    with record_collectives() as rec:
        full = sharded.redistribute([Replicate()])
    out["gather_counts"] = dict(rec.counts)
    out["gather_ok"] = all(torch.equal(full.get_local_tensor(i), t) for i, t in enumerate(tensors))
    dt = sharded.get_dtensor(0)
    out["dtensor"] = isinstance(dt, DTensor) and tuple(dt.shape) == SHAPES[0]
    out["dtensor_local_is_view"] = dt.to_local().data_ptr() == sharded.get_local_tensor(0).data_ptr() or \
        sharded.get_local_tensor(0).numel() == 0
    # out= into a preallocated buffer, asynchronously.
    target = DBuffer(mesh, [Replicate()], SHAPES, torch.float32, "cpu")
    storage = target.local_buffer.untyped_storage()
    result = sharded.redistribute([Replicate()], out=target, async_op=True)
    out["async_pending"] = result is target and target.is_pending
    target.wait()
    # (Padding is uninitialised memory, possibly NaN: compare the tensors only.)
    out["out_ok"] = all(torch.equal(target.get_local_tensor(i), t) for i, t in enumerate(tensors)) and \
        target.local_buffer.untyped_storage().data_ptr() == storage.data_ptr()
    # Replicate -> Flat (local slice) is the inverse, without communication.
    with record_collectives() as rec:
        back = full.redistribute([Flat()])
    out["scatter_ok"] = all(
        torch.equal(back.get_local_tensor(i), sharded.get_local_tensor(i)) for i in range(len(SHAPES))
    ) and back.offset == sharded.offset and not rec.counts
    # Partial(avg) -> Flat (reduce-scatter) and Partial -> Replicate (all-reduce) average over ranks.
    mine = [t * (rank + 1) for t in tensors]
    mean_factor = (world + 1) / 2
    partial = DBuffer.from_local(
        DBuffer.distribute_tensors(mine, mesh, [Replicate()]).local_buffer, mesh, [Partial("avg")], SHAPES
    )
    reduced = partial.redistribute([Flat()])
    out["rs_ok"] = all(
        torch.allclose(reduced.get_local_tensor(i), sharded.get_local_tensor(i) * mean_factor) for i in range(len(SHAPES))
    )
    summed = DBuffer.from_local(partial.local_buffer.clone(), mesh, [Partial("sum")], SHAPES).redistribute([Replicate()])
    out["ar_ok"] = all(
        torch.allclose(summed.get_local_tensor(i), t * world * mean_factor) for i, t in enumerate(tensors)
    )
    relabeled = full.redistribute([Partial("avg")])
    out["relabel_shares"] = relabeled.local_buffer.data_ptr() == full.local_buffer.data_ptr()
    # cast keeps layout and placements; cast to the same dtype is the buffer itself.
    half = sharded.cast(torch.bfloat16)
    out["cast_ok"] = half.dtype == torch.bfloat16 and half.placements == sharded.placements and sharded.cast(torch.float32) is sharded
    # Release / reallocate keeps views valid (same storage object).
    view = full.get_local_tensor(2)
    full.release_storage()
    out["released"] = full.local_buffer.untyped_storage().nbytes() == 0
    full.reallocate_storage()
    sharded.redistribute([Replicate()], out=full)
    out["view_survives"] = torch.equal(view, tensors[2])
    # out= validation names the mismatch.
    errors = []
    for bad in (
        DBuffer(mesh, [Replicate()], SHAPES, torch.bfloat16, "cpu"),
        DBuffer(mesh, [Replicate()], SHAPES[:-1], torch.float32, "cpu"),
    ):
        try:
            sharded.redistribute([Replicate()], out=bad)
        except ValueError as e:
            errors.append(str(e))
    out["out_errors"] = errors
    try:
        full.redistribute([Partial("sum")])
    except NotImplementedError as e:
        out["sum_relabel_error"] = str(e)
    return out


def test_dbuffer_redistribution(pool):
    results = pool.run(dbuffer_worker)
    for r in results:
        assert r["layout_size"] % pool.world == 0 and r["local_numel"] * pool.world == r["layout_size"]
        assert r["gather_counts"] == {"all_gather": 1}
        for key in ("gather_ok", "dtensor", "dtensor_local_is_view", "async_pending", "out_ok", "scatter_ok",
                    "rs_ok", "ar_ok", "relabel_shares", "cast_ok", "released", "view_survives"):
            assert r[key], key
        assert len(r["out_errors"]) == 2 and "dtype" in r["out_errors"][0] and "layout" in r["out_errors"][1]
        assert "avg" in r["sum_relabel_error"]


def hsdp_dbuffer_worker(rank, world):
    mesh = init_device_mesh("cpu", (2, world // 2))
    tensors = _tensors(1)
    sharded = DBuffer.distribute_tensors(tensors, mesh, [Flat(), Flat()])
    # Gather one axis at a time: the finer (first) Flat axis, then the coarser.
    half = sharded.redistribute([Replicate(), Flat()])
    full = half.redistribute([Replicate(), Replicate()])
    return all(torch.equal(full.get_local_tensor(i), t) for i, t in enumerate(tensors))


def test_dbuffer_two_axes(pool4):
    assert all(pool4.run(hsdp_dbuffer_worker))
