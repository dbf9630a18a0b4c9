"""The launcher's argument table (megatron_fsdp/training/args/flag_data/) and Megatron-LM's
validation rules, without processes; plus one short 2-rank run in the style of
Megatron-LM's Llama-3-8B Megatron-FSDP script whose TensorBoard events are read back.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fsdp.training.args.arguments import ArgumentError, build_parser, parse_args, suggest_flag
from megatron_fsdp.training.args.flag_table import FlagStatus, load_flag_table
from megatron_fsdp.training.observe.logging_utils import IntervalStats, format_iteration_line
from megatron_fsdp.training.optim.lr_schedule import LRSchedule
from megatron_fsdp.training.args.arg_types import LRDecayStyle

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pretrain_gpt.py"
TABLE = load_flag_table()
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --lr 3e-3").split()


def _parse(extra: list[str], world_size: int = 2, base=BASE, iters=("--train-iters", "8")):
    return parse_args([*base, *iters, *extra], world_size=world_size)


# -- the table ---------------------------------------------------------------------------
def test_flag_data_names_its_megatron_commit_and_the_families():
    assert re.fullmatch(r"[0-9a-f]{40}", TABLE.megatron_commit)
    family = [s for s in TABLE.specs if s.used_by]
    # The GPT-3 / Llama-3 / DeepSeek-V3 Megatron-FSDP scripts, recipes and docs use ~180 flags.
    assert len(family) >= 170
    assert {"--use-megatron-fsdp", "--swiglu", "--num-experts", "--ckpt-format", "--split"} <= {s.flag for s in family}


def test_every_family_flag_has_a_verdict_in_the_launcher_table():
    unlisted = [s.flag for s in TABLE.specs if s.used_by and s.status is FlagStatus.UNLISTED]
    assert unlisted == []


def test_every_megatron_flag_is_recognised_by_the_parser():
    """No Megatron-LM flag (of the 838 in the pinned parser) is an 'unrecognized argument'."""
    parser = build_parser(TABLE)
    known = {opt for action in parser._actions for opt in action.option_strings}
    missing = [opt for spec in TABLE.specs for opt in spec.options if opt not in known]
    assert missing == []
    assert len([s for s in TABLE.specs if s.megatron]) > 800


def _sample_value(spec) -> list[str]:
    if spec.is_bool:
        return []
    if spec.supported:
        return [str(spec.supported[0])]
    if spec.choices:
        return [str(spec.choices[0])]
    value = {int: "1", float: "0.5"}.get(spec.type, "x")
    return [value] * (int(spec.nargs) if (spec.nargs or "").isdigit() else 1)


@pytest.mark.parametrize("spec", [s for s in TABLE.specs if s.used_by], ids=lambda s: s.flag)
def test_each_family_flag_is_used_warned_or_rejected_with_its_reason(spec):
    """Every flag of the families parses; validation then uses it, warns once why it
    has no effect, or rejects it naming the flag -- never argparse's 'unrecognized'."""
    parser = build_parser(TABLE)
    args = parser.parse_args([*BASE, "--train-iters", "8", spec.flag, *_sample_value(spec)])
    assert isinstance(args, argparse.Namespace)
    from megatron_fsdp.training.args.arguments import given_flags
    from megatron_fsdp.training.args.validation import flag_policy

    args.use_mcore_models = args.deprecated_use_mcore_models
    problems, warnings = flag_policy(args, given_flags([spec.flag], TABLE))
    if spec.status is FlagStatus.REJECTED:
        assert len(problems) == 1 and spec.flag in problems[0] and spec.note in problems[0]
    elif spec.status in (FlagStatus.NOOP, FlagStatus.NOOP_ONLY):
        assert problems == [] and len(warnings) == 1 and spec.flag in warnings[0] and "no effect here" in warnings[0]
    else:
        assert problems == [] and warnings == []


def test_values_outside_the_supported_set_are_rejected_naming_value_and_support():
    with pytest.raises(ArgumentError, match=r"--tensor-model-parallel-size 8 does not divide the world size 2"):
        _parse(["--tensor-model-parallel-size", "8"])
    with pytest.raises(ArgumentError, match=r"--position-embedding-type yarn is not supported here"):
        _parse(["--position-embedding-type", "yarn"])
    args = _parse(["--manual-gc", "--no-gradient-accumulation-fusion"])
    assert len(args.flag_warnings) == 2 and all("no effect here" in w for w in args.flag_warnings)


def test_unlisted_megatron_flag_is_rejected_not_unrecognized():
    with pytest.raises(ArgumentError, match=r"--rl-partial-rollouts is a Megatron-LM flag \(rl\) that this "
                                            r"launcher does not implement"):
        _parse(["--rl-partial-rollouts"])


def test_did_you_mean_only_for_a_clear_typo():
    known = list(TABLE.by_option)
    assert suggest_flag("--use-megatorn-fsdp", known) == "--use-megatron-fsdp"
    assert suggest_flag("--hidden", known) is None  # several flags start like this: no guess
    assert suggest_flag("--frobnicate", known) is None


# -- Megatron-LM's rules -------------------------------------------------------------------
def test_megatron_fsdp_turns_on_the_distributed_optimizer_itself():
    args = _parse(["--use-megatron-fsdp"])  # Megatron-LM's minimal FSDP command
    assert args.use_distributed_optimizer and args.zero_strategy.label == "optim_grads_params"


@pytest.mark.parametrize("fmt", ["fsdp_dtensor", "torch_dist"])
def test_ckpt_formats_accepted_with_fsdp(fmt):
    assert _parse(["--use-megatron-fsdp", "--ckpt-format", fmt]).ckpt_format == fmt


def test_ckpt_format_torch_is_refused_with_fsdp_and_fsdp_dtensor_needs_fsdp():
    # Megatron-LM: "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format."
    with pytest.raises(ArgumentError, match="--ckpt-format torch cannot be used with --use-megatron-fsdp"):
        _parse(["--use-megatron-fsdp", "--ckpt-format", "torch"])
    with pytest.raises(ArgumentError, match="fsdp_dtensor is only used with --use-megatron-fsdp"):
        _parse(["--ckpt-format", "fsdp_dtensor"])


def test_split_with_shell_quotes():
    # Megatron-LM's Llama-3 script passes "--split '99,1,0'" through an unquoted array: the quotes arrive.
    args = _parse(shlex.split("--split \"'99,1,0'\""))
    assert args.split == "99,1,0"


def test_sample_based_training_and_schedule():
    args = _parse(["--global-batch-size", "8", "--train-samples", "80", "--lr-decay-samples", "64",
                   "--lr-warmup-samples", "16"], iters=())
    assert args.train_iters == 10
    sched = LRSchedule.from_args(args)
    assert (sched.warmup_steps, sched.decay_steps, sched.increment) == (16, 64, 8)
    assert sched.lr_at(8) == pytest.approx(3e-3 * 8 / 16)
    with pytest.raises(ArgumentError, match="--lr-decay-iters=5 with --train-samples"):
        _parse(["--train-samples", "80", "--lr-decay-iters", "5"], iters=())
    with pytest.raises(ArgumentError, match="--lr-warmup-samples=4 needs sample-based training"):
        _parse(["--lr-warmup-samples", "4"])


def test_lr_warmup_fraction():
    args = _parse(["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "40"])
    assert LRSchedule.from_args(args).warmup_steps == 10


def test_use_nccl_ub_is_accepted_with_the_reason():
    # Megatron-FSDP's Llama-3 example passes both: allocation choices, no value changes.
    args = _parse(["--use-megatron-fsdp", "--use-nccl-ub", "--fsdp-manual-registration"])
    ub = [w for w in args.flag_warnings if w.startswith("--use-nccl-ub")]
    assert len(ub) == 1 and "not implemented" in ub[0] and "numbers are the same" in ub[0]
    assert any("--fsdp-manual-registration" in w for w in args.flag_warnings)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ArgumentError) as info:
        _parse(["--tensor-model-parallel-size", "3", "--cuda-graph-impl", "full_iteration", "--bf16", "--fp16"])
    assert str(info.value).count("\n  - ") == 3


# -- YAML configs ---------------------------------------------------------------------------
RECIPE = """\
ENV_VARS:
  NCCL_ALGO: Ring
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 32
  --max-position-embeddings: 32
  --micro-batch-size: 2
  --global-batch-size: 8
  --train-iters: 8
  --lr: 0.003
  --use-megatron-fsdp: true
  --data-parallel-sharding-strategy: "optim_grads_params"
  --ckpt-format: "fsdp_dtensor"
  --log-params-norm: true
  --tensorboard-dir: ${I15_TB_DIR}
  --split: 949,50,1
  --manual-gc: true
  --deterministic-mode: false
TEST_TYPE: regular
"""


def test_megatron_recipe_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("I15_TB_DIR", str(tmp_path / "tb"))
    config = tmp_path / "model_config.yaml"
    config.write_text(RECIPE)
    args = parse_args(["--config", str(config)], world_size=2)
    assert args.use_megatron_fsdp and args.log_params_norm and args.tensorboard_dir == str(tmp_path / "tb")
    assert args.split == "949,50,1" and not args.deterministic_mode
    assert any("--manual-gc" in w for w in args.flag_warnings)


def test_yaml_reports_every_unknown_key_in_one_message(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --hiden-size: 64\n  --frobnicate: 1\n  --not-a-flag: true\n")
    with pytest.raises(ArgumentError) as info:
        parse_args(["--config", str(config)], world_size=2)
    message = str(info.value)
    assert "unknown key '--hiden-size' (did you mean 'hidden-size'?)" in message
    assert "unknown key '--frobnicate'" in message and "unknown key '--not-a-flag'" in message


# -- the iteration line ----------------------------------------------------------------------
class _Result:
    def __init__(self, loss, skipped=False, nan=False):
        self.lm_loss, self.skipped, self.nan = loss, skipped, nan


def test_iteration_line_matches_megatron_training_log():
    stats = IntervalStats()
    for result in (_Result(2.0), _Result(float("nan"), skipped=True, nan=True), _Result(4.0)):
        stats.add(result, 0.5)
    line = format_iteration_line(
        iteration=30, train_iters=100, consumed_samples=240, stats=stats, throughput=12.34, learning_rate=1e-4,
        global_batch_size=8, loss_scale=1.0, grad_norm=0.5, num_zeros=7, params_norm=12.5,
        now=datetime.datetime(2026, 1, 2, 3, 4, 5, 678901))
    # Skipped iterations are not averaged into the loss, but count in the time per iteration.
    assert line == (" [2026-01-02 03:04:05.678901] iteration       30/     100 | consumed samples:          240 | "
                    "elapsed time per iteration (ms): 500.0 | throughput per GPU (TFLOP/s/GPU): 12.3 | "
                    "learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 3.000000E+00 | "
                    "loss scale: 1.0 | grad norm: 0.500 | num zeros: 7 | params norm: 12.500 | "
                    "number of skipped iterations:   1 | number of nan iterations:   1 |")


def test_iteration_line_has_megatron_moe_load_balancing_loss():
    stats = IntervalStats()
    for loss, balancing, skipped in ((2.0, 1.5, False), (float("nan"), 1.0, True), (4.0, 0.5, False)):
        result = _Result(loss, skipped=skipped, nan=skipped)
        result.load_balancing_loss = balancing
        stats.add(result, 0.5)
    line = format_iteration_line(
        iteration=3, train_iters=3, consumed_samples=24, stats=stats, throughput=None, learning_rate=None,
        global_batch_size=8, loss_scale=1.0, grad_norm=None, now=datetime.datetime(2026, 1, 2, 3, 4, 5, 6))
    # Megatron-core adds the value of every iteration to total_loss_dict and divides by the advanced ones.
    assert " lm loss: 3.000000E+00 | load_balancing_loss: 1.500000E+00 | loss scale: 1.0 |" in line
    assert "load_balancing_loss" not in format_iteration_line(
        iteration=1, train_iters=3, consumed_samples=8, stats=IntervalStats(), throughput=None, learning_rate=None,
        global_batch_size=8, loss_scale=1.0, grad_norm=None)


def test_schedule_does_not_advance_on_skipped_iterations():
    """A NaN iteration (checks off) is skipped: weights, optimizer and learning-rate
    schedule stay where they were, as in Megatron-LM; the iteration still counts."""
    import torch

    from megatron_fsdp.training.data import BatchLayout, MockDataset
    from megatron_fsdp.training.model_setup import ModelBundle
    from megatron_fsdp.training.training_step import StepContext, TrainState, train_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    poison = {"on": False}

    def loss_fn(inputs, targets):
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1), reduction="sum")
        return (loss * float("nan") if poison["on"] else loss), targets.numel()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    bundle = ModelBundle(model=model, optimizer=optimizer, loss_fn=loss_fn, is_fsdp=False, num_parameters=0)
    schedule = LRSchedule(max_lr=1e-2, min_lr=0.0, warmup_steps=4, decay_steps=10, style=LRDecayStyle.LINEAR)
    ctx = StepContext(bundle=bundle, schedule=schedule, scaler=None, device=torch.device("cpu"), clip_grad=1.0,
                      layout=BatchLayout(micro_batch_size=2, num_microbatches=1, dp_rank=0, dp_size=1),
                      per_token_loss=False, check_for_nan=False)
    source, state = MockDataset(16, 8, seed=1), TrainState()
    lrs, skipped = [], []
    for poisoned in (False, True, False):
        poison["on"] = poisoned
        before = [p.detach().clone() for p in model.parameters()]
        result = train_step(ctx, state, source)
        lrs.append(result.learning_rate)
        skipped.append(result.skipped)
        if poisoned:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert skipped == [False, True, False] and state.iteration == 3
    # Warmup 1e-2 * step/4: steps 0, 1, then 1 again (the skipped one did not count).
    assert lrs == [0.0, pytest.approx(2.5e-3), pytest.approx(2.5e-3)]
    assert schedule.num_steps == 2


# -- one run: Llama-3-8B-style command line (mock data, MoE), TensorBoard read back -------------
def test_llama_style_run_writes_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    # Megatron-LM's Llama-3-8B Megatron-FSDP script, scaled down (2 layers, hidden 64, 2 CPU ranks).
    cmd = f"""
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
        --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 --attention-backend fused
        --micro-batch-size 2 --global-batch-size 8 --train-samples 96 --lr-decay-samples 96 --lr-warmup-samples 16
        --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --cross-entropy-loss-fusion --manual-gc --empty-unused-memory-level 1
        --exit-duration-in-mins 235 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
        --no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
        --ckpt-format fsdp_dtensor --fsdp-double-buffer --tensor-model-parallel-size 1 --context-parallel-size 1
        --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
        --log-interval 4 --eval-iters 1 --eval-interval 6 --log-throughput --logging-level 20
        --distributed-timeout-minutes 60 --tensorboard-dir {tb} --log-timers-to-tensorboard --timing-log-level 1
        --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard --log-params-norm --log-num-zeros-in-grad
        --plot-path none --mock-data --tokenizer-type NullTokenizer --vocab-size 128
        --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2
    """
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU, also on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), *shlex.split(cmd)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: --")]
    assert len(warnings) == len(set(warnings)) >= 8  # one line per flag with no effect, rank 0 only
    assert "WARNING: --manual-gc" in proc.stdout and "[rank 1] WARNING: --manual-gc" not in proc.stderr
    assert "iteration       12/      12" in proc.stdout and "throughput per GPU" in proc.stdout
    assert re.search(r"\| lm loss: \S+ \| load_balancing_loss: \S+ \| loss scale", proc.stdout)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "params-norm", "num-zeros", "iteration-time",
                "throughput", "forward-backward-time", "optimizer-time", "mem-rss-bytes", "lm loss validation",
                "lm loss validation ppl", "load_balancing_loss"):
        assert tag in scalars, (tag, sorted(scalars))
    losses = [e.value for e in acc.Scalars("lm loss")]
    assert [e.step for e in acc.Scalars("lm loss")] == list(range(1, 13))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    balancing = acc.Scalars("load_balancing_loss")  # every iteration, as Megatron-core writes it
    assert [e.step for e in balancing] == list(range(1, 13)) and all(0.5 < e.value < 4 for e in balancing)
    lrs = [e.value for e in acc.Scalars("learning-rate")]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(3e-3)  # warmup over 16 samples = 2 iterations


def test_missing_dashboard_packages_are_a_clear_message(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    args = _parse(["--wandb-project", "p", "--tensorboard-dir", "/tmp/x"])
    assert any("the wandb package is not installed" in w and "pip install wandb" in w for w in args.flag_warnings)
    assert any("the tensorboard package is not installed" in w for w in args.flag_warnings)


# -- recomputation and zero-centred norms reach the embedded model ---------------------------
RECOMPUTE_FLAGS = {
    "uniform2": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "block1": "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "selective": "--recompute-granularity selective",
    "recompute_activations": "--recompute-activations",  # Megatron-LM's alias of selective
}


def test_recompute_and_layernorm_1p_flags_fill_the_gpt_config():
    from megatron_fsdp.models.config import RecomputeGranularity, RecomputeMethod
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    args = _parse(shlex.split(RECOMPUTE_FLAGS["block1"]) + ["--apply-layernorm-1p"])
    assert args.flag_warnings == []  # used, not "accepted, no effect"
    cfg = gpt_config_from_args(args)
    assert cfg.recompute_granularity is RecomputeGranularity.FULL and cfg.apply_layernorm_1p
    assert cfg.recompute_plan == (RecomputeMethod.BLOCK, 1)
    assert gpt_config_from_args(_parse(["--recompute-activations"])).recompute_granularity \
        is RecomputeGranularity.SELECTIVE
    # Without full recomputation the two are inert, as in Megatron-LM (one warning).
    args = _parse(["--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert gpt_config_from_args(args).recompute_granularity is None and "no recomputation" in args.flag_warnings[0]


@pytest.mark.parametrize("extra, message", [
    ("--recompute-granularity full --recompute-num-layers 1", "needs --recompute-method uniform|block"),
    ("--recompute-granularity full --recompute-method block", "needs --recompute-num-layers N"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
     "--recompute-num-layers=3 must be between 1 and --num-layers=2"),
    ("--recompute-granularity selective --recompute-method uniform", "does not apply to selective"),
    ("--recompute-activations --recompute-num-layers 1", "does not apply to selective"),
])
def test_megatron_recompute_rules(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _parse(shlex.split(extra))


def _loss_and_grads(args, tokens):
    import torch

    from megatron_fsdp.models import GPT, gpt_loss
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    torch.manual_seed(0)
    model = GPT(gpt_config_from_args(args))
    torch.manual_seed(1)  # the same dropout masks (Megatron-LM's default dropout 0.1 is on)
    loss = gpt_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(RECOMPUTE_FLAGS))
def test_recompute_flags_give_identical_losses_and_grads(name):
    import torch

    base = ["--num-layers", "3", "--apply-layernorm-1p"]
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    plain_args = _parse(base)
    recompute_args = _parse(base + shlex.split(RECOMPUTE_FLAGS[name]))
    assert plain_args.hidden_dropout == 0.1 and recompute_args.recompute_granularity is not None
    loss, grads = _loss_and_grads(plain_args, tokens)
    loss_r, grads_r = _loss_and_grads(recompute_args, tokens)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys()
    for n in grads:
        assert torch.equal(grads[n], grads_r[n]), n


# -- data flags: one validation function ------------------------------------------------------
def test_data_flags_are_validated_through_data_args_problems(monkeypatch):
    from megatron_fsdp.training.data import from_args

    seen = []
    monkeypatch.setattr(from_args, "data_args_problems", lambda args: seen.append(args) or ["from data_args_problems"])
    with pytest.raises(ArgumentError, match="from data_args_problems"):
        _parse([])
    assert len(seen) == 1
    monkeypatch.undo()
    for extra, message in ((["--split", "0,1,0"], "--split '0,1,0' gives the train split no weight"),
                           (["--split", "x"], "--split 'x' must be one to three non-negative weights"),
                           (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
                           (["--mock-data", "--data-path", "p"], "--mock-data and --data-path are exclusive")):
        with pytest.raises(ArgumentError) as info:
            _parse(extra)
        assert str(info.value).count(message) == 1, str(info.value)  # reported once, not by two checks


@pytest.mark.parametrize("backend", [[], ["--distributed-backend", "nccl"]], ids=["default", "nccl"])
def test_more_local_ranks_than_gpus_is_refused_up_front(monkeypatch, backend):
    """Two processes on a one-GPU node (a real case: torchrun --nproc-per-node 2): the
    second would fail inside CUDA with "invalid device ordinal"."""
    from megatron_fsdp.comm import device as device_mod

    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ArgumentError, match=re.escape("local rank 1 and 1 CUDA device(s) are visible: launch at most 1")):
        _parse(backend)
    assert _parse(["--distributed-backend", "gloo"]).distributed_backend == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _parse(backend) is not None


def test_mcore_models_refuse_what_megatron_lm_cannot_build(monkeypatch):
    from megatron_fsdp.comm import device as device_mod

    pytest.importorskip("megatron.core")
    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 1)
    mcore = ["--use-mcore-models", "--distributed-backend", "nccl"]
    # Megatron-LM's local spec builds RMSNorm from torch, which refuses zero-centred gamma.
    with pytest.raises(ArgumentError, match="--apply-layernorm-1p with --normalization RMSNorm and --transformer-impl"):
        _parse(mcore + ["--apply-layernorm-1p", "--normalization", "RMSNorm", "--transformer-impl", "local"])
    assert _parse(mcore + ["--apply-layernorm-1p", "--normalization", "RMSNorm"]).layernorm_zero_centered_gamma
    assert _parse(mcore + ["--apply-layernorm-1p", "--transformer-impl", "local"]).layernorm_zero_centered_gamma
    assert _parse(mcore + ["--num-experts", "2", "--moe-layer-freq", "[0,1]"]).moe_layer_freq == [0, 1]


# -- flags that change Megatron-LM's numbers reach the model -----------------------------------
LLAMA_MOE = shlex.split("--swiglu --disable-bias-linear --num-experts 4 --moe-router-topk 2")


@pytest.mark.parametrize("value", ["fp32", "fp64"])
def test_moe_router_dtype_reaches_the_model(value):
    import torch

    from megatron_fsdp.models import GPT, RouterDtype
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    args = _parse(LLAMA_MOE + ["--moe-router-dtype", value])
    assert args.flag_warnings == []  # used, not "accepted, no effect"
    cfg = gpt_config_from_args(args)
    assert cfg.moe_router_dtype is RouterDtype(value)
    assert GPT(cfg).blocks[0].mlp.router.router_dtype == {"fp32": torch.float32, "fp64": torch.float64}[value]
    assert gpt_config_from_args(_parse(LLAMA_MOE)).moe_router_dtype is None  # Megatron-LM's default
    with pytest.raises(SystemExit):  # Megatron-LM's choices
        _parse(LLAMA_MOE + ["--moe-router-dtype", "bf16"])


@pytest.mark.parametrize("extra, tanh", [
    ("", True),  # Megatron-LM's fused bias-GELU kernel (on by default) is the tanh form
    ("--no-bias-gelu-fusion", False),
    ("--disable-bias-linear", False),  # Megatron-LM turns the fusion off without biases
    ("--openai-gelu --no-bias-gelu-fusion", False),  # Megatron-LM never reads --openai-gelu
])
def test_gelu_flavour_follows_megatron_bias_gelu_fusion(extra, tanh):
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    args = _parse(shlex.split(extra))
    assert gpt_config_from_args(args).openai_gelu is tanh
    assert any("--openai-gelu" in w for w in args.flag_warnings) == ("--openai-gelu" in extra)


def test_gelu_presets_spell_flags_the_launcher_maps_back():
    from megatron_fsdp.models import presets
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    for name in ("gpt3-tiny", "llama3-tiny"):
        cfg = presets.config(name)
        tokens = []
        for flag, value in presets.megatron_flags(cfg).items():
            tokens += [flag] if value is True else [flag, str(value)]
        tokens += ["--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "1"]
        parsed = gpt_config_from_args(parse_args(tokens, world_size=1))
        assert (parsed.swiglu, parsed.add_bias_linear) == (cfg.swiglu, cfg.add_bias_linear), name
        assert cfg.swiglu or parsed.openai_gelu == cfg.openai_gelu, name  # swiglu models have no GELU


def test_gelu_moe_with_the_fusion_on_warns_that_megatron_refuses_it():
    gelu_moe = _parse(["--num-experts", "4"])
    assert any("Megatron-LM refuses this" in w and "--no-bias-gelu-fusion" in w for w in gelu_moe.flag_warnings)
    for extra in (["--no-bias-gelu-fusion"], ["--swiglu"], ["--disable-bias-linear"]):
        assert not any("refuses" in w for w in _parse(["--num-experts", "4", *extra]).flag_warnings)


def _logits_grad(extra: list[str]):
    import torch

    from megatron_fsdp.training.model_setup import _build_embedded_gpt

    args = _parse(["--hidden-dropout", "0", "--attention-dropout", "0", *extra])
    module, loss_fn_factory, _ = _build_embedded_gpt(args, torch.device("cpu"))
    if args.bf16:
        module = module.to(torch.bfloat16)
    captured = {}

    def keep_logits_grad(module, inputs, logits):
        logits.register_hook(lambda grad: captured.setdefault("grad", grad))

    module.register_forward_hook(keep_logits_grad)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    loss, _ = loss_fn_factory(module)(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), captured["grad"]


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_cross_entropy_loss_fusion_hands_back_a_bf16_logits_gradient(precision):
    """Megatron-LM's fused loss: the same fp32 loss, the logits' gradient cast to bf16."""
    import torch

    loss, grad = _logits_grad(precision)
    fused_loss, fused_grad = _logits_grad(precision + ["--cross-entropy-loss-fusion"])
    assert torch.equal(loss, fused_loss) and fused_grad.dtype == grad.dtype
    assert torch.equal(fused_grad, grad.to(torch.bfloat16).to(grad.dtype))
    assert torch.equal(fused_grad, grad) == bool(precision)  # rounds an fp32 model's gradient only


def test_use_checkpoint_opt_param_scheduler_takes_the_checkpoints_schedule(tmp_path, monkeypatch):
    import types

    import torch

    from launcher_inprocess import load_pretrain_script
    from megatron_fsdp.training.checkpoint import dcp_checkpoint as checkpointing
    from megatron_fsdp.training.training_step import TrainState

    script = load_pretrain_script()
    saved = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_steps=2, decay_steps=20, style=LRDecayStyle.COSINE,
                       num_steps=6)
    extra = {"train_state": TrainState().state_dict(), "lr_schedule": saved.state_dict(), "rng": None}
    monkeypatch.setattr(checkpointing, "load", lambda *args, **kwargs: extra)
    resumed = {}
    for flag in ("", "--use-checkpoint-opt-param-scheduler", "--override-opt_param-scheduler"):  # alias spellings
        args = _parse(["--load", str(tmp_path), "--no-load-rng", *([flag] if flag else [])])
        schedule = LRSchedule.from_args(args)
        ctx = types.SimpleNamespace(bundle=types.SimpleNamespace(model=None, optimizer=None), scaler=None,
                                    schedule=schedule, device=torch.device("cpu"))
        if not flag:  # Megatron-LM's default refuses a resume whose schedule differs
            before = schedule.state_dict()
            with pytest.raises(ValueError, match=r"max_lr: checkpoint 0.001, command line 0.003.*"
                                                 r"--override-opt_param-scheduler.*--use-checkpoint-opt_param-scheduler"):
                script.restore(args, ctx, TrainState())
            assert schedule.state_dict() == before  # nothing half-restored
            continue
        script.restore(args, ctx, TrainState())
        resumed[flag] = ctx.schedule
    checkpoint, command_line = resumed["--use-checkpoint-opt-param-scheduler"], resumed["--override-opt_param-scheduler"]
    assert checkpoint.num_steps == command_line.num_steps == 6
    assert checkpoint.current_lr == saved.current_lr  # the checkpoint's lr 1e-3, cosine over 20
    assert (command_line.max_lr, command_line.decay_steps) == (3e-3, 8)  # the command line's
    with pytest.raises(ArgumentError, match="--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                                            "are exclusive"):
        _parse(["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"])


def test_recipe_harness_sections_and_later_stages_are_ignored(tmp_path, monkeypatch):
    # Megatron-LM recipes carry CI-harness sections (AFTER_SCRIPT log checks,
    # TEST_EVALUATION, THROUGHPUT_TEST_PARAMS) and later stages (MODEL_ARGS_2, ...):
    # the launcher runs MODEL_ARGS, the first stage.
    monkeypatch.setenv("I15_TB_DIR", str(tmp_path / "tb"))
    config = tmp_path / "model_config.yaml"
    config.write_text(RECIPE.replace("TEST_TYPE: regular\n", "")
                      + "AFTER_SCRIPT: |\n  echo done\nTEST_EVALUATION: xpass\nTHROUGHPUT_TEST_PARAMS:\n  --start_step: 1\n"
                      + "MODEL_ARGS_2:\n  --train-iters: 99\n")
    args = parse_args(["--config", str(config)], world_size=2)
    assert args.train_iters == 8


def test_checkpoint_strategy_and_equivalent_flags_warn_and_run():
    # Settings of Megatron-LM's that change no number here: accepted with one warning each.
    flags = ["--ckpt-fully-parallel-load", "--no-ckpt-fully-parallel-save", "--ckpt-assume-constant-structure",
             "--cross-entropy-fusion-impl", "native", "--apply-query-key-layer-scaling", "--rerun-mode",
             "validate_results"]
    args = parse_args(BASE + ["--train-iters", "4"] + flags, world_size=2)
    assert len(args.flag_warnings) == 6
    with pytest.raises(ArgumentError, match="--rerun-mode report_stats is not supported"):
        parse_args(BASE + ["--train-iters", "4", "--rerun-mode", "report_stats"], world_size=2)


def test_verify_integrity_follows_megatron_lm():
    # Checkpoints here are always checksummed; Megatron-LM allows the flag with torch_dist only.
    args = parse_args(BASE + ["--train-iters", "4", "--verify-integrity", "--ckpt-format", "torch_dist"], world_size=2)
    assert args.verify_integrity and not args.flag_warnings
    with pytest.raises(ArgumentError, match="--verify-integrity is only supported with --ckpt-format torch_dist"):
        parse_args(BASE + ["--train-iters", "4", "--verify-integrity", "--ckpt-format", "torch_dcp"], world_size=2)
