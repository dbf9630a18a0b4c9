"""Pure index math: no process group."""

import pytest

from megatron_fsdp.buffers.layout import BucketLayout, ShardOverlap
from megatron_fsdp.enums import ShardingStrategy
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy, parse_dtype
import torch


def test_padding_and_shards():
    layout = BucketLayout((10, 5, 3), world_size=4)
    assert layout.numel == 18
    assert layout.shard_numel == 5
    assert layout.padded_numel == 20
    assert [layout.shard_range(r) for r in range(4)] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert layout.item_offsets == (0, 10, 15)


def test_overlaps_cover_every_item_exactly_once():
    for sizes in [(10, 5, 3), (1,), (7, 0, 13, 2), (4, 4)]:
        for world in (1, 2, 3, 4, 8):
            layout = BucketLayout(sizes, world)
            for i, n in enumerate(sizes):
                covered = []
                for r in range(world):
                    ov = layout.overlap(i, r)
                    if ov is None:
                        continue
                    start, _ = layout.shard_range(r)
                    # the overlap is inside the shard and inside the item
                    assert 0 <= ov.shard_start and ov.shard_start + ov.numel <= layout.shard_numel
                    assert layout.item_range(i)[0] + ov.item_start == start + ov.shard_start
                    covered.extend(range(ov.item_start, ov.item_start + ov.numel))
                assert covered == list(range(n)), (sizes, world, i)


def test_uneven_and_absent_items():
    layout = BucketLayout((10, 5, 3), world_size=4)
    assert layout.overlap(0, 1) == ShardOverlap(item_start=5, shard_start=0, numel=5)
    assert layout.overlap(0, 2) is None
    assert layout.overlap(2, 3) == ShardOverlap(item_start=0, shard_start=0, numel=3)
    assert layout.owners(1) == [2]


def test_bad_rank_and_sizes():
    with pytest.raises(ValueError, match="rank=4"):
        BucketLayout((3,), 4).shard_range(4)
    with pytest.raises(ValueError, match="world_size"):
        BucketLayout((3,), 0)
    with pytest.raises(ValueError, match="non-negative"):
        BucketLayout((-1,), 2)


def test_empty_layout():
    layout = BucketLayout((), 4)
    assert layout.padded_numel == 0 and layout.shard_numel == 0


@pytest.mark.parametrize(
    "value,expected",
    [(0, 0), (3, 3), ("no_shard", 0), ("optim", 1), ("optim_grads", 2), ("OPTIM_GRADS_PARAMS", 3), ("2", 2),
     (ShardingStrategy.OPTIM, 1)],
)
def test_strategy_parse(value, expected):
    assert ShardingStrategy.parse(value) == expected


@pytest.mark.parametrize("value", [4, -1, "zero4", "", None, True, 1.0])
def test_strategy_parse_rejects(value):
    with pytest.raises(ValueError, match="no_shard.*optim_grads_params"):
        ShardingStrategy.parse(value)


def test_strategy_properties():
    s = ShardingStrategy
    assert [x.shards_optimizer for x in s] == [False, True, True, True]
    assert [x.shards_grads for x in s] == [False, False, True, True]
    assert [x.shards_params for x in s] == [False, False, False, True]


def test_dtype_parsing():
    assert parse_dtype("bf16", arg_name="x") is torch.bfloat16
    assert parse_dtype("fp32", arg_name="x") is torch.float32
    assert parse_dtype("auto", arg_name="x") is None
    for bad in ["fp8", "bf61", torch.int32, 3]:
        with pytest.raises(ValueError, match="x="):
            parse_dtype(bad, arg_name="x")


def test_policy_defaults_and_validation():
    p = MixedPrecisionPolicy()
    assert p.main_params_dtype is torch.float32 and p.main_grads_dtype is None and p.grad_comm_dtype is None
    assert p.grads_dtype_for(torch.bfloat16) is torch.bfloat16
    assert MixedPrecisionPolicy(main_grads_dtype="fp32").comm_dtype_for(torch.bfloat16) is torch.float32
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        MixedPrecisionPolicy(grad_comm_dtype="fp8")
    # Positional as upstream's dataclass (field order checked in test_upstream_api.py).
    assert MixedPrecisionPolicy(torch.float64).main_params_dtype is torch.float64


def test_flat_range_boxes_tile_the_range_exactly():
    import random

    from megatron_fsdp.buffers.layout import flat_range_boxes

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        total = 1
        for d in shape:
            total *= d
        start = rng.randint(0, total)
        stop = rng.randint(start, total)
        flat = torch.arange(total).reshape(shape) if shape else torch.tensor(0)
        pieces = []
        expected_start = 0
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for box in boxes:
            assert box.flat_start == expected_start
            index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
            pieces.append(flat[index].reshape(-1))
            expected_start += box.numel
        got = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
        assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop, boxes)


def test_flat_range_boxes_rejects_out_of_range():
    from megatron_fsdp.buffers.layout import flat_range_boxes

    with pytest.raises(ValueError, match="outside"):
        flat_range_boxes((2, 3), 4, 7)


def test_split_layout_refines_shards():
    for sizes in [(10, 5, 3), (1,), (7, 13, 2)]:
        for world, parts in [(2, 2), (2, 3), (4, 2), (1, 4)]:
            coarse = BucketLayout(sizes, world, shard_divisor=parts)
            fine = coarse.split(parts)
            assert coarse.padded_numel == fine.padded_numel
            assert coarse.shard_numel == parts * fine.shard_numel
            for r in range(world):
                start, _ = coarse.shard_range(r)
                for p in range(parts):
                    fine_start, _ = fine.shard_range(r * parts + p)
                    assert fine_start == start + p * fine.shard_numel
