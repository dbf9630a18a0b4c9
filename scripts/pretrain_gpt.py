#!/usr/bin/env python3
"""Pretrain a GPT with megatron_fsdp, launched like Megatron-LM's pretrain_gpt.py.

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --config configs/gpt_tiny_cpu.yaml

Flags keep Megatron-LM's names and defaults (``--use-megatron-fsdp``,
``--data-parallel-sharding-strategy``, ``--micro-batch-size``, ...); ``--config``
reads the same flags from YAML and the command line overrides the file. Without
``--use-megatron-fsdp`` the same model trains under PyTorch DDP, for comparison.
The default data is the byte-level text corpus in ``data/``; ``--mock-data``
generates sequences instead.

This file is the driver, read top to bottom; the pieces live in
``megatron_fsdp/training/``. Mixed precision: ``--bf16`` casts the model before
Megatron-FSDP wraps it (fp32 main weights by default); ``--fp16`` adds dynamic loss
scaling (or ``--loss-scale`` for a constant one).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_fsdp import device as device_mod
from megatron_fsdp.training import checkpointing
from megatron_fsdp.training.arguments import ArgumentError, parse_args
from megatron_fsdp.training.data import BatchLayout, build_datasets
from megatron_fsdp.training.logging_utils import (
    IntervalStats,
    MetricsRecorder,
    flops_per_iteration,
    format_iteration_line,
    log_memory,
    log_validation,
    setup_logging,
)
from megatron_fsdp.training.loss_scaler import LossScaler
from megatron_fsdp.training.lr_schedule import LRSchedule
from megatron_fsdp.training.model_setup import setup_model_and_optimizer
from megatron_fsdp.training.plot import plot_loss_curve
from megatron_fsdp.training.training_step import StepContext, TrainState, evaluate, train_step

logger = logging.getLogger("megatron_fsdp.pretrain")


def initialize_distributed(args) -> torch.device:
    """Join torchrun's process group (or a one-rank group for a plain ``python`` run)."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    backend = args.distributed_backend or ("nccl" if device_mod.cuda_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    return device


def describe_run(args, device: torch.device, num_parameters: int) -> None:
    if args.use_megatron_fsdp:
        hsdp = (f", HSDP outer={args.num_distributed_optimizer_instances} ({args.outer_strategy.label})"
                if args.num_distributed_optimizer_instances > 1 else "")
        wrapper = f"Megatron-FSDP ({args.zero_strategy.label}{hsdp})"
    else:
        wrapper = "PyTorch DistributedDataParallel"
    data = "mock data" if args.mock_data else ", ".join(args.data_path or ["data/corpus.txt"])
    logger.info("> training %s GPT with %s on %d ranks (%s, %s), %s weights",
                "Megatron-core" if args.use_mcore_models else "embedded", wrapper, args.world_size,
                dist.get_backend(), device.type, args.precision.value)
    logger.info(" > number of parameters: %d", num_parameters)
    logger.info("> data: %s (%s), global batch %d = micro batch %d x %d micro batches x %d ranks",
                data, args.tokenizer.value, args.global_batch_size, args.micro_batch_size,
                args.num_microbatches, args.data_parallel_size)


def checkpoint_extra_state(ctx: StepContext, state: TrainState) -> dict:
    return {
        "train_state": state.state_dict(),
        "lr_schedule": ctx.schedule.state_dict(),
        "loss_scaler": ctx.scaler.state_dict() if ctx.scaler is not None else None,
        "rng": checkpointing.rng_state(),
    }


def restore(args, ctx: StepContext, state: TrainState) -> None:
    optimizer = None if args.no_load_optim else ctx.bundle.optimizer
    extra = checkpointing.load(args.load, ctx.bundle.model, optimizer, step=args.ckpt_step)
    if not extra:
        return
    state.load_state_dict(extra["train_state"])
    ctx.schedule.load_state_dict(extra["lr_schedule"])
    if ctx.scaler is not None and extra.get("loss_scaler"):
        ctx.scaler.load_state_dict(extra["loss_scaler"])
    if not args.no_load_rng:
        checkpointing.set_rng_state(extra["rng"])


def maybe_evaluate(args, ctx, state, valid_src, metrics) -> None:
    if valid_src is None or args.eval_iters == 0:
        return
    loss = evaluate(ctx, valid_src, args.eval_iters)
    log_validation(state.iteration, loss)
    metrics.validation.append((state.iteration, loss))


def train(args, ctx: StepContext, state: TrainState, train_src, valid_src, metrics: MetricsRecorder) -> int:
    """Run iterations until ``--train-iters`` (or ``--exit-interval``); returns the
    iteration of the last checkpoint saved (0 if none)."""
    flops = flops_per_iteration(args, ctx.bundle.num_parameters)
    stats = IntervalStats()
    memory_logged = False
    last_saved = 0
    while state.iteration < args.train_iters:
        device_mod.synchronize(ctx.device)
        start = time.perf_counter()
        result = train_step(ctx, state, train_src)
        device_mod.synchronize(ctx.device)
        elapsed = time.perf_counter() - start
        state.floating_point_operations_so_far += flops
        stats.add(result, elapsed)
        metrics.record(state.iteration, result)

        if state.iteration % args.log_interval == 0:
            tflops = flops * stats.iterations / max(stats.elapsed_s, 1e-9) / args.world_size / 1e12
            logger.info(format_iteration_line(
                iteration=state.iteration, train_iters=args.train_iters,
                consumed_samples=state.consumed_train_samples, stats=stats, tflops_per_gpu=tflops,
                learning_rate=result.learning_rate, global_batch_size=args.global_batch_size,
                loss_scale=result.loss_scale))
            stats = IntervalStats()
        # Megatron-LM reports memory once, after the first log interval (or at the
        # end of a run shorter than one interval).
        if not memory_logged and (state.iteration % args.log_interval == 0 or state.iteration == args.train_iters):
            metrics.memory = log_memory(ctx.bundle.model, ctx.device, state.iteration)
            memory_logged = True

        if args.eval_iters and state.iteration % args.eval_interval == 0:
            maybe_evaluate(args, ctx, state, valid_src, metrics)
        if args.save and state.iteration % args.save_interval == 0:
            checkpointing.save(args.save, state.iteration, ctx.bundle.model, ctx.bundle.optimizer,
                               checkpoint_extra_state(ctx, state))
            last_saved = state.iteration
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            logger.info("exiting program at iteration %d (--exit-interval %d)", state.iteration, args.exit_interval)
            break
    return last_saved


def run(args, device: torch.device) -> int:
    train_src, valid_src = build_datasets(args)
    bundle = setup_model_and_optimizer(args, device)
    describe_run(args, device, bundle.num_parameters)
    layout = BatchLayout(micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
                         dp_rank=dist.get_rank(), dp_size=args.data_parallel_size)
    ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=LossScaler.from_args(args),
                      layout=layout, device=device, clip_grad=args.clip_grad,
                      per_token_loss=args.calculate_per_token_loss,
                      check_for_nan=args.check_for_nan_in_loss_and_grad)
    state = TrainState()
    if args.load:
        restore(args, ctx, state)
        if state.iteration:
            logger.info("> resuming at iteration %d, %d samples consumed", state.iteration,
                        state.consumed_train_samples)

    metrics = MetricsRecorder()
    start_iteration = state.iteration
    last_saved = train(args, ctx, state, train_src, valid_src, metrics)

    if args.save and state.iteration > start_iteration and last_saved != state.iteration:
        checkpointing.save(args.save, state.iteration, bundle.model, bundle.optimizer,
                           checkpoint_extra_state(ctx, state))
    if args.eval_iters and state.iteration % args.eval_interval != 0 and state.iteration > start_iteration:
        maybe_evaluate(args, ctx, state, valid_src, metrics)
    if dist.get_rank() == 0:
        write_outputs(args, metrics)
    # Leave together, with no collective in flight: a ZeRO-1/2 step ends with an
    # asynchronous weight gather, and gloo aborts a process whose group is torn down
    # under a pending operation or a peer that is still busy.
    if hasattr(bundle.model, "finish_param_sync"):
        bundle.model.finish_param_sync()
    dist.barrier()
    return 0


def write_outputs(args, metrics: MetricsRecorder) -> None:
    if args.log_json:
        metrics.write(args.log_json, config={k: v for k, v in vars(args).items() if _jsonable(v)})
        logger.info("> metrics written to %s", args.log_json)
    if args.plot_path and metrics.iterations:
        title = f"{'Megatron-FSDP ' + args.zero_strategy.label if args.use_megatron_fsdp else 'DDP'}, " \
                f"{args.world_size} ranks"
        if plot_loss_curve(args.plot_path, metrics.iterations, metrics.lm_loss, metrics.validation, title):
            logger.info("> loss curve written to %s", args.plot_path)


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list))


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    device = initialize_distributed(args)
    setup_logging(dist.get_rank())
    try:
        return run(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
