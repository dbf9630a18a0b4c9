"""Validation of the parsed flags: Megatron-LM's rules for them, this script's
limits, and the fields derived once the flags are known to be consistent.

Each rule returns its problem as a sentence naming the offending value and the fix;
``collect_problems`` gathers them so one run reports every mistake at once.
Rules that mirror Megatron-LM say so; the rest are limits of this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from .. import device as device_mod
from ..enums import ShardingStrategy
from .arguments import BYTE_VOCAB_SIZE, LRDecayStyle, Precision, TokenizerType


def collect_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    problems: list[str] = []
    for rule in (_required, _model_shape, _batch, _schedule, _data_parallel, _megatron_fsdp, _precision, _data, _io,
                 _optional_packages):
        problems += rule(args, world_size)
    return problems


def _required(args, world_size) -> list[str]:
    # Megatron-LM requires the network size; this script also needs an iteration
    # budget, a micro batch and a learning rate (it has no sample-based training).
    missing = [
        f"--{name.replace('_', '-')}"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                     "micro_batch_size", "train_iters", "lr")
        if getattr(args, name) is None
    ]
    if missing:
        return [f"missing {', '.join(missing)}: pass them on the command line or in --config FILE.yaml "
                "(configs/gpt_tiny_cpu.yaml has working values)"]
    return []


def _positive(args, names) -> list[str]:
    return [
        f"--{n.replace('_', '-')}={getattr(args, n)} must be a positive integer"
        for n in names
        if getattr(args, n) is not None and getattr(args, n) <= 0
    ]


def _model_shape(args, world_size) -> list[str]:
    problems = _positive(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                "max_position_embeddings", "ffn_hidden_size", "vocab_size"))
    if problems or args.hidden_size is None or args.num_attention_heads is None:
        return problems
    if args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size={args.hidden_size} is not divisible by --num-attention-heads="
                        f"{args.num_attention_heads}; pick a head count that divides the hidden size")
    if args.seq_length is not None and args.max_position_embeddings is not None:
        if args.max_position_embeddings < args.seq_length:  # Megatron-LM rule
            problems.append(f"--max-position-embeddings={args.max_position_embeddings} is smaller than "
                            f"--seq-length={args.seq_length}; raise it to at least {args.seq_length}")
    return problems


def _batch(args, world_size) -> list[str]:
    problems = _positive(args, ("micro_batch_size", "global_batch_size", "train_iters", "log_interval"))
    if problems or args.micro_batch_size is None:
        return problems
    # Megatron-LM: a global batch is a whole number of micro batches on every DP rank.
    per_step = args.micro_batch_size * world_size
    if args.global_batch_size is not None and args.global_batch_size % per_step:
        problems.append(
            f"--global-batch-size={args.global_batch_size} is not divisible by --micro-batch-size="
            f"{args.micro_batch_size} x data-parallel size {world_size} = {per_step}; use a multiple of {per_step}"
        )
    if args.exit_interval is not None and args.exit_interval <= 0:
        problems.append(f"--exit-interval={args.exit_interval} must be positive")
    return problems


def _schedule(args, world_size) -> list[str]:
    problems = []
    if args.lr is not None and args.min_lr > args.lr:  # Megatron-LM rule
        problems.append(f"--min-lr={args.min_lr} is larger than --lr={args.lr}; lower --min-lr")
    if args.lr_warmup_iters < 0:
        problems.append(f"--lr-warmup-iters={args.lr_warmup_iters} must be >= 0")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if decay_iters is not None:
        if decay_iters <= 0:
            problems.append(f"--lr-decay-iters={decay_iters} must be positive")
        elif args.lr_warmup_iters >= decay_iters and args.lr_warmup_iters > 0:
            # Megatron-LM's scheduler: warmup must end before the decay horizon.
            problems.append(f"--lr-warmup-iters={args.lr_warmup_iters} must be smaller than the decay horizon "
                            f"({decay_iters} iterations); shorten the warmup or raise --lr-decay-iters")
    if args.clip_grad < 0:
        problems.append(f"--clip-grad={args.clip_grad} must be >= 0 (0 disables clipping)")
    return problems


def _data_parallel(args, world_size) -> list[str]:
    problems = []
    if args.use_megatron_fsdp and args.use_torch_fsdp2:  # Megatron-LM: the two are exclusive
        problems.append("--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive; keep --use-megatron-fsdp")
    elif args.use_torch_fsdp2:
        problems.append("--use-torch-fsdp2 is not implemented by this script; use --use-megatron-fsdp "
                        "(or no FSDP flag for PyTorch DDP)")
    if args.use_distributed_optimizer and not args.use_megatron_fsdp:
        problems.append("--use-distributed-optimizer without --use-megatron-fsdp (Megatron-LM's DDP + distributed "
                        "optimizer) is not implemented here; add --use-megatron-fsdp "
                        "--data-parallel-sharding-strategy optim for the same ZeRO-1 sharding")
    if args.overlap_param_gather:  # Megatron-LM rules
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            problems.append("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp")
        if not args.overlap_grad_reduce:
            problems.append("--overlap-param-gather needs --overlap-grad-reduce; add --overlap-grad-reduce")
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        problems.append(f"--num-distributed-optimizer-instances={instances} must be >= 1")
    elif instances > 1:
        if not args.use_distributed_optimizer:  # Megatron-LM: partial DistOpt needs DistOpt
            problems.append(f"--num-distributed-optimizer-instances={instances} needs --use-distributed-optimizer")
        if world_size % instances:
            problems.append(f"--num-distributed-optimizer-instances={instances} does not divide the data-parallel "
                            f"size {world_size}; use a divisor of {world_size}")
    return problems


def _megatron_fsdp(args, world_size) -> list[str]:
    problems = []
    fsdp_only = {
        "--fsdp-double-buffer": args.fsdp_double_buffer,
        "--use-nccl-ub": args.use_nccl_ub,
        "--suggested-communication-unit-size": args.suggested_communication_unit_size is not None,
        f"--num-distributed-optimizer-instances={args.num_distributed_optimizer_instances}":
            args.num_distributed_optimizer_instances > 1,
        f"--outer-dp-sharding-strategy={args.outer_dp_sharding_strategy}":
            args.outer_dp_sharding_strategy != ShardingStrategy.NO_SHARD.label,
    }
    if not args.use_megatron_fsdp:
        for flag, given in fsdp_only.items():
            if given:
                problems.append(f"{flag} only applies to Megatron-FSDP; add --use-megatron-fsdp or drop it")
        return problems
    strategy = ShardingStrategy.parse(args.data_parallel_sharding_strategy, arg_name="--data-parallel-sharding-strategy")
    # Megatron-LM: Megatron-FSDP runs on the distributed optimizer ...
    if not args.use_distributed_optimizer:
        problems.append("--use-megatron-fsdp needs --use-distributed-optimizer (Megatron-LM's rule); add it")
    # ... and sharded gradients cannot use fused wgrad accumulation into main_grad.
    if strategy.shards_grads and args.gradient_accumulation_fusion:
        problems.append(f"--data-parallel-sharding-strategy={strategy.label} shards gradients, which Megatron-LM "
                        "does not allow with gradient accumulation fusion; add --no-gradient-accumulation-fusion")
    if args.outer_dp_sharding_strategy == ShardingStrategy.OPTIM.label:
        if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            problems.append(f"--outer-dp-sharding-strategy=optim (HFSDP) needs --data-parallel-sharding-strategy="
                            f"optim_grads_params, got {strategy.label}")
        if args.num_distributed_optimizer_instances < 2:
            problems.append("--outer-dp-sharding-strategy=optim needs an outer group: set "
                            "--num-distributed-optimizer-instances >= 2 (or use no_shard)")
    if args.suggested_communication_unit_size is not None and args.suggested_communication_unit_size <= 0:
        problems.append(f"--suggested-communication-unit-size={args.suggested_communication_unit_size} "
                        "must be a positive number of elements")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # Megatron-LM rule for FSDP on GPUs
        problems.append("Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1; unset it")
    return problems


def _precision(args, world_size) -> list[str]:
    problems = []
    if args.bf16 and args.fp16:  # Megatron-LM rule
        problems.append("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.loss_scale is not None and not args.fp16:
        problems.append(f"--loss-scale={args.loss_scale} only applies to --fp16; add --fp16 or drop it")
    if args.loss_scale is not None and args.loss_scale <= 0:
        problems.append(f"--loss-scale={args.loss_scale} must be positive")
    return problems


def _data(args, world_size) -> list[str]:
    problems = []
    if args.mock_data and args.data_path:  # Megatron-LM: a single data source
        problems.append("--mock-data and --data-path are exclusive; pick one data source")
    for path in args.data_path or ():
        if not os.path.isfile(path):
            problems.append(f"--data-path {path!r}: no such file; pass plain-text files (or drop --data-path "
                            "for the corpus in data/)")
    tokenizer = TokenizerType(args.tokenizer_type) if args.tokenizer_type else None
    if tokenizer is TokenizerType.NULL:
        if not args.mock_data or args.vocab_size is None:
            problems.append("--tokenizer-type NullTokenizer needs --mock-data and --vocab-size")
    elif args.vocab_size is not None and args.vocab_size != BYTE_VOCAB_SIZE:
        problems.append(f"--vocab-size={args.vocab_size} needs --tokenizer-type NullTokenizer --mock-data; "
                        f"the byte tokenizer has {BYTE_VOCAB_SIZE} tokens")
    try:
        weights = [float(w) for w in args.split.replace(" ", "").split(",")]
        if len(weights) > 3 or weights[0] <= 0 or any(w < 0 for w in weights):
            raise ValueError
    except ValueError:
        problems.append(f"--split {args.split!r} must be up to three non-negative weights, train first and > 0, "
                        "e.g. 969,30,1")
    return problems


def _io(args, world_size) -> list[str]:
    problems = []
    if args.save is not None and (args.save_interval is None or args.save_interval <= 0):  # Megatron-LM rule
        problems.append(f"--save {args.save!r} needs a positive --save-interval")
    if args.ckpt_step is not None and args.load is None:
        problems.append(f"--ckpt-step={args.ckpt_step} needs --load DIR (the checkpoint root to read it from)")
    if args.eval_iters < 0:
        problems.append(f"--eval-iters={args.eval_iters} must be >= 0 (0 disables evaluation)")
    if args.eval_iters > 0 and args.eval_interval <= 0:
        problems.append(f"--eval-interval={args.eval_interval} must be positive when --eval-iters > 0")
    return problems


def _optional_packages(args, world_size) -> list[str]:
    # Checked here, before torch.distributed starts, so a missing package or device
    # is one message instead of a traceback from every rank.
    if args.distributed_backend == "nccl" and not device_mod.cuda_available():
        return ["--distributed-backend nccl needs CUDA, which this torch/machine lacks; use gloo (the default "
                "without CUDA)"]
    if not args.use_mcore_models:
        return []
    if importlib.util.find_spec("megatron") is None:
        return ["--use-mcore-models needs megatron-core, which is not installed; run "
                "`bash scripts/setup_megatron_core.sh` (pip install --no-deps megatron-core), or drop the flag "
                "to train the embedded GPT"]
    if not device_mod.cuda_available() or args.distributed_backend == "gloo":
        # megatron-core's GPTModel allocates attention buffers and RNG state on torch.cuda.current_device().
        return ["--use-mcore-models needs CUDA: Megatron-core's GPTModel forward allocates on the current CUDA "
                "device; run it on GPUs with the nccl backend, or drop the flag to train the embedded GPT on CPU"]
    return []


def derive_fields(args: argparse.Namespace, world_size: int) -> None:
    """Fill Megatron-LM's derived values and parse strings into enums, once."""
    args.world_size = world_size
    args.data_parallel_size = world_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * world_size
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * world_size)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    args.zero_strategy = ShardingStrategy.parse(args.data_parallel_sharding_strategy)
    args.outer_strategy = ShardingStrategy.parse(args.outer_dp_sharding_strategy)
    args.lr_decay = LRDecayStyle(args.lr_decay_style)
    args.precision = Precision.BF16 if args.bf16 else Precision.FP16 if args.fp16 else Precision.FP32
    if args.tokenizer_type is None:
        args.tokenizer_type = TokenizerType.BYTE.value
    args.tokenizer = TokenizerType(args.tokenizer_type)
    if args.tokenizer is TokenizerType.BYTE:
        args.vocab_size = BYTE_VOCAB_SIZE
    if args.plot_path is not None and args.plot_path.lower() == "none":
        args.plot_path = None
    # Megatron-LM: dynamic loss scaling treats Inf/NaN gradients as a signal, not an error.
    if args.fp16 and args.loss_scale is None:
        args.check_for_nan_in_loss_and_grad = False
