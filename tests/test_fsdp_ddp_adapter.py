"""``FullyShardedDataParallel`` (Megatron-core's wrapper interface) with a plain
PyTorch model and our own config: no megatron-core needed."""

from __future__ import annotations

import sys
import types
from unittest import mock

import pytest
import torch

import megatron_fsdp as mf
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, convert_ddp_config
from models import (
    Block, backward_microbatches, make_batches, make_model,
    make_optimizer, max_param_diff, train_reference, train_steps,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5


def without_megatron_parallel_state():
    """A pooled worker may hold Megatron-core's parallel state from another test;
    FullyShardedDataParallel would use its groups (and reject HSDP, which it was
    not initialized for). Hiding the module makes the whole world the default."""
    return mock.patch.dict(sys.modules, {"megatron.core.parallel_state": None})


def adapter_parity_worker(rank, world, *, strategy, units, microbatches=1, steps=3):
    model = make_model("net")
    batches = make_batches("net", steps, batch=4 * world * microbatches)
    reference = train_reference(model, "net", batches, "adamw")
    # Megatron-LM passes a TransformerConfig; any object with its fields will do.
    config = types.SimpleNamespace(calculate_per_token_loss=False, init_model_with_meta_device=False)
    ddp_config = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    fsdp = FullyShardedDataParallel(config, ddp_config, model, fsdp_unit_modules=[Block] if units else None)
    opt = make_optimizer("adamw")(fsdp.parameters())
    # Megatron-LM's loop: zero the grad buffer, run the microbatches (all but the
    # last under no_sync), finish the grad sync, step, refresh the compute weights.
    for x, y in batches:
        fsdp.zero_grad_buffer()
        opt.zero_grad()
        backward_microbatches(fsdp, x, y, rank, world, microbatches)
        fsdp.finish_grad_sync()
        opt.step()
        fsdp.install_optimized_model_weights()
    fsdp.finish_param_sync()
    names = [n for n, _ in fsdp.named_parameters()]
    return {
        "diff": max_param_diff(mf.get_full_state_dict(fsdp.module), reference),
        "names_match": names == [n for n, _ in reference.named_parameters()],
        "units": len(fsdp.module.units),
        "state_keys": sorted(fsdp.state_dict()),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adapter_trains_like_single_process(pool2, strategy):
    results = pool2.run(adapter_parity_worker, strategy=strategy, units=True, microbatches=2)
    assert max(r["diff"] for r in results) < TOL, results
    assert all(r["names_match"] for r in results)
    # The three Blocks; no_shard merges them into one communication unit (units.py).
    assert results[0]["units"] == (1 if strategy == "no_shard" else 3)
    assert results[0]["state_keys"] == sorted(n for n, _ in make_model("net").named_parameters())


def test_adapter_default_units_plain_model(pool2):
    # No Megatron-core layer in the model: the whole model is one unit (or none for no_shard).
    sharded = pool2.run(adapter_parity_worker, strategy="optim_grads_params", units=False)
    assert max(r["diff"] for r in sharded) < TOL, sharded
    assert sharded[0]["units"] == 1
    replicated = pool2.run(adapter_parity_worker, strategy="no_shard", units=False)
    assert max(r["diff"] for r in replicated) < TOL, replicated
    assert replicated[0]["units"] == 0


def state_dict_roundtrip_worker(rank, world):
    fsdp = FullyShardedDataParallel(
        None, mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params"), make_model("net")
    )
    fresh = make_model("net", seed=7)
    fsdp.load_state_dict(fresh.state_dict())  # full tensors, e.g. a pretrained model
    return max_param_diff(mf.get_full_state_dict(fsdp.module), fresh)


def test_adapter_loads_full_state_dict(pool2):
    assert max(pool2.run(state_dict_roundtrip_worker)) == 0.0


def test_config_conversion_copies_known_fields_and_defaults_the_rest():
    class OtherConfig:  # any object with Megatron's field names
        use_megatron_fsdp = True
        data_parallel_sharding_strategy = "optim_grads"
        overlap_grad_reduce = False
        average_in_collective = True
        some_future_field = 3

    cfg = convert_ddp_config(OtherConfig())
    assert cfg.sharding_strategy is mf.ShardingStrategy.OPTIM_GRADS
    assert cfg.overlap_grad_reduce is False and cfg.average_in_collective is True
    assert cfg.overlap_param_gather is mf.DistributedDataParallelConfig().overlap_param_gather
    ours = mf.DistributedDataParallelConfig()
    assert convert_ddp_config(ours) is ours


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="use_megatron_fsdp=True"):
        convert_ddp_config(mf.DistributedDataParallelConfig(use_megatron_fsdp=False))
    with pytest.raises(TypeError, match="DistributedDataParallelConfig"):
        convert_ddp_config({"data_parallel_sharding_strategy": "no_shard"})
    with pytest.raises(ValueError, match="zero4"):
        convert_ddp_config(types.SimpleNamespace(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero4"))


def construct_error_worker(rank, world, **fields):
    """The error wrapping a model with ``DistributedDataParallelConfig(**fields)`` raises, if any."""
    try:
        with without_megatron_parallel_state():
            FullyShardedDataParallel(None, mf.DistributedDataParallelConfig(**fields), make_model("net"))
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("field", ["keep_fp8_transpose_cache"])
def test_unsupported_feature_is_the_engines_error(pool2, field):
    messages = pool2.run(construct_error_worker, **{field: True})
    assert all(m and m.startswith("NotImplementedError") and f"{field}=True" in m for m in messages), messages


def hsdp_worker(rank, world, *, outer, via_groups, steps=3):
    """HSDP: ``world`` replicas of one-rank shard groups, given as a
    ProcessGroupCollection-like object or derived from the world."""
    model = make_model("net")
    batches = make_batches("net", steps, batch=4 * world)
    reference = train_reference(model, "net", batches, "adamw")
    pg_collection = None
    if via_groups:
        # Every rank creates every group, in the same order (new_group is collective).
        singles = [torch.distributed.new_group([r]) for r in range(world)]
        everyone = torch.distributed.new_group(list(range(world)))
        pg_collection = types.SimpleNamespace(intra_dp_cp=singles[rank], inter_dist_opt=everyone, dp_cp=everyone)
    cfg = mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy=outer,
        num_distributed_optimizer_instances=world,
    )
    with without_megatron_parallel_state():
        fsdp = FullyShardedDataParallel(None, cfg, model, fsdp_unit_modules=[Block], pg_collection=pg_collection)
    opt = mf.fully_shard_optimizer(make_optimizer("adamw")(fsdp.parameters()))
    train_steps(fsdp, opt, batches, rank, world)
    index = fsdp.megatron_fsdp_dist_index
    return {
        "diff": max_param_diff(mf.get_full_state_dict(fsdp.module), reference),
        "sizes": (index.outer_size, index.shard_size),
    }


@pytest.mark.parametrize("via_groups", [True, False], ids=["pg_collection", "world"])
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp_trains_like_single_process(pool2, outer, via_groups):
    results = pool2.run(hsdp_worker, outer=outer, via_groups=via_groups)
    assert max(r["diff"] for r in results) < TOL, results
    assert results[0]["sizes"] == (2, 1)


def test_hsdp_with_bad_instance_count_raises(pool2):
    messages = pool2.run(construct_error_worker, num_distributed_optimizer_instances=3)
    assert all("does not divide the world size 2" in m for m in messages), messages
