"""Validation of ``--megatron-fsdp-version 2`` (Megatron-LM's ``FullyShardedDataParallelV2``,
``training/megatron_fsdp_v2.py``), called by ``validation.py``: a sentence per problem, naming
the value and the fix, before any process group. Pure argument handling, no torch.

Megatron-LM's own rules (its argument check and ``FullyShardedDataParallelV2._validate_config``)
come first; the rest are what v2 does not run here yet, each pointing at version 1, which does.
"""

from __future__ import annotations

import argparse

_V1 = "use --megatron-fsdp-version 1 (the default), which supports it"


def fsdp_v2_problems(args: argparse.Namespace) -> list[str]:
    if getattr(args, "megatron_fsdp_version", 1) != 2:
        return []
    if not args.use_megatron_fsdp:
        return ["--megatron-fsdp-version 2 selects Megatron-FSDP's implementation and needs --use-megatron-fsdp; "
                "add --use-megatron-fsdp or drop the flag"]
    return _megatron_lm_rules(args) + _not_here(args)


def _megatron_lm_rules(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.use_distributed_optimizer:
        problems.append("--megatron-fsdp-version 2 with --use-distributed-optimizer: v2 steps a plain optimizer on "
                        "the sharded weights and Megatron-LM refuses the distributed optimizer with it; drop "
                        "--use-distributed-optimizer")
    if args.data_parallel_sharding_strategy != "optim_grads_params":
        problems.append(f"--megatron-fsdp-version 2 with --data-parallel-sharding-strategy "
                        f"{args.data_parallel_sharding_strategy}: v2 shards weights, gradients and optimizer state "
                        "(Megatron-LM's rule); use --data-parallel-sharding-strategy optim_grads_params, or "
                        "version 1 for the other strategies")
    if args.outer_dp_sharding_strategy != "no_shard":
        problems.append(f"--megatron-fsdp-version 2 with --outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: "
                        f"v2 has no outer data-parallel sharding (Megatron-LM's rule); {_V1}")
    if args.gradient_accumulation_fusion:
        problems.append("--megatron-fsdp-version 2 needs --no-gradient-accumulation-fusion (Megatron-LM's rule: the "
                        "fused kernels accumulate into main_grad buffers v2 does not have); add "
                        "--no-gradient-accumulation-fusion")
    if args.calculate_per_token_loss:
        problems.append(f"--megatron-fsdp-version 2 with --calculate-per-token-loss: v2 does not normalise gradients "
                        f"by the global token count (Megatron-LM's rule); {_V1}")
    for flag, size in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                       ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                       ("--context-parallel-size", args.context_parallel_size)):
        if size != 1:
            problems.append(f"--megatron-fsdp-version 2 with {flag} {size}: v2 shards over data parallelism only "
                            f"(Megatron-LM's rule); {_V1}")
    return problems


def _not_here(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.expert_model_parallel_size != 1:
        problems.append(f"--megatron-fsdp-version 2 with --expert-model-parallel-size "
                        f"{args.expert_model_parallel_size}: v2 does not lay out the expert mesh here; {_V1}")
    if args.fp16:
        problems.append(f"--megatron-fsdp-version 2 with --fp16: v2 runs fp32 or --bf16 here; use --bf16, or {_V1}")
    if args.ckpt_format == "torch":
        problems.append("--megatron-fsdp-version 2 with --ckpt-format torch: Megatron-FSDP checkpoints sharded "
                        "weights (--ckpt-format fsdp_dtensor or torch_dist); use --ckpt-format fsdp_dtensor")
    if args.init_model_with_meta_device:
        problems.append(f"--megatron-fsdp-version 2 with --init-model-with-meta-device: v2 shards a model built with "
                        f"its weights here; drop the flag, or {_V1}")
    return problems
