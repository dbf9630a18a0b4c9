"""The scale planner under tensor parallelism (megatron_fsdp/tools/plan.py, [Note: the
plan under tensor parallelism]): pure arithmetic of the request and the plan; fake-group
builds of rank 0 of a DP x TP job (tools/simulate.py: the embedded GPT under its TP plan,
models/tensor_parallel.py, wrapped over the data-parallel ranks) whose persistent bytes
and collectives, the engine's and the TP plan's, equal the plan exactly, padding
included. (tests/test_models_tp.py checks that the plan computes the whole model.)

Each fake-group build runs in a subprocess of its own (the fake group must not meet the
gloo worker pool). The 8B build at world 1024, TP 8 runs with ``MFSDP_SCALE_LARGE=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fsdp.models import GPTConfig, presets
from megatron_fsdp.models.config import Normalization, PositionEmbeddingType
from megatron_fsdp.tools.plan import (PlanRequest, check_tp_split, gpt_config, make_plan, model_names,
                                      tp_collectives)

from test_scale import run_plan  # the planner's command line, as test_scale runs it
LARGE = os.environ.get("MFSDP_SCALE_LARGE") == "1"
FP32 = dict(dtype=torch.float32, main_params_dtype=torch.float32, main_grads_dtype=torch.float32)


# -- the request ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(world=8, tp=3), "tp=3 does not divide world=8"),
    (dict(world=8, tp=0), "tp=0 must be >= 1"),
    (dict(world=16, tp=8), "num_attention_heads=4 is not divisible by the tensor-parallel size 8"),
    (dict(world=8, tp=2, seq_length=33), "seq_length=33 must be between 1 and the model's 32"),
], ids=["world", "zero", "heads", "seq"])
def test_request_names_what_does_not_split(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanRequest(model="tiny", strategy=3, **kwargs)


def test_models_the_plan_cannot_split_are_refused():
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        check_tp_split(GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=130), 4)
    moe = presets.config("mixtral-tiny")
    with pytest.raises(ValueError, match="mixture of experts"):
        check_tp_split(moe, 2)
    check_tp_split(moe, 1)  # no tensor parallelism: nothing to split


def test_vocabulary_is_padded_as_megatron_lm_does():
    """To a multiple of make_vocab_size_divisible_by * tp; the presets' vocabularies are
    multiples of 128 already, so a tp=1 plan is the plan without tensor parallelism."""
    assert PlanRequest(model="8b", world=1024, strategy=3, tp=8).config.vocab_size == 129024  # 126 x 1024
    assert PlanRequest(model="8b", world=1024, strategy=3, tp=8, make_vocab_size_divisible_by=1
                       ).config.vocab_size == 128256
    for name in model_names():
        request = PlanRequest(model=name, world=8, strategy=3)
        assert request.config.vocab_size == gpt_config(name).vocab_size, name
        plan = make_plan(request)
        assert plan.local_params == plan.params and plan.tp_step == {"counts": {}, "bytes": {}}, name


def test_command_line_prints_the_layout_and_refuses_with_the_reason(capsys):
    from megatron_fsdp.tools.plan_cli import main

    assert main(["--model", "8b", "--world", "1024", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "world 1024 = DP 128 x TP 8" in out and "vocabulary padded to 129024" in out
    assert "collectives per step (one microbatch), data-parallel group" in out
    assert "tensor-parallel activations per microbatch (1 x 4096 tokens), TP group" in out
    assert main(["--model", "tiny", "--world", "8", "--tp", "3"]) == 2
    assert "tp=3 does not divide world=8" in capsys.readouterr().err


# -- the plan's arithmetic ------------------------------------------------------------------
def _local_params_by_hand(cfg: GPTConfig, tp: int) -> int:
    """One TP rank's parameters of the embedded GPT, written out from the TP plan: the
    column-parallel qkv and fc, row-parallel projections (biases whole), the vocabulary
    split, norms and learned positions whole."""
    h, heads, groups, d, ffn = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                                cfg.ffn_hidden_size)
    bias = cfg.add_bias_linear
    norm = h * (2 if cfg.normalization is Normalization.LAYER_NORM else 1)
    qkv_rows = (heads + 2 * groups + (heads if cfg.attention_output_gate else 0)) * d
    fc_rows = 2 * ffn if cfg.swiglu else ffn
    split = qkv_rows * h + heads * d * h + fc_rows * h + ffn * h + bias * (qkv_rows + fc_rows)
    whole = 2 * norm + bias * 2 * h
    block = split // tp + whole
    vocab = cfg.vocab_size * h // tp * (1 if not cfg.untie_embeddings_and_output_weights else 2)
    positions = cfg.seq_length * h if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE else 0
    return cfg.num_layers * block + vocab + positions + norm


@pytest.mark.parametrize("model, world, tp", [("tiny", 8, 2), ("small", 1024, 8), ("llama3-tiny", 8, 2),
                                              ("8b", 1024, 8), ("llama3-8b", 1024, 8), ("70b", 1024, 8)])
def test_tp_local_parameters_equal_the_hand_count(model, world, tp):
    plan = make_plan(PlanRequest(model=model, world=world, strategy=3, tp=tp))
    assert plan.local_params == _local_params_by_hand(plan.request.config, tp)
    assert all(g.world == world // tp for g in plan.groups)
    assert plan.params > plan.local_params * (tp - 1)  # most of the model splits


def test_zero3_per_rank_bytes_fall_with_dp_and_tp():
    """ZeRO-3, bf16 weights, fp32 main weights, grads and AdamW state: 18 bytes per
    TP-local parameter over the data-parallel ranks (to within padding); the
    data-parallel traffic per step is that of the TP-local model."""
    plan = make_plan(PlanRequest(model="8b", world=1024, strategy=3, tp=8))
    assert plan.request.dp == 128
    assert plan.total_memory == pytest.approx(18 * plan.local_params / 128, rel=1e-4)
    assert plan.step["bytes"]["reduce_scatter"] == pytest.approx(4 * plan.local_params, rel=1e-4)
    dp_only = make_plan(PlanRequest(model="8b", world=128, strategy=3))
    assert plan.local_params < dp_only.local_params / 7


@pytest.mark.parametrize("model", ["8b", "llama3-8b"])
def test_tp_activation_collectives(model):
    """Per microbatch, in the compute dtype: 4 L + 2 all-reduces of (b, s, h); per layer an
    all-gather in forward and a reduce-scatter in backward of each fused projection's
    output (the qkv; with swiglu the fc too); one all-gather of the (b, s, V) logits."""
    request = PlanRequest(model=model, world=1024, strategy=3, tp=8, micro_batch_size=2, seq_length=1024)
    cfg, tokens, layers = request.config, 2 * 1024, 32
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels  # 3 x 4096 for 8b (MHA)
    fused = qkv + (2 * cfg.ffn_hidden_size if cfg.swiglu else 0)
    fused_calls = layers * (2 if cfg.swiglu else 1)
    assert tp_collectives(request) == {
        "counts": {"all_reduce": 4 * layers + 2, "all_gather": fused_calls + 1, "reduce_scatter": fused_calls},
        "bytes": {"all_reduce": (4 * layers + 2) * tokens * 4096 * 2,
                  "all_gather": layers * tokens * fused * 2 + tokens * cfg.vocab_size * 2,
                  "reduce_scatter": layers * tokens * fused * 2},
    }


# -- the fake-group build equals the plan -----------------------------------------------------
CASES = [("tiny", 8, 2, "fp32", "3"), ("llama3-tiny", 8, 2, "bf16", "3"), ("small", 1024, 8, "bf16", "0")]
"""(model, world, tp, compute dtype, steps run: 0 counts the collectives off the built engine)."""


_LONG_ONLY = pytest.mark.skipif(os.environ.get("MFSDP_TP_LONG") != "1", reason="more builds: MFSDP_TP_LONG=1")


@pytest.mark.parametrize("model, world, tp, dtype, steps",
                         [c if i == 0 else pytest.param(*c, marks=_LONG_ONLY) for i, c in enumerate(CASES)],
                         ids=[f"{c[0]}-w{c[1]}-tp{c[2]}" for c in CASES])
def test_fake_group_build_equals_plan(model, world, tp, dtype, steps):
    """Every strategy: rank 0's persistent bytes per role (buffer accounting, optimizer
    state) and the collectives of a step, the data-parallel ones (the engine's) and
    the TP plan's (DTensor's, when a step runs), equal the plan exactly."""
    records = run_plan("--model", model, "--world", str(world), "--tp", str(tp), "--strategy", "all",
                       "--dtype", dtype, "--check", "--steps", steps)
    assert len(records) == 4
    for r in records:
        assert r["mismatches"] == [], (r["strategy"], r["mismatches"])
        assert (r["dp"], r["tp"]) == (world // tp, tp)
        assert r["measured"]["memory"]["model_weights"] == r["memory"]["model_weights"] > 0
        if steps != "0":
            assert r["measured"]["tp_step"] == r["tp_step"] and r["tp_step"]["counts"]["all_reduce"] > 0


def test_padding_over_the_data_parallel_ranks_is_what_the_engine_holds():
    """At DP 128 the TP-local groups of ``small`` do not divide: each group is padded to
    a multiple of 128, and the engine's bytes exceed the ZeRO formula by exactly that.
    Three steps run at world 1024 too (the TP collectives recorded equal the plan's)."""
    (record,) = run_plan("--model", "small", "--world", "1024", "--tp", "8", "--strategy", "optim_grads_params",
                         "--dtype", "fp32", "--main-params-dtype", "fp32", "--check", "--steps", "3")
    assert record["mismatches"] == [] and record["measured"]["tp_step"] == record["tp_step"]
    plan = make_plan(PlanRequest(model="small", world=1024, tp=8, strategy=3, **FP32))
    padding = sum(g.padded - g.numel for g in plan.groups)
    assert padding > 0
    measured = record["measured"]["memory"]
    for role in ("model_weights", "main_grads"):
        assert measured[role] == 4 * sum(g.padded for g in plan.groups) // 128
        assert measured[role] - plan.formula[role] == pytest.approx(4 * padding / 128)


@pytest.mark.skipif(not LARGE, reason="set MFSDP_SCALE_LARGE=1 (a minute of CPU, GiBs of host memory)")
def test_8b_at_world_1024_tp_8_equals_plan():
    (record,) = run_plan("--model", "8b", "--world", "1024", "--tp", "8", "--strategy", "optim_grads_params",
                         "--check", "--steps", "0", timeout=3600)
    assert record["mismatches"] == [] and record["vocab_size"] == 129024
