"""Launcher defaults and flag meanings that change the numbers of a run, checked
against Megatron-LM's behaviour at the pinned commit (flag_data/megatron_lm_flags.csv):
each test names the Megatron-LM source it mirrors and fails on the launcher's
former behaviour. No process group, no subprocess.
"""

from __future__ import annotations

import dataclasses

import math
import types

import pytest
import torch

from launcher_inprocess import REPO, load_pretrain_script
from megatron_fsdp.training.args.arg_types import LRDecayStyle
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.optim.lr_schedule import LRSchedule

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --lr 3e-3").split()


def _parse(extra: list[str], world_size: int = 2, iters=("--train-iters", "8")):
    return parse_args([*BASE, *iters, *extra], world_size=world_size)


def _megatron_lr(num_steps: float, *, max_lr, min_lr, warmup, decay, style, init_lr=0.0) -> float:
    """OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py) for the
    styles the launcher accepts, written from its rules: warmup, constant, the decay
    horizon, then the style's formula."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * num_steps / warmup
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


# -- learning-rate schedule ----------------------------------------------------------------
def test_inverse_square_root_reaches_min_lr_after_the_decay_horizon():
    # Megatron-LM checks `num_steps > lr_decay_steps` before the inverse-square-root
    # formula: the tail is cut to min_lr (the launcher used to keep decaying as 1/sqrt).
    sched = LRSchedule(max_lr=1.0, min_lr=0.01, warmup_steps=4, decay_steps=16, style=LRDecayStyle.INVERSE_SQUARE_ROOT)
    assert sched.lr_at(16) == pytest.approx(0.5)  # sqrt(4 / 16), still inside the horizon
    assert sched.lr_at(17) == 0.01  # not sqrt(4 / 17) = 0.485
    assert sched.lr_at(1000) == 0.01


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_schedule_follows_megatron_lm_step_by_step(style):
    # Megatron-LM's clock counts samples in iteration-based training (decay = iters x global batch).
    args = _parse(["--global-batch-size", "16", "--lr-decay-style", style, "--lr-warmup-iters", "3",
                   "--lr-decay-iters", "12", "--min-lr", "1e-4", "--lr-warmup-init", "1e-5"],
                  world_size=1, iters=("--train-iters", "20"))
    gbs = args.global_batch_size
    sched = LRSchedule.from_args(args)
    for it in range(21):
        expected = _megatron_lr(it * gbs, max_lr=3e-3, min_lr=1e-4, warmup=3 * gbs, decay=12 * gbs, style=style,
                                init_lr=1e-5)
        assert sched.lr_at(it) == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, it)


def test_lr_warmup_fraction_is_not_rounded():
    # Megatron-LM: lr_warmup_steps = lr_warmup_fraction * lr_decay_steps, a float (here
    # 0.01 x 150 x 8 = 12 samples, 1.5 iterations); the launcher used to round it down to 1.
    args = _parse(["--lr-warmup-fraction", "0.01", "--lr-decay-iters", "150", "--global-batch-size", "8"],
                  world_size=1, iters=("--train-iters", "150"))
    sched = LRSchedule.from_args(args)
    assert sched.warmup_steps == pytest.approx(1.5)
    for it in (1, 2, 75, 150):
        expected = _megatron_lr(it * 8, max_lr=3e-3, min_lr=0.0, warmup=0.01 * 150 * 8, decay=150 * 8,
                                style="linear")
        assert sched.lr_at(it) == pytest.approx(expected, rel=1e-12), it
    assert sched.lr_at(1) == pytest.approx(3e-3 / 1.5)


# -- model shape defaults ------------------------------------------------------------------
@pytest.mark.parametrize("hidden, swiglu, expected", [
    (64, False, 256),
    (64, True, 128),  # int(4 * 64 * 2/3 / 64) * 64: Megatron-LM's validate_args, not 4 x hidden
    (96, True, 256),
    (4096, True, 10880),
])
def test_ffn_hidden_size_default_follows_megatron_lm(hidden, swiglu, expected):
    extra = ["--hidden-size", str(hidden)] + (["--swiglu"] if swiglu else [])
    assert _parse(extra).ffn_hidden_size == expected
    assert _parse(extra + ["--ffn-hidden-size", "176"]).ffn_hidden_size == 176  # given: used as is


def test_swiglu_default_ffn_of_zero_width_is_an_error():
    with pytest.raises(ArgumentError, match="--swiglu with --hidden-size=16 and no --ffn-hidden-size"):
        _parse(["--hidden-size", "16", "--swiglu"])


@pytest.mark.parametrize("vocab, padded", [(128, 128), (100, 128), (129, 256)])
def test_null_tokenizer_vocabulary_is_vocab_size(vocab, padded):
    # megatron.core's NullTokenizer has --vocab-size ids (end-of-document = the last);
    # the launcher used to add one, doubling the padded vocabulary at --vocab-size 128.
    args = _parse(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)])
    assert args.padded_vocab_size == padded
    from megatron_fsdp.training.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=vocab)
    assert tokenizer.vocab_size == vocab and tokenizer.eod == vocab - 1


# -- evaluation ----------------------------------------------------------------------------
def _load_script():
    return load_pretrain_script("pretrain_gpt_numbers")  # the tests patch it: a copy of their own


@dataclasses.dataclass
class _Context:
    """The one StepContext field maybe_evaluate reads (evaluate itself is replaced)."""

    layout: object


def test_each_evaluation_reads_the_next_validation_batches(monkeypatch):
    # Megatron-LM's validation iterator is not rewound: evaluation k reads batches
    # [k * eval_iters, (k + 1) * eval_iters) and consumed_valid_samples is checkpointed.
    from megatron_fsdp.training.training_step import TrainState

    script = _load_script()
    starts = []
    monkeypatch.setattr(script, "evaluate", lambda ctx, src, iters, consumed: starts.append(consumed) or 1.0)
    monkeypatch.setattr(script, "log_validation", lambda *a: None)
    monkeypatch.setattr(script.dashboards_mod, "write_validation_scalars", lambda *a: None)
    from megatron_fsdp.training.data import BatchLayout

    # Training batch 4 (micro batch 2 x 2, one rank); evaluation --eval-global-batch-size 8.
    args = types.SimpleNamespace(eval_iters=3, global_batch_size=4, eval_global_batch_size=8,
                                 eval_micro_batch_size=2, eval_num_microbatches=4)
    ctx = _Context(layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=0, dp_size=1))
    layouts = []
    monkeypatch.setattr(script, "evaluate", lambda ctx, src, iters, consumed: layouts.append(ctx.layout)
                        or starts.append(consumed) or 1.0)
    state = TrainState()
    metrics = types.SimpleNamespace(validation=[])
    for _ in range(3):
        script.maybe_evaluate(args, ctx, state, object(), metrics, None)
    assert starts == [0, 24, 48] and state.consumed_valid_samples == 72
    assert all((l.micro_batch_size, l.num_microbatches) == (2, 4) for l in layouts)  # the evaluation batch
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert restored.consumed_valid_samples == 72
    old = {k: v for k, v in state.state_dict().items() if k != "consumed_valid_samples"}
    restored.load_state_dict(old)  # a checkpoint from before the field: 0, as Megatron-LM
    assert restored.consumed_valid_samples == 0


def test_evaluate_starts_at_the_consumed_validation_samples():
    from megatron_fsdp.training.data import BatchLayout
    from megatron_fsdp.training.model_setup import ModelBundle
    from megatron_fsdp.training.training_step import StepContext, evaluate

    seen = []

    def loss_fn(inputs, targets):
        seen.append(int(inputs[0, 0]))
        return torch.zeros(()), targets.numel()

    class Source:
        def __len__(self):
            return 1000

        def sample(self, index):
            return torch.full((5,), index, dtype=torch.int64)

    model = torch.nn.Linear(1, 1)
    bundle = ModelBundle(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                         is_fsdp=False, num_parameters=0)
    ctx = StepContext(bundle=bundle, schedule=None, scaler=None, device=torch.device("cpu"), clip_grad=0.0,
                      layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=0, dp_size=1),
                      per_token_loss=False, check_for_nan=False)
    evaluate(ctx, Source(), eval_iters=2, consumed_samples=8)
    assert seen == [8, 10, 12, 14]  # micro batches of global batches 2 and 3, not 0 and 1


# -- --deterministic-mode ------------------------------------------------------------------
def test_deterministic_mode_refuses_what_megatron_lm_refuses(monkeypatch):
    # megatron/training/determinism.py: ARG_VALUES_REQUIRED_FOR_DETERMINISM and the env checks.
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    assert _parse(["--deterministic-mode"]).deterministic_mode
    with pytest.raises(ArgumentError, match="--deterministic-mode cannot be combined with --cross-entropy-loss-fusion"):
        _parse(["--deterministic-mode", "--cross-entropy-loss-fusion"])
    _parse(["--cross-entropy-loss-fusion"])  # fine without the mode
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ArgumentError, match="NCCL_ALGO='Tree'"):
        _parse(["--deterministic-mode"])
    monkeypatch.setenv("NCCL_ALGO", "Ring,^NVLS")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ArgumentError, match="CUBLAS_WORKSPACE_CONFIG=':0:0'"):
        _parse(["--deterministic-mode"])


def test_deterministic_mode_sets_defaults_and_torch_algorithms(monkeypatch):
    from megatron_fsdp.training import determinism

    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda flag: env.__setitem__("torch", flag))
    determinism.apply(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                   "torch": True}


# -- the default tokenizer -----------------------------------------------------------------
def test_vocab_files_without_a_type_mean_gpt2_bpe():
    # pretrain_gpt.py: args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}. The launcher
    # used to take the byte tokenizer (256 ids) and ignore the files.
    from megatron_fsdp.training.data import build_tokenizer_from_args

    files = ["--vocab-file", str(REPO / "data/bpe/vocab.json"), "--merge-file", str(REPO / "data/bpe/merges.txt")]
    args = _parse(["--mock-data", *files])
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert build_tokenizer_from_args(args).vocab_size > 256
    assert _parse(["--mock-data"]).tokenizer_type == "ByteTokenizer"  # no files: the launcher's own default
    with pytest.raises(ArgumentError, match="--merge-file"):  # half of GPT-2's pair
        _parse(["--mock-data", *files[:2]])


# -- --decoupled-lr ------------------------------------------------------------------------
@pytest.mark.parametrize("untie", [False, True])
def test_decoupled_lr_gives_embedding_and_output_their_own_schedule(untie):
    # megatron/core/optimizer/__init__.py: is_embedding_or_output_parameter groups get
    # max_lr=--decoupled-lr, min_lr=--decoupled-min-lr; OptimizerParamScheduler.get_lr
    # runs the same warmup and decay between each group's bounds.
    from megatron_fsdp.models.gpt import GPT
    from megatron_fsdp.training.model_setup import build_optimizer, gpt_config_from_args

    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    args = _parse(["--mock-data", "--vocab-size", "64", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                   "--min-lr", "1e-4", "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3", *extra])
    model = GPT(gpt_config_from_args(args))
    optimizer = build_optimizer(model, args)
    own = [g for g in optimizer.param_groups if "max_lr" in g]
    expected = {id(model.wte.weight), id(model.lm_head.weight)}
    assert {id(p) for g in own for p in g["params"]} == expected
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    schedule = LRSchedule.from_args(args)
    for step in range(10):
        logged = schedule.apply(optimizer)
        for group in optimizer.param_groups:
            bounds = (1e-2, 1e-3) if "max_lr" in group else (3e-3, 1e-4)
            want = _megatron_lr(step, max_lr=bounds[0], min_lr=bounds[1], warmup=2, decay=8, style="cosine")
            assert group["lr"] == pytest.approx(want), (step, bounds)
        assert logged == pytest.approx(_megatron_lr(step, max_lr=3e-3, min_lr=1e-4, warmup=2, decay=8, style="cosine"))
        schedule.step()
    plain = build_optimizer(model, _parse(["--mock-data", "--vocab-size", "64"]))
    assert not any("max_lr" in g for g in plain.param_groups)


def test_apply_wd_to_qk_layernorm_decays_the_qk_norms():
    # megatron/core/optimizer/__init__.py: with apply_wd_to_qk_layernorm the no-decay
    # rule (1-D or bias) spares q_layernorm./k_layernorm. parameters.
    from megatron_fsdp.models.gpt import GPT
    from megatron_fsdp.training.model_setup import build_optimizer, gpt_config_from_args

    for flag, decayed in (([], False), (["--apply-wd-to-qk-layernorm"], True)):
        args = _parse(["--mock-data", "--vocab-size", "64", "--qk-layernorm", "--weight-decay", "0.1", *flag])
        model = GPT(gpt_config_from_args(args))
        optimizer = build_optimizer(model, args)
        decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
        for name, param in model.named_parameters():
            qk = "q_layernorm." in name or "k_layernorm." in name
            plain_rule = not (param.ndim == 1 or name.endswith(".bias"))
            assert decay_of[id(param)] == (0.1 if plain_rule or (qk and decayed) else 0.0), name


# -- --moe-router-load-balancing-type ------------------------------------------------------
def test_load_balancing_type_reaches_the_model():
    # Megatron-core's router: seq_aux_loss is the Switch loss per sequence (checked against
    # megatron-core in test_models_mcore.py), none adds no loss whatever the coefficient;
    # the launcher used to accept none and still add the aux loss.
    from megatron_fsdp.models.config import MoELoadBalancing
    from megatron_fsdp.models.gpt import GPT
    from megatron_fsdp.training.observe.logging_utils import IntervalStats, format_iteration_line
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    moe = ["--mock-data", "--vocab-size", "64", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
    for kind, aux in (("aux_loss", True), ("seq_aux_loss", True), ("none", False)):
        cfg = gpt_config_from_args(_parse([*moe, "--moe-router-load-balancing-type", kind]))
        assert cfg.moe_router_load_balancing_type is MoELoadBalancing(kind)
        model = GPT(cfg)
        model(torch.randint(0, 64, (2, 16))).sum().backward()
        assert (model.moe_aux_loss() is not None) == aux, kind
    with pytest.raises(ArgumentError, match="combining balancing losses is not implemented"):
        _parse([*moe, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"])
    stats = IntervalStats(balancing_name=MoELoadBalancing.SEQ_AUX_LOSS.log_name)
    stats.add(types.SimpleNamespace(lm_loss=2.0, skipped=False, nan=False, load_balancing_loss=1.25), 0.1)
    line = format_iteration_line(iteration=1, train_iters=2, consumed_samples=8, stats=stats, throughput=None,
                                 learning_rate=None, global_batch_size=8, loss_scale=1.0, grad_norm=None)
    assert " seq_load_balancing_loss: 1.250000E+00 |" in line
