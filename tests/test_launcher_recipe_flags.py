"""Megatron-LM flags that blocked its functional-test recipes on their own:
``--ddp-average-in-collective``, ``--save-retain-interval``, and the ones accepted
with a warning because they change no number here (``--use-tp-pp-dp-mapping``,
``--test-mode``, ``--async-strategy``, ``--async-ckpt-use-cpu-shm``,
``--disable-gloo-process-groups`` without ``--async-save``)."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

from megatron_fsdp.training.args.arg_types import ArgumentError, DataParallelPath
from megatron_fsdp.training.args.arguments import parse_args
from launcher_inprocess import launch_task
from test_pretrain_script import TINY, load_metrics

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 3e-3 --adam-eps 1e-4 "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 ")
TOL = 1e-5


def average_worker(rank, world, *, extra):
    """Three launcher iterations: losses, and the reduction op of the wrapper."""
    from megatron_fsdp.training.data import BatchLayout, MockDataset
    from megatron_fsdp.training.optim.lr_schedule import LRSchedule
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.training_step import StepContext, TrainState, train_step

    args = parse_args(shlex.split(BASE + extra), world_size=world)
    torch.manual_seed(0)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=None, device=torch.device("cpu"),
                      layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=rank, dp_size=world),
                      clip_grad=1.0, per_token_loss=False, check_for_nan=True, seq_length=16)
    source, state, losses = MockDataset(64, 16, seed=1), TrainState(), []
    for _ in range(3):
        losses.append(train_step(ctx, state, source).lm_loss)
    pipeline = getattr(bundle.model, "grad_reduce_pipeline", None)
    op = str(pipeline._op()) if pipeline is not None else "torch-ddp"
    return dict(losses=losses, op=op, path=args.dp_path.value)


@pytest.mark.parametrize("extra", ["", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
                                   "--use-distributed-optimizer"])
def test_average_in_collective_trains_the_same(pool2, extra):
    """The collective averages (ReduceOp.AVG) instead of summing pre-scaled gradients:
    the same numbers within rounding, on each data-parallel path."""
    plain = pool2.run(average_worker, extra=extra)[0]
    averaged = pool2.run(average_worker, extra=extra + " --ddp-average-in-collective")[0]
    assert "AVG" in averaged["op"] and "AVG" not in plain["op"], (plain["op"], averaged["op"])
    assert max(abs(a - b) for a, b in zip(plain["losses"], averaged["losses"])) <= TOL
    if not extra:  # PyTorch DDP has no such option: the flag moves the run to Megatron-FSDP's no_shard
        assert (plain["path"], averaged["path"]) == (DataParallelPath.TORCH_DDP.value,
                                                     DataParallelPath.MEGATRON_DDP.value)


def test_save_retain_interval_keeps_multiples_and_the_newest(pool2, tmp_path):
    """Megatron-LM's rule: after each save the previous checkpoint goes unless its
    iteration is a multiple of the interval; the newest always stays."""
    for name, extra in (("sync", []), ("async", ["--async-save"])):
        root = tmp_path / name
        args = [a if a != "20" else "10" for a in TINY]  # --train-iters 10
        pool2.run(launch_task, flags=shlex.join(args + [
            "--save", str(root), "--save-interval", "2", "--save-retain-interval", "4",
            "--log-json", str(tmp_path / f"{name}.json"), "--plot-path", "none", *extra]))
        kept = sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))
        assert kept == ["iter_0000004", "iter_0000008", "iter_0000010"], (name, kept)
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
        assert load_metrics(tmp_path / f"{name}.json")["iterations"][-1] == 10


@pytest.mark.parametrize("flags, message", [
    ("--save /tmp/x --save-interval 3 --save-retain-interval 4", "positive multiple of --save-interval=3"),
    ("--save /tmp/x --save-interval 2 --save-retain-interval -2", "positive multiple"),
])
def test_bad_combinations_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(BASE + flags), world_size=1)


def test_flags_without_effect_here_are_accepted_with_a_warning():
    flags = "--use-tp-pp-dp-mapping --test-mode --async-strategy mcore --async-ckpt-use-cpu-shm " \
            "--disable-gloo-process-groups"
    args = parse_args(shlex.split(BASE + flags), world_size=1)
    assert args.use_gloo_process_groups is False
    for flag in ("--use-tp-pp-dp-mapping", "--test-mode", "--async-strategy", "--async-ckpt-use-cpu-shm"):
        assert sum(flag in w and "no effect here" in w for w in args.flag_warnings) == 1, (flag, args.flag_warnings)


def test_rotary_interleaved_reaches_the_model_or_says_why_not():
    """--rotary-interleaved: GPTConfig.rotary_interleaved with rope (megatron-core parity:
    tests/test_models_mcore.py, llama_rotary_interleaved*); a warning without a rotary
    embedding (Megatron-LM ignores it there); refused with multi-latent attention."""
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    args = parse_args(shlex.split(BASE + "--position-embedding-type rope --rotary-interleaved"), world_size=1)
    assert gpt_config_from_args(args).rotary_interleaved is True
    args = parse_args(shlex.split(BASE + "--rotary-interleaved"), world_size=1)
    assert gpt_config_from_args(args).rotary_interleaved is False
    assert any("--rotary-interleaved has no effect" in w for w in args.flag_warnings)
    with pytest.raises(ArgumentError, match="--rotary-interleaved does not work with --multi-latent-attention"):
        parse_args(shlex.split(BASE + "--multi-latent-attention --rotary-interleaved --normalization RMSNorm"),
                   world_size=1)


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without the given flags and their values."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        else:
            out.append(token)
    return out


@pytest.mark.parametrize("outer", [
    pytest.param("no_shard", marks=pytest.mark.skipif(not os.environ.get("MFSDP_LAUNCHER_LONG"),
                                                      reason="the same path as optim; MFSDP_LAUNCHER_LONG=1")),
    "optim"])
def test_moe_with_hsdp_equals_ddp_every_iteration(pool4, tmp_path, outer):
    """MoE with --num-distributed-optimizer-instances 2 (HSDP / HFSDP over 4 ranks; it
    was refused): the expert parameters get a mesh laid out as the dense one, and every
    iteration's loss equals PyTorch DDP's within 1e-5 (fp32, AdamW eps 1e-4)."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
           "--moe-aux-loss-coeff", "1e-2", "--global-batch-size", "16", "--train-iters", "6",
           "--eval-iters", "0", "--plot-path", "none"]
    tiny = _without(TINY, "--global-batch-size", "--train-iters")
    hsdp = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy",
            "optim_grads_params", "--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", outer]
    logs = {}
    for name, extra in (("ddp", []), ("hsdp", hsdp)):
        pool4.run(launch_task, flags=shlex.join([*tiny, *moe, *extra, "--log-json", str(tmp_path / f"{name}.json")]))
        logs[name] = load_metrics(tmp_path / f"{name}.json")
    a, b = logs["hsdp"], logs["ddp"]
    assert a["iterations"] == b["iterations"] == list(range(1, 7))
    for it, x, y in zip(a["iterations"], a["lm_loss"], b["lm_loss"]):
        assert abs(x - y) <= TOL, f"iteration {it}: HSDP {x} vs DDP {y}"
    for x, y in zip(a["load_balancing_loss"], b["load_balancing_loss"]):
        assert abs(x - y) <= TOL


def test_squared_relu_reaches_the_model_with_megatron_lms_rules():
    """--squared-relu: GPTConfig.squared_relu (megatron-core parity: tests/test_models_mcore.py,
    squared_relu and moe_squared_relu); refused with --swiglu and with the bias-GELU fusion
    on, as Megatron-LM / megatron-core refuse them."""
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    args = parse_args(shlex.split(BASE + "--squared-relu --disable-bias-linear"), world_size=1)
    assert gpt_config_from_args(args).squared_relu is True
    with pytest.raises(ArgumentError, match="--squared-relu and --swiglu"):
        parse_args(shlex.split(BASE + "--squared-relu --swiglu --disable-bias-linear"), world_size=1)
    with pytest.raises(ArgumentError, match="add --no-bias-gelu-fusion or --disable-bias-linear"):
        parse_args(shlex.split(BASE + "--squared-relu"), world_size=1)
