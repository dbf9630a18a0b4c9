"""Validation of ``--use-torch-fsdp2`` (PyTorch FSDP2, ``torch_fsdp2.py``) and the flags
that go with it, called by ``validation.py``: problems (a sentence naming the value and
the fix each) before any process group, and warnings for flags that change nothing
under FSDP2 -- which Megatron-LM ignores without a word.

Megatron-LM's own asserts for the flag (megatron/training/arguments.py) say so; the
rest refuse what FSDP2 here (and in Megatron-LM) cannot do right. Tensor, pipeline,
context and expert parallelism are 1 here anyway, so its asserts on those are moot.
Pure argument handling, no torch.
"""

from __future__ import annotations

import argparse
from typing import Mapping

# Flags that only move gradients in Megatron-core DDP's buffers or Megatron-FSDP's: Megatron-LM's
# FSDP2 config carries reshard_after_forward alone (training.py, get_megatron_ddp_config).
_NO_EFFECT = {
    "--grad-reduce-in-bf16": "gradients are reduced in the weights' compute dtype (bf16 with --bf16)",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in the weights' compute dtype (bf16 with --bf16)",
    "--ddp-average-in-collective": "FSDP2's reduce-scatter averages over the data-parallel ranks by itself",
    "--data-parallel-sharding-strategy": "FSDP2 always shards weights, gradients and optimizer state "
                                         "(--torch-fsdp2-no-reshard-after-forward keeps the weights gathered "
                                         "from forward to backward)",
    "--overlap-grad-reduce": "FSDP2 overlaps its reduce-scatters with backward by itself",
}


def _given(args: argparse.Namespace) -> Mapping:
    return getattr(args, "given_flags", {})


def torch_fsdp2_problems(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    if not args.use_torch_fsdp2:
        return []
    problems = []
    # -- Megatron-LM's asserts for --use-torch-fsdp2 ------------------------------------------
    if args.use_distributed_optimizer:
        problems.append("--use-torch-fsdp2 with --use-distributed-optimizer: FSDP2 shards the optimizer state "
                        "itself, and Megatron-LM refuses its distributed optimizer on top; drop "
                        "--use-distributed-optimizer")
    if args.gradient_accumulation_fusion:
        problems.append("--use-torch-fsdp2 needs --no-gradient-accumulation-fusion (Megatron-LM's rule: the fused "
                        "kernels accumulate weight gradients into Megatron DDP's main_grad buffers, which FSDP2 does "
                        "not have); add --no-gradient-accumulation-fusion")
    if not args.untie_embeddings_and_output_weights:
        problems.append("--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (Megatron-LM's rule: it "
                        "shards the embedding and the output layer as different FSDP2 units, which cannot share one "
                        "weight); add --untie-embeddings-and-output-weights")
    if args.fp16:
        problems.append("--use-torch-fsdp2 with --fp16: Megatron-LM does not support FSDP2 with fp16 (yet); use "
                        "--bf16, or --fp16 without --use-torch-fsdp2")
    if args.ckpt_format == "torch":  # fsdp_dtensor: refused by validation's Megatron-FSDP rule
        problems.append("--use-torch-fsdp2 with --ckpt-format torch: Megatron-LM's rule is --ckpt-format torch_dist "
                        "or torch_dcp (FSDP2's weights are sharded DTensors); use --ckpt-format torch_dist")
    if environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        problems.append("--use-torch-fsdp2 needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1 (Megatron-LM's rule: "
                        "FSDP2 overlaps communication with compute); unset it")
    # -- what FSDP2 cannot do right ------------------------------------------------------------
    if args.calculate_per_token_loss:
        problems.append("--use-torch-fsdp2 with --calculate-per-token-loss: Megatron-LM's FSDP2 wrapper skips the "
                        "division of the gradients by the global token count (its scale_gradients does nothing), "
                        "so it trains on unnormalised gradients; drop --calculate-per-token-loss, or use "
                        "--use-megatron-fsdp for per-token loss")
    if args.check_weight_hash_across_dp_replicas_interval:
        problems.append(f"--check-weight-hash-across-dp-replicas-interval "
                        f"{args.check_weight_hash_across_dp_replicas_interval} with --use-torch-fsdp2: FSDP2 shards "
                        "every weight, so no rank holds a replica of another's to compare; drop the flag")
    return problems


def torch_fsdp2_warnings(args: argparse.Namespace) -> list[str]:
    given = _given(args)
    if not args.use_torch_fsdp2:
        if "--torch-fsdp2-no-reshard-after-forward" in given:
            return ["--torch-fsdp2-no-reshard-after-forward has no effect without --use-torch-fsdp2 (as in "
                    "Megatron-LM); add --use-torch-fsdp2 or drop it"]
        return []
    return [f"{flag} has no effect with --use-torch-fsdp2: {why}" for flag, why in _NO_EFFECT.items()
            if flag in given]
