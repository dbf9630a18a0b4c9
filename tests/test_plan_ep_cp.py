"""The scale planner under expert and context parallelism (megatron_fsdp/tools/plan.py,
[Note: the plan under expert and context parallelism]): pure arithmetic of the request and
the plan, written out by hand here; fake-group builds of rank 0 of a large job
(tools/simulate.py: the launcher's meshes, models.expert_parallel's experts and token
dispatch, models.context_parallel's attention) whose bytes per role and parameter kind,
shard groups, experts held and collectives -- the engine's, EP's all-to-alls and CP's K/V
exchanges, recorded over three training steps -- equal the plan exactly.

Each fake-group build runs in a subprocess of its own (the fake group must not meet the
gloo worker pool). One build runs by default (EP 64 at world 1024); the others, Mixtral
8x7B at world 1024 among them, with ``MFSDP_EPCP_LONG=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fsdp.tools.plan import (PlanRequest, cp_collectives, ep_collectives, gpt_config, local_experts,
                                      make_plan, moe_model_names, tp_collectives)

from test_scale import run_plan  # the planner's command line, as test_scale runs it

LONG = pytest.mark.skipif(not os.environ.get("MFSDP_EPCP_LONG"), reason="more fake-group builds: MFSDP_EPCP_LONG=1")


# -- the request ----------------------------------------------------------------------------
@pytest.mark.parametrize("model, kwargs, match", [
    ("tiny", dict(world=8, ep=2), r"ep=2 with 'tiny', a dense model: .* use ep=1 or a mixture-of-experts preset"),
    ("mixtral-8x7b", dict(world=1024, ep=3), r"ep=3 does not divide the 8 experts .* use one of \[1, 2, 4, 8\]"),
    ("moe-tiny", dict(world=48, ep=32), r"ep=32 does not divide world=48: .* use an ep that divides 48"),
    ("mixtral-tiny", dict(world=8, tp=2, ep=2), r"ep=2 with tp=2: .* use tp=1 or ep=1"),
    ("tiny", dict(world=8, tp=2, cp=3), r"cp=3 does not divide world / tp = 4: .* use a cp that divides it"),
    ("tiny", dict(world=8, cp=4, seq_length=28), r"seq_length=28 is not a multiple of 2 x cp = 8: .* multiple of 8"),
    ("tiny", dict(world=8, cp=0), r"cp=0 must be >= 1"),
    ("tiny", dict(world=8, ep=0), r"ep=0 must be >= 1"),
    ("gpt3-1.3b", dict(world=8, cp=2), r"cp=2 cannot share this model's sequences: attention dropout"),
], ids=["ep-dense", "ep-experts", "ep-world", "ep-tp", "cp-world", "cp-seq", "cp-zero", "ep-zero", "cp-dropout"])
def test_request_refuses_with_the_remedy(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanRequest(model=model, strategy=3, **kwargs)


def test_moe_presets_are_planned():
    assert {"mixtral-8x7b", "mixtral-tiny", "moe-tiny"} <= set(moe_model_names())
    plan = make_plan(PlanRequest(model="mixtral-tiny", world=8, strategy=3))
    assert plan.local_params == plan.params and plan.expert_params > 0  # EP 1: every expert on every rank
    assert {g.world for g in plan.groups} == {8} and plan.ep_step == {"counts": {}, "bytes": {}}


def test_rank_zero_holds_the_first_block_of_experts():
    """Megatron-LM's assignment: EP rank r holds global experts [r E/ep, (r+1) E/ep)."""
    assert local_experts(64, 8) == range(0, 8) and local_experts(64, 8, ep_rank=3) == range(24, 32)
    request = PlanRequest(model="mixtral-tiny", world=8, strategy=3, ep=2)
    weight = torch.empty(192, 64)
    weight.allreduce = False
    assert request.rank_numel("blocks.1.mlp.experts.1.fc.weight", weight) == 192 * 64
    assert request.rank_numel("blocks.1.mlp.experts.2.fc.weight", weight) == 0


# -- the plan's arithmetic ------------------------------------------------------------------
def _expert_numel(model: str) -> int:
    """One expert's parameters (SwiGLU: fc of 2 ffn x h, proj of h x ffn)."""
    cfg = gpt_config(model)
    return 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size


def test_expert_parallel_parameters_and_bytes_by_hand():
    """Mixtral 8x7B at world 1024, EP 8, ZeRO-3: rank 0 holds expert 0 of each of the 32
    layers, sharded over the 128 expert data-parallel ranks; the dense rest is sharded over
    all 1024. bf16 weights, fp32 main weights, grads and AdamW state: 18 bytes per element
    of each kind over its own group (no padding at these sizes)."""
    plan = make_plan(PlanRequest(model="mixtral-8x7b", world=1024, strategy=3, ep=8))
    per_expert, layers = _expert_numel("mixtral-8x7b"), 32
    assert plan.expert_params == layers * 1 * per_expert
    dense = plan.params - layers * 8 * per_expert
    assert plan.local_params - plan.expert_params == dense
    experts = [g for g in plan.groups if g.expert]
    assert len(experts) == layers and {g.world for g in experts} == {128}
    assert {g.world for g in plan.groups if not g.expert} == {1024}
    assert sum(plan.memory_by_kind["expert"].values()) == 18 * layers * per_expert // 128
    assert sum(plan.memory_by_kind["dense"].values()) == pytest.approx(18 * dense / 1024, rel=1e-6)
    assert plan.padding_bytes == pytest.approx(0, abs=18 * 1024)  # padding of the few dense root groups only
    assert plan.memory == {role: plan.memory_by_kind["dense"][role] + plan.memory_by_kind["expert"][role]
                           for role in plan.memory}


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallelism_cuts_expert_traffic_not_memory(ep):
    """Fully sharded, a rank keeps 1/world of the experts at any EP (E/ep experts over
    world/ep ranks), but each expert group moves only its E/ep local experts: the expert
    all-gather and reduce-scatter payloads fall by ep, the dense ones stay."""
    base = make_plan(PlanRequest(model="mixtral-8x7b", world=1024, strategy=3))
    plan = make_plan(PlanRequest(model="mixtral-8x7b", world=1024, strategy=3, ep=ep))
    assert plan.memory_by_kind == base.memory_by_kind
    for kind in ("all_gather", "reduce_scatter"):
        assert plan.step_by_kind["expert"]["bytes"][kind] * ep == base.step_by_kind["expert"]["bytes"][kind]
        assert plan.step_by_kind["dense"] == base.step_by_kind["dense"]
    assert plan.step_by_kind["expert"]["counts"] == base.step_by_kind["expert"]["counts"]


def test_expert_groups_gather_over_edp_under_every_strategy():
    """ZeRO-1/2 refresh each group once, ZeRO-0 all-reduces it: over edp for experts; the
    step total is the sum of the two kinds."""
    for strategy in range(4):
        plan = make_plan(PlanRequest(model="moe-tiny", world=1024, strategy=strategy, ep=64))
        for field in ("counts", "bytes"):
            for kind in plan.step[field]:
                assert plan.step[field][kind] == sum(plan.step_by_kind[k][field].get(kind, 0)
                                                     for k in ("dense", "expert"))
        experts = [g for g in plan.groups if g.expert]
        assert {g.world for g in experts} == {16}
        reduce_kind = "all_reduce" if strategy == 0 else "reduce_scatter"
        assert plan.step_by_kind["expert"]["bytes"][reduce_kind] == 4 * sum(g.padded for g in experts)


def test_ep_activation_collectives_by_hand():
    """Per MoE layer and microbatch: one all-to-all of the E int64 counts, and 4 token
    all-to-alls of this rank's n k routed rows of h bf16 values (dispatch and combine,
    forward and backward), the dispatch and its gradient carrying each row's routing weight
    (bf16: the router's dtype is the compute dtype here) too; under uniform routing 7/8 of
    it leaves the rank at EP 8."""
    request = PlanRequest(model="mixtral-8x7b", world=1024, strategy=3, ep=8, micro_batch_size=2)
    n, k, h, layers = 2 * 4096, 2, 4096, 32
    assert request.routing_weight_dtype == torch.bfloat16
    tokens = layers * (2 * n * k * (h * 2 + 2) + 2 * n * k * h * 2)
    assert ep_collectives(request, layers) == {
        "counts": {"all_to_all": 4 * layers, "all_to_all_counts": layers},
        "bytes": {"all_to_all": tokens, "all_to_all_counts": layers * 8 * 8},
    }
    plan = make_plan(request)
    assert plan.ep_step == ep_collectives(request, layers)
    assert plan.leaving == {"ep": (tokens + layers * 64) * 7 / 8}
    assert make_plan(PlanRequest(model="mixtral-8x7b", world=1024, strategy=3, ep=8, cp=2, micro_batch_size=2)
                     ).ep_step["bytes"]["all_to_all"] * 2 == tokens  # CP: half the tokens per rank


def test_context_parallelism_changes_no_parameter_layout():
    """At tp=1 the dense shard group is every rank whatever cp is: the groups, bytes and
    FSDP collectives of cp=2 and 4 are cp=1's; only the data-parallel size and the K/V
    exchange differ. With TP, the shard group is the world / tp ranks of one TP piece."""
    base = make_plan(PlanRequest(model="llama3-8b", world=1024, strategy=3))
    for cp in (2, 4):
        plan = make_plan(PlanRequest(model="llama3-8b", world=1024, strategy=3, cp=cp))
        assert (plan.groups, plan.memory, plan.step) == (base.groups, base.memory, base.step)
        assert (plan.request.dp, plan.request.dense_world) == (1024 // cp, 1024)
        assert plan.cp_step["counts"] == {"all_gather": 32, "reduce_scatter": 32}
    with_tp = make_plan(PlanRequest(model="llama3-8b", world=1024, strategy=3, tp=8, cp=2))
    assert {g.world for g in with_tp.groups} == {128} and with_tp.request.dp == 64


def test_cp_activation_collectives_by_hand():
    """Per attention layer and microbatch: one all-gather of K and V (2, b, s, g, d) and
    one reduce-scatter of their gradients; 3/4 of it leaves the rank at CP 4. With TP the
    K/V are the TP rank's g / tp groups, and the TP exchanges see s / cp tokens."""
    request = PlanRequest(model="llama3-8b", world=1024, strategy=3, cp=4)
    kv = 2 * 1 * 8192 * 8 * 128 * 2  # K and V, whole sequence, bf16
    assert cp_collectives(request, 32) == {"counts": {"all_gather": 32, "reduce_scatter": 32},
                                           "bytes": {"all_gather": 32 * kv, "reduce_scatter": 32 * kv}}
    assert make_plan(request).leaving == {"cp": 2 * 32 * kv * 3 / 4}
    both = PlanRequest(model="llama3-8b", world=1024, strategy=3, tp=8, cp=2)
    assert cp_collectives(both, 32)["bytes"]["all_gather"] == 32 * 2 * 8192 * 1 * 128 * 2
    tp_only = tp_collectives(PlanRequest(model="llama3-8b", world=1024, strategy=3, tp=8))
    assert tp_collectives(both)["counts"] == tp_only["counts"]
    assert {k: 2 * v for k, v in tp_collectives(both)["bytes"].items()} == tp_only["bytes"]


def test_command_line_lists_the_ep_and_cp_collectives(capsys):
    from megatron_fsdp.tools.plan_cli import main

    assert main(["--model", "mixtral-8x7b", "--world", "1024", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "world 1024 = DP 1024, experts EP 8 x EDP 128" in out
    assert "expert 0 of every MoE layer" in out
    assert "of which expert groups, over the expert data-parallel group (128)" in out
    assert "expert-parallel activations per microbatch (1 x 4096 tokens per rank), EP group of 8" in out
    assert "all_to_all_counts" in out
    assert main(["--model", "llama3-8b", "--world", "1024", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "world 1024 = DP 512 x CP 2" in out
    assert "context-parallel activations per microbatch (1 x 4096 tokens per rank), CP group of 2" in out
    assert main(["--model", "tiny", "--world", "8", "--ep", "2"]) == 2
    assert "a dense model" in capsys.readouterr().err


# -- the fake-group build equals the plan -----------------------------------------------------
def _check_records(records: list[dict], strategies: int = 4) -> None:
    assert len(records) == strategies
    for r in records:
        assert r["mismatches"] == [], (r["strategy"], r["mismatches"])
        m = r["measured"]
        assert m["memory_by_kind"] == r["memory_by_kind"] and m["step_by_kind"] == r["step_by_kind"]
        assert m["memory"]["model_weights"] == r["memory"]["model_weights"] > 0


def _check_expert_exchanges(record: dict, layers: int) -> None:
    """The MoE layers' own counters (models.expert_parallel.ExchangeCounts) agree: per layer
    one count exchange, dispatch and combine forward, their two gradients backward, and
    every pick of this rank's n tokens sent (dropless)."""
    b, s = record["tokens"]
    n = b * s // record["cp"]
    topk = 2  # every MoE preset here
    per_layer = {"counts": 1, "dispatches": 1, "combines": 1, "combine_grads": 1, "dispatch_grads": 1}
    assert record["measured"]["ep_exchanges"] == {**{k: v * layers for k, v in per_layer.items()},
                                                  "rows_sent": layers * n * topk}


def test_expert_parallel_build_at_world_1024_equals_plan():
    """EP 64 at world 1024, every strategy: rank 0 holds expert 0 of each of the 64 in
    every MoE layer, its expert groups are sharded over the 16 expert data-parallel
    ranks and the dense ones over all 1024; bytes per role and kind, the engine's
    collectives and EP's all-to-alls of three training steps equal the plan."""
    records = run_plan("--model", "moe-tiny", "--world", "1024", "--ep", "64", "--strategy", "all", "--check")
    _check_records(records)
    for r in records:
        m = r["measured"]
        assert m["layout"] == {"dense": [1024], "expert": [16]} and m["experts_held"] == [0]
        assert r["memory_by_kind"]["expert"]["main_grads"] > 0
        assert m["step_source"] == "step 3 of 3 recorded" and m["ep_step"] == r["ep_step"]
        assert r["ep_step"]["counts"] == {"all_to_all_counts": 4, "all_to_all": 16}
        _check_expert_exchanges(r, layers=4)


@LONG
def test_context_parallel_build_at_world_1024_equals_plan():
    """CP 2 at world 1024: the dense shard group is all 1024 ranks (CP changes no layout:
    the bytes are the cp=1 plan's), and three steps through the CP attention issue the
    planned K/V all-gathers and reduce-scatters (one each per layer) beside the FSDP ones."""
    records = run_plan("--model", "tiny", "--world", "1024", "--cp", "2", "--strategy", "all", "--check",
                       "--steps", "3", "--dtype", "fp32")
    _check_records(records)
    for r in records:
        m = r["measured"]
        assert m["layout"] == {"dense": [1024]} and m["cp_step"] == r["cp_step"]
        assert r["cp_step"]["counts"] == {"all_gather": 4, "reduce_scatter": 4}
        base = make_plan(PlanRequest(model="tiny", world=1024, strategy=r["strategy"], dtype=torch.float32))
        assert m["memory"] == {k: v for k, v in base.memory.items() if v}


@LONG
def test_tensor_and_context_parallel_build_equals_plan():
    """TP 2 x CP 2 at world 8 (DP 2): dense groups over the 4 dp x cp ranks of each TP
    piece (the flattened dp_shard_cp dimension); the TP exchanges on s / cp tokens and the
    K/V exchanges of the TP rank's query groups, as run, equal the plan."""
    records = run_plan("--model", "llama3-tiny", "--world", "8", "--tp", "2", "--cp", "2", "--strategy", "all",
                       "--check", "--steps", "3")
    _check_records(records)
    for r in records:
        m = r["measured"]
        assert m["layout"] == {"dense": [4]} and (r["dp"], r["dense_world"]) == (2, 4)
        assert m["tp_step"] == r["tp_step"] and m["cp_step"] == r["cp_step"] and r["cp_step"]["counts"]


@LONG
@pytest.mark.parametrize("world, ep, cp, steps", [(8, 1, 1, "3"), (8, 2, 2, "3"), (1024, 4, 1, "0")],
                         ids=["w8-ep1", "w8-ep2-cp2", "w1024-ep4-engine-plan"])
def test_mixtral_tiny_builds_equal_plan(world, ep, cp, steps):
    """A Llama-shaped MoE: at EP 1 the experts over all ranks; EP 2 with CP 2 (the MoE
    layers see the CP rank's half of every sequence), three steps whose all-to-alls and
    K/V exchanges equal the plan; at EP 4, world 1024, rank 0 keeps expert 0 of 4 over 256
    expert data-parallel ranks (collectives read off the built engine)."""
    records = run_plan("--model", "mixtral-tiny", "--world", str(world), "--ep", str(ep), "--cp", str(cp),
                       "--strategy", "all", "--check", "--steps", steps)
    _check_records(records)
    for r in records:
        m = r["measured"]
        assert m["layout"] == {"dense": [world], "expert": [world // ep]}
        assert m["experts_held"] == list(range(4 // ep))
        if ep > 1 and steps != "0":
            assert m["ep_step"] == r["ep_step"] and m["cp_step"] == r["cp_step"] and r["cp_step"]["counts"]
            _check_expert_exchanges(r, layers=2)


@LONG
def test_mixtral_8x7b_at_world_1024_ep_8_equals_plan():
    """The real size (46.7B parameters; about five minutes of CPU, 1 GiB of host memory: the
    meta-device build draws the initial values of every expert, the dropped ones included,
    so that rank 0's equal the whole model's)."""
    (record,) = run_plan("--model", "mixtral-8x7b", "--world", "1024", "--ep", "8", "--strategy", "optim_grads_params",
                         "--check", "--steps", "0", timeout=1800)
    assert record["mismatches"] == [] and record["measured"]["experts_held"] == [0]
    assert record["measured"]["layout"] == {"dense": [1024], "expert": [128]}
