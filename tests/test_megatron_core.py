"""Megatron-core's GPTModel (local layer spec) trained through
``FullyShardedDataParallel`` matches Megatron-core's own ``DistributedDataParallel``.

Both sides use a plain ``torch.optim.AdamW``: Megatron's optimizers
(``get_megatron_optimizer``, ``DistributedOptimizer``) want CUDA and apex/TE for
their fused kernels and grad scaling. The reference optimizer reads
``param.main_grad`` through ``param.grad``, which is exactly what Megatron's
``FP32Optimizer`` does before its step; ours reads ``.grad`` of the distributed
parameters that ``finish_grad_sync()`` fills. megatron-core's own CUDA calls on
this CPU machine are bridged by ``mcore_cpu_shim.cpu_shim`` (tests only).
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_cpu_shim import cpu_shim  # noqa: E402
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, convert_ddp_config  # noqa: E402
from megatron_fsdp.compat.megatron_core import (  # noqa: E402
    build_megatron_core_gpt,
    ensure_model_parallel_initialized,
    gpt_args,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# fp32 within the house tolerance. AdamW's eps=1e-4 (the house rule for AdamW parity):
# ZeRO-2/3 reduce-scatter every microbatch and sum the shards, Megatron's DDP sums
# microbatches locally and reduces once, the same sum in another order, and a tiny eps
# turns that rounding in near-zero gradients into large update differences.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5
SEQ, BATCH_PER_RANK = 16, 4


def _batches(steps: int, world: int):
    # One global batch, seen every step: random tokens carry nothing to learn
    # across batches, so "the loss falls" is only observable by fitting one.
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (BATCH_PER_RANK * world, SEQ + 1), generator=g)] * steps


def _lm_loss(model, tokens: torch.Tensor, explicit_mask: bool = True) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    # None: the local softmax builds the causal mask itself.
    causal_mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1) if explicit_mask else None  # True = masked
    return model(inputs, position_ids, causal_mask, labels=labels).mean()  # per-token losses [b, s]


def _global(loss: torch.Tensor) -> float:
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _train(model, opt, batches, rank, world, *, microbatches, after_sync, after_step) -> list[float]:
    """Megatron-LM's step: zero the grad buffer; forward/backward this rank's share
    in microbatches, all but the last under no_sync; finish the gradient sync;
    optimizer step."""
    losses = []
    for tokens in batches:
        model.zero_grad_buffer()
        opt.zero_grad()
        step_loss = 0.0
        for i, micro in enumerate(tokens.chunk(world)[rank].chunk(microbatches)):
            with model.no_sync() if i < microbatches - 1 else contextlib.nullcontext():
                loss = _lm_loss(model, micro) / microbatches
                loss.backward()
            step_loss += loss.detach()
        model.finish_grad_sync()
        after_sync()
        opt.step()
        after_step()
        losses.append(_global(step_loss))
    return losses


def _max_sharded_diff(ours: dict, theirs: dict) -> float:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    diffs = [
        (ours[k].data.float() - theirs[k].data.float()).abs().max().item()
        for k in theirs
        if isinstance(theirs[k], ShardedTensor)
    ]
    return max(diffs)


def mcore_parity_worker(rank, world, *, strategy, use_pg_collection, steps=3):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    with cpu_shim():
        ensure_model_parallel_initialized()  # once per pooled worker process
        args = gpt_args(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, padded_vocab_size=256)
        torch.manual_seed(0)
        ref_model = build_megatron_core_gpt(args)
        torch.manual_seed(0)
        our_model = build_megatron_core_gpt(args)
        config = ref_model.config

        ref = DistributedDataParallel(config, McoreDDPConfig(overlap_grad_reduce=True, bucket_size=4096), ref_model)
        fsdp = FullyShardedDataParallel(
            config,
            McoreDDPConfig(
                use_megatron_fsdp=True,
                use_distributed_optimizer=strategy != "no_shard",
                data_parallel_sharding_strategy=strategy,
                overlap_grad_reduce=True,
                overlap_param_gather=True,
            ),
            our_model,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups() if use_pg_collection else None,
        )
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
        our_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, eps=1e-4)

        def main_grad_to_grad():
            for p in ref.parameters():
                p.grad = p.main_grad

        batches = _batches(steps, world)
        ref_losses = _train(
            ref, ref_opt, batches, rank, world, microbatches=2, after_sync=main_grad_to_grad, after_step=lambda: None
        )
        our_losses = _train(
            fsdp,
            our_opt,
            batches,
            rank,
            world,
            microbatches=2,
            after_sync=lambda: None,
            after_step=fsdp.install_optimized_model_weights,
        )
        fsdp.finish_param_sync()
        with torch.no_grad():
            tokens = batches[0].chunk(world)[rank]
            mask_diff = (_lm_loss(fsdp, tokens) - _lm_loss(fsdp, tokens, explicit_mask=False)).abs().item()

        # Megatron-LM checkpoints the unwrapped model's sharded_state_dict; ours
        # carries the same keys (no "module." prefix) with the main weights.
        ref_sharded, our_sharded = ref.module.sharded_state_dict(), fsdp.sharded_state_dict()
        return {
            "ref_losses": ref_losses,
            "our_losses": our_losses,
            "param_diff": _max_sharded_diff(our_sharded, ref_sharded),
            "mask_diff": mask_diff,
            "sharded_keys_equal": sorted(ref_sharded) == sorted(our_sharded),
            "state_keys_equal": sorted(ref.state_dict()) == sorted(fsdp.state_dict()),
            "units": [type(m).__name__ for u in fsdp.module.units for m in u.modules],
        }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpt_matches_megatron_ddp(pool2, strategy):
    use_pg_collection = strategy in ("optim", "optim_grads_params")
    results = pool2.run(mcore_parity_worker, strategy=strategy, use_pg_collection=use_pg_collection)
    for r in results:
        diffs = [abs(a - b) for a, b in zip(r["our_losses"], r["ref_losses"])]
        assert max(diffs) < LOSS_TOL, (r["our_losses"], r["ref_losses"])
        assert r["our_losses"][-1] < r["our_losses"][0]  # it trains
        assert r["param_diff"] < PARAM_TOL, r["param_diff"]
        assert r["mask_diff"] == 0.0  # attention_mask=None means causal
        assert r["sharded_keys_equal"] and r["state_keys_equal"]
    # TransformerLayer is the default unit for sharded strategies, none for no_shard.
    assert results[0]["units"] == ([] if strategy == "no_shard" else ["TransformerLayer"] * 2)


def test_megatron_ddp_config_conversion():
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig

    with pytest.raises(ValueError, match="use_megatron_fsdp=True"):
        convert_ddp_config(McoreDDPConfig())  # Megatron's default is plain DDP
    cfg = convert_ddp_config(
        McoreDDPConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads",
            overlap_grad_reduce=False,
            check_for_nan_in_grad=True,
            bucket_size=1234,
            grad_reduce_in_fp32=True,
        )
    )
    assert cfg.sharding_strategy.label == "optim_grads"
    assert (cfg.overlap_grad_reduce, cfg.check_for_nan_in_grad, cfg.bucket_size) == (False, True, 1234)
    assert cfg.mixed_precision_policy().main_grads_dtype is torch.float32  # grad_reduce_in_fp32
