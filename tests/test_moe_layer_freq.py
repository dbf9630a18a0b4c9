"""Megatron-LM's ``--moe-layer-freq``: which layers of a ``--num-experts`` model are MoE.

* the launcher reads the flag as Megatron-LM's ``moe_freq_type`` does (an int, or a
  list expression of digits and ``,[]()+*``);
* the dense/MoE layer pattern -- ``GPTConfig.moe_layer_pattern``, the embedded GPT's
  blocks and megatron-core's GPTModel built by ``--use-mcore-models`` -- equals the one
  megatron-core's ``get_gpt_decoder_layer_specs`` lays out, for several values;
* a mixed pattern computes what megatron-core computes (logits and gradients);
* values Megatron-LM cannot use are refused before training, naming the fix.
"""

from __future__ import annotations

import pytest

from megatron_fsdp.models import GPT, GPTConfig
from megatron_fsdp.models.moe import MoELayer
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.args.validation import parse_layer_freq

LLAMA_MOE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64, swiglu=True,
                 ffn_hidden_size=40, normalization="RMSNorm", position_embedding_type="rope",
                 untie_embeddings_and_output_weights=True, add_bias_linear=False, num_moe_experts=4,
                 moe_router_topk=2)


@pytest.mark.parametrize("text, expected", [
    ("1", 1), ("3", 3), (" 2 ", 2), (2, 2),
    ("([0]+[1]*23)", [0] + [1] * 23),  # Megatron-LM's DeepSeek recipes
    ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0] * 2),
    ("[0,1]*2", [0, 1, 0, 1]),
    ("2*[1,0]", [1, 0, 1, 0]),
    ("'[0]*3+[1]'", [0, 0, 0, 1]),  # quotes left by a YAML file or a shell script
])
def test_parse_as_megatron_lm(text, expected):
    assert parse_layer_freq(text) == expected


@pytest.mark.parametrize("text, message", [
    ("[0] * 3", "not allowed"),  # Megatron-LM's character check refuses spaces too
    ("[x]", "not allowed"),
    ("__import__('os')", "invalid literal"),  # no '[': Megatron-LM's int(x)
    ("([0],[1])", "not a list"),
    ("[0]*", "not a Python list expression"),
])
def test_parse_refuses_what_megatron_lm_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_layer_freq(text)


def _megatron_core_pattern(cfg: GPTConfig) -> list[int]:
    """1/0 per layer as megatron-core's get_gpt_decoder_layer_specs lays the layers out."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.moe.moe_layer import MoELayer as McoreMoELayer

    from megatron_fsdp.models.mcore import _transformer_config, mcore_args

    config = _transformer_config(cfg, mcore_args(cfg))
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=cfg.normalization.value)
    return [int(spec.submodules.mlp.module is McoreMoELayer) for spec in specs]


FREQS = [1, 2, 3, 5, [0, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("freq", FREQS, ids=str)
def test_layer_pattern_equals_megatron_cores(freq):
    pytest.importorskip("megatron.core")
    cfg = GPTConfig(**LLAMA_MOE, moe_layer_freq=freq)
    expected = _megatron_core_pattern(cfg)
    assert cfg.moe_layer_pattern == expected
    assert [int(isinstance(b.mlp, MoELayer)) for b in GPT(cfg).blocks] == expected
    if freq == 2:
        assert expected == [1, 0, 1, 0]  # layer i is MoE when i % N == 0 (0-based)


def mcore_layers_worker(rank, world, *, freq):
    """Which layers of megatron-core's GPTModel (as --use-mcore-models builds it) are MoE."""
    from megatron.core.transformer.moe.moe_layer import MoELayer as McoreMoELayer

    from megatron_fsdp.models.mcore import balancing_loss_reader, build_mcore_gpt
    from test_models_mcore import _mcore_on_cpu

    cfg = GPTConfig(**LLAMA_MOE, moe_layer_freq=freq)
    with _mcore_on_cpu():
        model = build_mcore_gpt(cfg, allow_cpu=True)
    return dict(pattern=[int(isinstance(layer.mlp, McoreMoELayer)) for layer in model.decoder.layers],
                reader_layers=balancing_loss_reader(cfg).num_moe_layers)


@pytest.mark.parametrize("freq", [2, 3, [0, 1, 1, 1]], ids=str)
def test_mcore_model_has_the_pattern(pool2, freq):
    pytest.importorskip("megatron.core")
    result = pool2.run(mcore_layers_worker, freq=freq)[0]
    pattern = GPTConfig(**LLAMA_MOE, moe_layer_freq=freq).moe_layer_pattern
    assert result["pattern"] == pattern
    assert result["reader_layers"] == sum(pattern)  # load_balancing_loss: mean over the MoE layers


@pytest.mark.parametrize("freq", [2, [0, 1]], ids=str)
def test_mixed_pattern_computes_what_megatron_core_computes(pool2, freq):
    """Two layers (the parity worker's size), one dense and one MoE."""
    pytest.importorskip("megatron.core")
    from test_models_layernorm1p import parity_worker

    cfg = {k: v for k, v in LLAMA_MOE.items() if k not in ("num_layers", "hidden_size", "num_attention_heads",
                                                          "seq_length", "vocab_size")}
    result = pool2.run(parity_worker, cfg_kwargs=dict(cfg, moe_layer_freq=freq, moe_aux_loss_coeff=0.01))[0]
    assert result["missing"] == [] and result["unexpected"] == [], result
    assert result["logit_diff"] < 1e-5 and result["grad_diff"] < 1e-6, result


# -- the launcher ----------------------------------------------------------------------------
BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --swiglu --disable-bias-linear --num-experts 4").split()


def test_launcher_passes_the_pattern_to_the_model():
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    for text, pattern in (("2", [1, 0, 1, 0]), ("([0]+[1]*3)", [0, 1, 1, 1]), ("[1,0]*2", [1, 0, 1, 0])):
        cfg = gpt_config_from_args(parse_args(BASE + ["--moe-layer-freq", text], world_size=1))
        assert cfg.moe_layer_pattern == pattern
    # Dense models: Megatron-LM never reads the flag.
    dense = BASE[:-2]  # without --num-experts 4
    assert parse_args(dense + ["--moe-layer-freq", "[1]*3"], world_size=1).num_experts is None


@pytest.mark.parametrize("text, message", [
    ("0", "--moe-layer-freq 0 must be a positive integer N"),
    ("-2", "--moe-layer-freq -2 must be a positive integer N"),
    ("[1]*3", "has 3 entries for --num-layers=4; give one 0/1 per layer"),
    ("[0,2,1,1]", "must hold only 0 (dense) and 1 (MoE)"),
    ("[1] * 4", "not allowed"),
    ("every2", "is neither an integer nor a list expression"),
])
def test_launcher_refuses_invalid_values(text, message):
    with pytest.raises(ArgumentError) as info:
        parse_args(BASE + ["--moe-layer-freq", text], world_size=1)
    assert message in str(info.value)
