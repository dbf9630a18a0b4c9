"""Pretrain a GPT with megatron_fsdp, launched like Megatron-LM's pretrain_gpt.py.

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --config configs/gpt_tiny_cpu.yaml
    torchrun --nproc-per-node 2 -m megatron_fsdp.training.pretrain_gpt --config ...   # the same
    torchrun --nproc-per-node 2 --no-python megatron-fsdp-pretrain-gpt --config ...   # installed command

Flags keep Megatron-LM's names and defaults (``--use-megatron-fsdp``,
``--data-parallel-sharding-strategy``, ``--micro-batch-size``, ...); ``--config``
reads the same flags from YAML and the command line overrides the file. Without
``--use-megatron-fsdp`` the same model trains under PyTorch DDP, for comparison.
The default data is the byte-level text corpus in ``data/``; ``--data-path`` reads
Megatron indexed datasets and ``--mock-data`` Megatron-LM's mock documents.

This module is the driver, read top to bottom; the pieces live beside it in
``megatron_fsdp/training/``; ``scripts/pretrain_gpt.py`` (the path Megatron-LM users type)
runs it. Mixed precision: ``--bf16`` casts the model before
Megatron-FSDP wraps it (fp32 main weights by default); ``--fp16`` adds dynamic loss
scaling (or ``--loss-scale`` for a constant one).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fsdp.comm import device as device_mod
from megatron_fsdp.training.checkpoint import dcp_checkpoint as checkpointing, hf_weights, mcore_dist, torch_checkpoint
from megatron_fsdp.training import determinism
from megatron_fsdp.models.config import MoELoadBalancing
from megatron_fsdp.training.args.arg_types import DataParallelPath
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.data import BatchLayout
from megatron_fsdp.training.data.sources import build_sources
from megatron_fsdp.training.observe.logging_utils import (
    IntervalStats,
    MetricsRecorder,
    format_iteration_line,
    log_memory,
    log_validation,
    memory_snapshot,
    setup_logging,
    validation_ppl,
)
from megatron_fsdp.training.observe import tensorboard as dashboards_mod
from megatron_fsdp.training.observe.flops import num_floating_point_operations
from megatron_fsdp.training.observe.profiling import RunProfiler
from megatron_fsdp.training.exit_conditions import ExitConditions
from megatron_fsdp.training.observe.timers import Timers
from megatron_fsdp.training.optim.loss_scaler import LossScaler
from megatron_fsdp.training.optim.lr_schedule import LRSchedule, ScheduleResume
from megatron_fsdp.training.model_setup import gpt_config_from_args, setup_model_and_optimizer
from megatron_fsdp.training.observe.plot import plot_loss_curve
from megatron_fsdp.training.observe.replica_check import check_weight_replicas
from megatron_fsdp.training.training_step import StepContext, TrainState, evaluate, train_step

logger = logging.getLogger("megatron_fsdp.pretrain")


def initialize_distributed(args) -> torch.device:
    """Join torchrun's process group (or a one-rank group for a plain ``python`` run)."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    if args.deterministic_mode:  # before the communicators and the first GEMM read the environment
        determinism.apply()
    backend = args.distributed_backend or ("nccl" if device_mod.cuda_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        device_mod.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    return device


def describe_run(args, device: torch.device, num_parameters: int) -> None:
    hsdp = (f", {args.num_distributed_optimizer_instances} optimizer instances ({args.outer_strategy.label} "
            "across them)" if args.num_distributed_optimizer_instances > 1 else "")
    if args.dp_path is DataParallelPath.MEGATRON_FSDP:
        wrapper = f"Megatron-FSDP ({args.zero_strategy.label}{hsdp})"
    elif args.dp_path is DataParallelPath.MEGATRON_DDP:
        optimizer = "distributed optimizer" if args.use_distributed_optimizer else "optimizer"
        wrapper = (f"Megatron-core DDP + {optimizer} on Megatron-FSDP's {args.zero_strategy.label} ("
                   f"{args.megatron_fsdp_main_grads_dtype} gradients, fp32 main weights{hsdp})")
    elif args.dp_path is DataParallelPath.TORCH_FSDP2:
        reshard = "" if args.torch_fsdp2_reshard_after_forward else ", no reshard after forward"
        wrapper = f"PyTorch FSDP2 (fully_shard{reshard})"
    elif args.dp_path is DataParallelPath.MEGATRON_FSDP_V2:
        wrapper = "Megatron-FSDP v2 (per-module fully_shard, optim_grads_params, plain optimizer)"
    else:
        wrapper = "PyTorch DistributedDataParallel"
    data = "mock data" if args.mock_data else ", ".join(args.data_path or ["data/corpus.txt"])
    logger.info("> training %s GPT with %s on %d ranks (%s, %s), %s weights",
                "Megatron-core" if args.use_mcore_models else "embedded", wrapper, args.world_size,
                dist.get_backend(), device.type, args.precision.value)
    logger.info(" > number of parameters: %d", num_parameters)
    logger.info("> data: %s (%s), global batch %d = micro batch %d x %d micro batches x %d ranks",
                data, args.tokenizer_type, args.global_batch_size, args.micro_batch_size,
                args.num_microbatches, args.data_parallel_size)
    if (args.eval_global_batch_size, args.eval_micro_batch_size) != (args.global_batch_size, args.micro_batch_size):
        logger.info("> evaluation: global batch %d = micro batch %d x %d micro batches x %d ranks",
                    args.eval_global_batch_size, args.eval_micro_batch_size, args.eval_num_microbatches,
                    args.data_parallel_size)
    ramp = args.batch_schedule.rampup
    if ramp is not None:
        logger.info("> batch size rampup from global batch size %d to %d in increments of %d over %d samples "
                    "(%d iterations in all)", ramp.start, args.global_batch_size, ramp.increment, ramp.ramp_samples,
                    args.train_iters)
    steps = args.batch_schedule.steps
    if steps is not None:  # thresholds are tokens of --seq-length, as in Megatron-LM
        logger.info("> step batch size schedule %r (%d iterations in all): %s", steps.text, args.train_iters,
                    ", ".join(f"{s.global_batch_size} from {s.samples} samples ({s.samples * args.seq_length} tokens)"
                              for s in steps.steps))


def checkpoint_extra_state(args, ctx: StepContext, state: TrainState) -> dict:
    """What a checkpoint holds besides the weights and the optimizer: progress, schedule,
    loss scale, RNG, and the run's plain-valued flags (``args``, as Megatron-LM keeps them:
    ``python -m megatron_fsdp.convert`` reads the architecture from them)."""
    return {
        "args": torch_checkpoint.plain_args(args),
        "train_state": state.state_dict(),
        "lr_schedule": ctx.schedule.state_dict(),
        "loss_scaler": ctx.scaler.state_dict() if ctx.scaler is not None else None,
        "rng": checkpointing.rng_state(ctx.device),
    }


def checkpoint_source(args) -> tuple[Optional[str], bool]:
    """(directory to read, weights only): --load, or Megatron-LM's --pretrained-checkpoint
    with --finetune's semantics when --load holds no checkpoint (or is not given)."""
    def holds(path: Optional[str]) -> bool:
        return bool(path) and (hf_weights.is_hf_directory(path) or checkpointing.read_tracker(path) is not None
                               or torch_checkpoint.holds_checkpoint(path, args.ckpt_step))

    if args.pretrained_checkpoint and not holds(args.load):
        if not holds(args.pretrained_checkpoint):  # Megatron-LM's rule: one of the two must hold one
            raise FileNotFoundError(f"no checkpoint in --load {args.load} nor in --pretrained-checkpoint "
                                    f"{args.pretrained_checkpoint} (a checkpoint root with its tracker file, or a "
                                    "Hugging Face directory with config.json and safetensors); check the paths")
        logger.info("> no checkpoint in --load %s: fine-tuning from --pretrained-checkpoint %s", args.load,
                    args.pretrained_checkpoint)
        return args.pretrained_checkpoint, True
    return args.load, args.finetune or hf_weights.is_hf_directory(args.load)


def restore(args, ctx: StepContext, state: TrainState) -> None:
    """Megatron-LM's resume: weights always; progress unless --finetune; optimizer,
    learning-rate schedule and loss scale unless --no-load-optim or --finetune (Megatron-LM
    loads the three together: with --no-load-optim the schedule restarts, warmup
    included, while the iteration count goes on); RNG unless --no-load-rng or
    --finetune. The format is the one on disk, whatever --ckpt-format says (as
    Megatron-LM's loader tells them apart); a Hugging Face directory is a fine-tune's start."""
    path, finetune = checkpoint_source(args)
    if hf_weights.is_hf_directory(path):
        hf_weights.load_hf_weights(ctx.bundle.model, path, gpt_config_from_args(args))
        return
    optimizer = None if (args.no_load_optim or finetune) else ctx.bundle.optimizer
    if torch_checkpoint.holds_checkpoint(path, args.ckpt_step):
        extra = torch_checkpoint.load(path, ctx.bundle.model, optimizer, step=args.ckpt_step, finetune=finetune)
    elif mcore_dist.holds_checkpoint(path, args.ckpt_step):
        if optimizer is not None and not mcore_dist.holds_optimizer_state(path, args.ckpt_step):
            optimizer = None  # a weights-only checkpoint (converted): read as --finetune reads one
        extra = mcore_dist.load(path, ctx.bundle.model, optimizer, gpt_config_from_args(args), step=args.ckpt_step)
    else:
        if optimizer is not None and not checkpointing.holds_optimizer_state(path, args.ckpt_step):
            optimizer = None  # a weights-only checkpoint (converted): read as --finetune reads one
        extra = checkpointing.load(path, ctx.bundle.model, optimizer, step=args.ckpt_step)
    if extra is None:  # no checkpoint there (Megatron-LM's warning was logged)
        return
    if finetune or "train_state" not in extra:
        logger.info("> %s: loaded the weights only; iteration, schedule and optimizer start fresh",
                    "--finetune" if finetune else "a weights-only checkpoint (python -m megatron_fsdp.convert)")
        return
    state.load_state_dict(extra["train_state"])
    if args.no_load_optim:
        logger.info("> --no-load-optim: optimizer, learning-rate schedule and loss scale start fresh, as in "
                    "Megatron-LM; the iteration count and consumed samples go on")
    else:
        ctx.schedule.load_state_dict(extra["lr_schedule"], resume=ScheduleResume.from_args(args))
        if ctx.scaler is not None and extra.get("loss_scaler"):
            ctx.scaler.load_state_dict(extra["loss_scaler"])
    if not args.no_load_rng:
        checkpointing.set_rng_state(extra["rng"], ctx.device)


def maybe_evaluate(args, ctx, state, valid_src, metrics, dash) -> None:
    """Megatron-LM's evaluation: the next --eval-iters global batches of the validation
    split (each evaluation moves on; the position is checkpointed with the progress)."""
    if valid_src is None or args.eval_iters == 0:
        return
    # Megatron-LM's evaluation batch: --eval-global-batch-size in --eval-micro-batch-size micro batches
    # (defaults: the training values, micro batch x DP with a step schedule), whatever the ramp-up is at.
    layout = dataclasses.replace(ctx.layout, micro_batch_size=args.eval_micro_batch_size,
                                 num_microbatches=args.eval_num_microbatches)
    loss = evaluate(dataclasses.replace(ctx, layout=layout), valid_src, args.eval_iters, state.consumed_valid_samples)
    state.consumed_valid_samples += args.eval_iters * args.eval_global_batch_size
    log_validation(state.iteration, loss)
    metrics.validation.append((state.iteration, loss))
    dashboards_mod.write_validation_scalars(dash, args, loss, validation_ppl(loss), state.iteration,
                                            state.consumed_train_samples)


class Saver:
    """Synchronous or --async-save checkpoints into Megatron-LM's layout."""

    def __init__(self, args, ctx: StepContext) -> None:
        self.args, self.ctx = args, ctx
        retain = args.save_retain_interval
        self.async_saver = checkpointing.AsyncSaver(retain) if args.async_save else None
        self.last_saved = 0
        wanted = args.save is not None and args.ckpt_format == "torch_dist"
        fallback = mcore_dist.fallback_reason(args) if wanted else None  # [Note: torch_dist's reach]
        self.mcore_format = wanted and fallback is None
        if fallback:
            logger.info("> --ckpt-format torch_dist: this run (%s) is saved in the fsdp_dtensor layout instead of "
                        "megatron-core's format", fallback)

    def save(self, state: TrainState) -> None:
        bundle = self.ctx.bundle
        extra = checkpoint_extra_state(self.args, self.ctx, state)
        if self.async_saver is not None:
            self.async_saver.save(self.args.save, state.iteration, bundle.model, bundle.optimizer, extra)
        elif self.mcore_format:
            mcore_dist.save(self.args.save, state.iteration, bundle.model, bundle.optimizer, extra, self.args,
                            gpt_config_from_args(self.args), retain_interval=self.args.save_retain_interval)
        elif torch_checkpoint.CheckpointFormat(self.args.ckpt_format) is torch_checkpoint.CheckpointFormat.TORCH:
            torch_checkpoint.save(self.args.save, state.iteration, bundle.model, bundle.optimizer, extra, self.args,
                                  retain_interval=self.args.save_retain_interval)
        else:
            checkpointing.save(self.args.save, state.iteration, bundle.model, bundle.optimizer, extra,
                               retain_interval=self.args.save_retain_interval)
        self.last_saved = state.iteration

    def finalize(self) -> None:
        if self.async_saver is not None:
            self.async_saver.finalize()


def log_iteration(args, ctx, state, result, stats, interval_flops, dash, global_batch_size: int) -> None:
    """``interval_flops``: the FLOPs of the iterations ``stats`` covers (their batches may
    differ under --rampup-batch-size / --step-batch-size-schedule); ``global_batch_size``:
    the latest iteration's."""
    throughput = None
    if args.log_throughput:
        throughput = interval_flops / max(stats.elapsed_s, 1e-9) / args.world_size / 1e12
    logger.info(format_iteration_line(
        iteration=state.iteration, train_iters=args.train_iters, consumed_samples=state.consumed_train_samples,
        stats=stats, throughput=throughput, learning_rate=result.learning_rate,
        global_batch_size=global_batch_size, loss_scale=result.loss_scale, grad_norm=result.grad_norm,
        num_zeros=result.num_zeros, params_norm=result.params_norm, skipped_samples=state.skipped_train_samples))
    first = stats.iterations == 1 and state.iteration % args.log_interval != 0
    if args.log_timers_to_tensorboard and not first:
        dash.add_scalar("iteration-time", stats.elapsed_s / max(stats.iterations, 1), state.iteration)
        if throughput is not None:
            dash.add_scalar("throughput", throughput, state.iteration)
    names = ctx.timers.names_to_log()
    if args.log_timers_to_tensorboard and names:
        for name, ms in ctx.timers.elapsed_ms(names, args.log_interval, reset=False).items():
            dash.add_scalar(name + "-time", ms, state.iteration)
    report = ctx.timers.log_string(names, normalizer=args.log_interval, reset=not first)
    if report:
        logger.info(report)


def next_batch(args, ctx: StepContext, state: TrainState, saver: "Saver", micro_batches: int):
    """The coming iteration's batch and its step context (Megatron-LM's
    ``update_num_microbatches``): with --rampup-batch-size or --step-batch-size-schedule
    the micro batches per rank follow the consumed samples, and when their number
    changes from ``micro_batches`` (the previous iteration's) Megatron-LM saves a
    checkpoint first (with --save)."""
    batch = args.batch_schedule.at(state.consumed_train_samples)
    if batch.num_microbatches != micro_batches:
        if batch.num_microbatches < micro_batches:  # refused up front (BatchSchedule.first_problem)
            raise RuntimeError(f"micro batches per rank went from {micro_batches} down to {batch.num_microbatches} "
                               f"at {state.consumed_train_samples} consumed samples")
        if args.save and state.iteration != 0 and saver.last_saved != state.iteration:
            saver.save(state)
        logger.info("%s batch size to %d (%d micro batches per rank)",
                    "stepping" if args.batch_schedule.steps else "ramping up", batch.running_global_batch_size,
                    batch.num_microbatches)
    if batch.num_microbatches == ctx.layout.num_microbatches:
        return batch, ctx
    layout = dataclasses.replace(ctx.layout, num_microbatches=batch.num_microbatches)
    return batch, dataclasses.replace(ctx, layout=layout)  # evaluation builds its own (maybe_evaluate)


def write_iteration_dashboards(args, dash, state: TrainState, result, batch_size: int, balancing_name: str) -> None:
    """One iteration's TensorBoard/W&B scalars: the MoE balancing loss every iteration (as
    Megatron-core writes it), the training scalars every --tensorboard-log-interval."""
    dashboards_mod.write_moe_scalars(dash, result.load_balancing_loss, state.iteration, balancing_name)
    dashboards_mod.write_mtp_scalars(dash, result.mtp_losses, state.iteration)
    if state.iteration % args.tensorboard_log_interval == 0:
        dashboards_mod.write_training_scalars(
            dash, args, iteration=state.iteration, consumed_samples=state.consumed_train_samples,
            lm_loss=None if result.skipped else result.lm_loss, learning_rate=result.learning_rate,
            loss_scale=result.loss_scale, grad_norm=result.grad_norm, num_zeros=result.num_zeros,
            params_norm=result.params_norm, batch_size=batch_size, skipped_samples=state.skipped_train_samples)


def evaluate_and_save(args, ctx: StepContext, state: TrainState, saver: Saver, valid_src, metrics: MetricsRecorder,
                      dash) -> bool:
    """The evaluation and the checkpoint due after this iteration; whether either ran."""
    paused = False
    if args.eval_iters and state.iteration % args.eval_interval == 0:
        maybe_evaluate(args, ctx, state, valid_src, metrics, dash)
        paused = True
    if args.save and state.iteration % args.save_interval == 0:
        saver.save(state)
        paused = True
    return paused


def train(args, ctx: StepContext, state: TrainState, train_src, valid_src, metrics: MetricsRecorder,
          dash) -> tuple[Saver, bool]:
    """Run iterations until the budget (or an exit condition); returns the saver and
    whether an exit condition (--exit-interval, --exit-duration-in-mins, a signal) ended it."""
    flops = num_floating_point_operations(args, args.global_batch_size)  # Megatron-LM's rule
    balancing_name = MoELoadBalancing.parse(args.moe_router_load_balancing_type,
                                            arg_name="--moe-router-load-balancing-type").log_name
    stats = IntervalStats(balancing_name=balancing_name)
    interval_flops = 0.0
    memory_reports = 0
    first_iteration = state.iteration + 1
    saver = Saver(args, ctx)
    exits = ExitConditions(args, ctx.device)
    profiler = RunProfiler(args, dist.get_rank(), ctx.device,
                           memory_summary=lambda: memory_snapshot(ctx.bundle.model, ctx.device))
    # Iteration times come from the wall clock between iterations; the device is
    # synchronised only where an interval is read (the log line) or paused (eval,
    # checkpoints), as Megatron-LM's interval timer does: a per-iteration
    # synchronize would cost a host sync each step (see training_step.py,
    # [Note: one host sync per iteration]).
    device_mod.synchronize(ctx.device)
    last = time.perf_counter()
    micro_batches = args.batch_schedule.at(state.consumed_train_samples).num_microbatches \
        if state.iteration < args.train_iters else 0
    while state.iteration < args.train_iters:
        batch, step_ctx = next_batch(args, ctx, state, saver, micro_batches)
        micro_batches = batch.num_microbatches
        profiler.before_iteration(state.iteration)
        result = train_step(step_ctx, state, train_src)
        state.skipped_train_samples += batch.skipped_samples
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval and state.iteration % interval == 0:
            check_weight_replicas(ctx.bundle.model, state.iteration)  # Megatron-LM's replica check
            logger.info(">>> Weight hashes match after %d iterations...", state.iteration)
        is_first = state.iteration == first_iteration
        logs = state.iteration % args.log_interval == 0 or is_first
        if logs:
            device_mod.synchronize(ctx.device)
        now = time.perf_counter()
        stats.add(result, now - last)
        last = now
        iteration_flops = flops * batch.running_global_batch_size / args.global_batch_size
        state.floating_point_operations_so_far += iteration_flops
        interval_flops += iteration_flops
        metrics.record(state.iteration, result)
        if dash.active:
            write_iteration_dashboards(args, dash, state, result, batch.running_global_batch_size, balancing_name)
        # Megatron-LM logs the first iteration of a run (without resetting the
        # interval sums) and then every --log-interval iterations.
        if logs:
            log_iteration(args, ctx, state, result, stats, interval_flops, dash, batch.running_global_batch_size)
            if state.iteration % args.log_interval == 0:
                stats = IntervalStats(balancing_name=balancing_name)
                interval_flops = 0.0
            # Memory after the first logged iteration and again after the next one
            # (which includes the optimizer state), as Megatron-LM reports it.
            if memory_reports < 2:
                snaps = log_memory(ctx.bundle.model, ctx.device, state.iteration)
                metrics.memory = snaps
                memory_reports += 1
                if args.log_memory_to_tensorboard:
                    dashboards_mod.write_memory_scalars(dash, snaps[0], state.iteration)
        profiler.after_iteration(state.iteration, logs)
        if evaluate_and_save(args, ctx, state, saver, valid_src, metrics, dash):
            # evaluation and checkpoints are not iteration time
            device_mod.synchronize(ctx.device)
            last = time.perf_counter()
        reason = exits.reason(state.iteration)
        if reason:
            if args.save and saver.last_saved != state.iteration:
                saver.save(state)
            logger.info("exiting program at iteration %d (%s)", state.iteration, reason)
            exits.close()
            profiler.close()
            return saver, True
    exits.close()
    profiler.close()
    return saver, False


def run(args, device: torch.device) -> int:
    train_src, valid_src = build_sources(args)
    bundle = setup_model_and_optimizer(args, device)
    describe_run(args, device, bundle.num_parameters)
    layout = BatchLayout(micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
                         dp_rank=bundle.data_parallel_rank, dp_size=args.data_parallel_size,
                         cp_rank=bundle.context_parallel_rank, cp_size=bundle.context_parallel_size)
    ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=LossScaler.from_args(args),
                      layout=layout, device=device, clip_grad=args.clip_grad,
                      per_token_loss=args.calculate_per_token_loss,
                      check_for_nan=args.check_for_nan_in_loss_and_grad,
                      timers=Timers(args.timing_log_level, args.timing_log_option, device),
                      log_params_norm=args.log_params_norm, log_num_zeros=args.log_num_zeros_in_grad,
                      seq_length=args.seq_length)
    state = TrainState()
    if args.load or args.pretrained_checkpoint:
        restore(args, ctx, state)
        if state.iteration:
            logger.info("> resuming at iteration %d, %d samples consumed", state.iteration,
                        state.consumed_train_samples)
    # A resumed run continues the ramp / step schedule from its consumed samples; the remaining batches are
    # checked before the first step (the micro batch or data-parallel size may have changed).
    problem = args.batch_schedule.first_problem(state.consumed_train_samples, args.train_iters - state.iteration)
    if problem:
        raise ArgumentError(f"cannot continue from {state.consumed_train_samples} consumed samples: {problem}")

    metrics = MetricsRecorder()
    dash = dashboards_mod.build_dashboards(args, dist.get_rank())
    start_iteration = state.iteration
    saver, exited_early = train(args, ctx, state, train_src, valid_src, metrics, dash)

    if args.save and state.iteration > start_iteration and saver.last_saved != state.iteration:
        saver.save(state)
    saver.finalize()
    # Megatron-LM evaluates once more after the last iteration, even right after an
    # --eval-interval evaluation (on the next validation batches), but not after an exit
    # condition (it leaves at once).
    if args.eval_iters and not exited_early:
        maybe_evaluate(args, ctx, state, valid_src, metrics, dash)
    if args.export_hf_dir:
        hf_weights.export_hf(bundle.model, args.export_hf_dir, gpt_config_from_args(args),
                             source=checkpoint_source(args)[0], family=args.export_hf_family,
                             tokenizer_dir=hf_tokenizer_dir(args))
    dash.close()
    if dist.get_rank() == 0:
        write_outputs(args, metrics)
    # Leave together, with no collective in flight: a ZeRO-1/2 step ends with an
    # asynchronous weight gather, and gloo aborts a process whose group is torn down
    # under a pending operation or a peer that is still busy.
    if hasattr(bundle.model, "finish_param_sync"):
        bundle.model.finish_param_sync()
    dist.barrier()
    return 0


def hf_tokenizer_dir(args) -> Optional[str]:
    """The tokenizer files an --export-hf-dir copies: a HuggingFaceTokenizer's directory."""
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model and os.path.isdir(args.tokenizer_model):
        return args.tokenizer_model
    return None


def write_outputs(args, metrics: MetricsRecorder) -> None:
    if args.log_json:
        metrics.write(args.log_json, config={k: v for k, v in vars(args).items() if _jsonable(v)})
        logger.info("> metrics written to %s", args.log_json)
    if args.plot_path and metrics.iterations:
        path = {DataParallelPath.MEGATRON_FSDP: f"Megatron-FSDP {args.zero_strategy.label}",
                DataParallelPath.MEGATRON_DDP: "Megatron-core DDP", DataParallelPath.TORCH_DDP: "DDP",
                DataParallelPath.TORCH_FSDP2: "FSDP2", DataParallelPath.MEGATRON_FSDP_V2: "Megatron-FSDP v2"}[args.dp_path]
        title = f"{path}, {args.world_size} ranks"
        if plot_loss_curve(args.plot_path, metrics.iterations, metrics.lm_loss, metrics.validation, title):
            logger.info("> loss curve written to %s", args.plot_path)


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list)) and not isinstance(value, dict)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    device = initialize_distributed(args)
    setup_logging(dist.get_rank(), args.logging_level)
    for warning in args.flag_warnings if dist.get_rank() == 0 else ():
        logger.warning("WARNING: %s", warning)
    try:
        return run(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
