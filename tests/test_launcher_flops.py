"""The launcher's FLOPs figure (its TFLOP/s column) against Megatron-LM's own
``num_floating_point_operations``, whose values for a dense GPT, a GQA SwiGLU Llama, a
Mixtral-style MoE, a DeepSeek-style MLA MoE with MTP and gated attention are recorded in
``tests/data/megatron_lm_flops.json``."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from megatron_fsdp.training.observe.flops import num_floating_point_operations

RECORDED = json.loads((Path(__file__).parent / "data" / "megatron_lm_flops.json").read_text())["cases"]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_equals_megatron_lm(name):
    case = RECORDED[name]
    assert num_floating_point_operations(Namespace(**case["args"]), case["batch_size"]) == case["flops"]


def test_moe_counts_the_routed_experts_not_all_of_them():
    args = Namespace(**RECORDED["moe_mixtral"]["args"])
    top2 = num_floating_point_operations(args, 1)
    args.num_experts = 64  # more experts, the same two per token: the same FLOPs
    assert num_floating_point_operations(args, 1) == top2
    args.moe_router_topk = 4
    assert num_floating_point_operations(args, 1) > top2


def test_a_layer_pattern_of_the_wrong_length_is_refused():
    args = Namespace(**{**RECORDED["moe_mixtral"]["args"], "moe_layer_freq": [1, 0]})
    with pytest.raises(ValueError, match="--moe-layer-freq gives 2 layers for --num-layers 4"):
        num_floating_point_operations(args, 1)
