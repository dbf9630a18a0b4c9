"""The gloo point-to-point all-gather / reduce-scatter equal gloo's native ones,
in place or not, on subgroups, with several collectives in flight, and send the
minimum bytes."""

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp.comm import collectives, p2p_transport


def _native(fn):
    p2p_transport.set_enabled(False)
    try:
        return fn()
    finally:
        p2p_transport.set_enabled(True)


def _subgroups(world):
    """The whole world, and (at 4 ranks) the strided pairs {0,2} and {1,3}."""
    groups = [dist.group.WORLD]
    if world == 4:
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups.append(pairs[dist.get_rank() % 2])
    return groups


def _close(got, want, world):
    """Two ranks: bit-identical (a + b == b + a). More ranks add in another order
    than gloo does, so the results may differ by rounding only."""
    if world == 2:
        return torch.equal(got, want) or (got - want).abs().max().item()
    bound = 4 * world * torch.finfo(want.dtype).eps * want.abs().max().item()
    error = (got.double() - want.double()).abs().max().item()
    return error <= bound or error


def equality_worker(rank, world, *, dtype):
    torch.manual_seed(100 + rank)
    results = []
    for group in _subgroups(world):
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        full = torch.randn(size * 37).to(dtype)
        shard = torch.randn(37).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            out = torch.empty(37, dtype=dtype)
            collectives.reduce_scatter(out, full, group, op=op, async_op=False)
            ref = torch.empty(37, dtype=dtype)
            _native(lambda: collectives.reduce_scatter(ref, full, group, op=op, async_op=False))
            results.append(("rs", _close(out, ref, size)))
        # In place: the output is this rank's own piece of the input.
        inplace = full.clone()
        own = inplace[me * 37 : (me + 1) * 37]
        collectives.reduce_scatter(own, inplace, group, op=dist.ReduceOp.SUM, async_op=False)
        ref = torch.empty(37, dtype=dtype)
        _native(lambda: collectives.reduce_scatter(ref, full, group, op=dist.ReduceOp.SUM, async_op=False))
        results.append(("rs_inplace", _close(own, ref, size)))
        gathered = torch.empty(size * 37, dtype=dtype)
        collectives.all_gather(gathered, shard, group, async_op=False)
        ref = torch.empty(size * 37, dtype=dtype)
        _native(lambda: collectives.all_gather(ref, shard, group, async_op=False))
        results.append(("ag", torch.equal(gathered, ref)))
        buffer = torch.zeros(size * 37, dtype=dtype)
        buffer[me * 37 : (me + 1) * 37] = shard
        collectives.all_gather(buffer, buffer[me * 37 : (me + 1) * 37], group, async_op=False)
        results.append(("ag_inplace", torch.equal(buffer, ref)))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_point_to_point_equals_native_collectives(pool, dtype):
    for results in pool.run(equality_worker, dtype=dtype):
        assert results and all(ok is True for _, ok in results), results


def concurrent_worker(rank, world):
    """Many async collectives of equal size in flight at once: each must receive
    its own messages (the per-group tags), whatever order they complete in."""
    group = dist.group.WORLD
    handles, expected = [], []
    for i in range(6):
        shard = torch.full((64,), float(100 * i + rank))
        out = torch.empty(64 * world)
        handles.append(collectives.all_gather(out, shard, group, async_op=True))
        expected.append((out, torch.cat([torch.full((64,), float(100 * i + r)) for r in range(world)])))
        full = torch.full((64 * world,), float(i + 1))
        red = torch.empty(64)
        handles.append(collectives.reduce_scatter(red, full, group, op=dist.ReduceOp.SUM, async_op=True))
        expected.append((red, torch.full((64,), float(world * (i + 1)))))
    for handle in reversed(handles):
        handle.wait()
    return all(torch.equal(got, want) for got, want in expected)


def test_concurrent_collectives_never_cross(pool):
    assert all(pool.run(concurrent_worker))


def sent_bytes_worker(rank, world):
    sent = []
    original = dist.isend

    def counting_isend(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.isend = counting_isend
    try:
        collectives.all_gather(torch.empty(world * 1000), torch.ones(1000), dist.group.WORLD, async_op=False)
        gathered = sum(sent)
        sent.clear()
        collectives.reduce_scatter(
            torch.empty(1000), torch.ones(world * 1000), dist.group.WORLD, op=dist.ReduceOp.SUM, async_op=False
        )
        return gathered, sum(sent)
    finally:
        dist.isend = original


def test_each_rank_sends_the_minimum(pool):
    for gathered, reduced in pool.run(sent_bytes_worker):
        world = len(pool._procs)
        assert gathered == reduced == (world - 1) * 1000 * 4


def test_only_cpu_tensors_on_gloo_use_point_to_point(pool2):
    assert all(pool2.run(_applies_worker))


def _applies_worker(rank, world):
    cpu = torch.empty(4)
    on = p2p_transport.applies(dist.group.WORLD, cpu)
    meta = p2p_transport.applies(dist.group.WORLD, torch.empty(4, device="meta"))  # stands in for CUDA
    p2p_transport.set_enabled(False)
    off = p2p_transport.applies(dist.group.WORLD, cpu)
    p2p_transport.set_enabled(True)
    return on and not meta and not off
