"""Multi-latent attention (``--multi-latent-attention``): the embedded GPT computes what
megatron-core 0.16.1's GPTModel with ``MLASelfAttention`` (local spec) computes for the
same weights -- logits and every gradient, with and without query compression, with
rope and YaRN -- its YaRN frequencies are megatron-core's, configurations megatron-core
or Megatron-LM refuse are refused here with the reason, and the launcher trains a
DeepSeek-proxy-shaped command on 2 CPU ranks.

megatron-core's CUDA calls are bridged by ``mcore_cpu_shim.cpu_shim`` (tests only). Without
TransformerEngine megatron-core 0.16.1's ``multi_latent_attention`` module also believes
TE is present ([Note: MLA without TransformerEngine] in models/mcore_mla.py); the workers
set its ``HAVE_TE`` to False for the duration, what it means there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from megatron_fsdp.models import GPT, GPTConfig, RopeType, gpt_loss
from megatron_fsdp.models.mla import mla_softmax_scale
from megatron_fsdp.models.yarn import concentration, yarn_angles

REPO = Path(__file__).resolve().parents[1]
SEQ, VOCAB = 16, 64
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
             multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6,
             normalization="RMSNorm", qk_layernorm=True, swiglu=True, ffn_hidden_size=40, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, position_embedding_type="rope")
# YaRN stretched 4x over an original context of 64 positions: with 8 rotary channels the
# blend between kept and interpolated frequencies covers pairs 0..2, so all three kinds occur.
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7,
            original_max_position_embeddings=64)
CONFIGS = {
    "q_lora_rope": dict(q_lora_rank=10, rope_type="rope"),
    "no_q_lora_rope": dict(rope_type="rope"),
    "q_lora_yarn": dict(q_lora_rank=10, **YARN),
    "no_q_lora_yarn_betas": dict(YARN, beta_fast=8.0, beta_slow=0.5, rotary_base=500),
    # rope with part of the rotary channels turned, and a scaling factor that only moves the softmax scale
    "rope_partial_softmax_mscale": dict(q_lora_rank=10, rope_type="rope", rotary_percent=0.5,
                                        rotary_scaling_factor=40.0, mscale_all_dim=1.0),
    # GPT-2 shaped rest: LayerNorm, biases, learned positions (added besides MLA's own rotary part)
    "layernorm_bias_learned_pos_no_qk_norm": dict(q_lora_rank=10, normalization="LayerNorm", qk_layernorm=False,
                                                  add_bias_linear=True, swiglu=False, ffn_hidden_size=None,
                                                  position_embedding_type="learned_absolute", **YARN),
    "moe": dict(q_lora_rank=10, rope_type="rope", num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01),
}


@contextlib.contextmanager
def _mcore_on_cpu():
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from mcore_cpu_shim import cpu_shim

    te_present = importlib.util.find_spec("transformer_engine") is not None
    with cpu_shim(), mock.patch.object(moe_utils, "te_general_gemm", None, create=True), \
            mock.patch.object(multi_latent_attention, "HAVE_TE", te_present):
        yield


def mla_compare_worker(rank, world, *, name):
    from megatron_fsdp.models.mcore import build_mcore_gpt, to_mcore_state_dict

    cfg = GPTConfig(**{**SMALL, **CONFIGS[name]})
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    ours = GPT(cfg).to(device)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand_as(inputs)
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True).to(device)
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        attention = theirs.decoder.layers[0].self_attention
        their_scale = attention.core_attention.softmax_scale
        theirs.eval(), ours.eval()
        with torch.no_grad():
            logit_diff = (ours(inputs) - theirs(inputs, positions, None)).abs().max().item()
        theirs.train(), ours.train()
        gpt_loss(ours(inputs), targets).backward()
        theirs(inputs, positions, None, labels=targets).mean().backward()  # per-token losses (b, t)
    our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    grad_diff = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters())
    grad_max = max(p.grad.abs().max().item() for n, p in theirs.named_parameters() if "self_attention" in n)
    return dict(missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                logit_diff=logit_diff, grad_diff=grad_diff, attention_grad_max=grad_max,
                scales=(mla_softmax_scale(cfg), their_scale), attention=type(attention).__name__,
                names=sorted(n for n, _ in attention.named_parameters()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mla_gpt_computes_what_megatron_core_computes(pool2, name):
    pytest.importorskip("megatron.core")
    result = pool2.run(mla_compare_worker, name=name)[0]
    assert result["attention"] == "MLASelfAttention"
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight maps one to one
    assert result["logit_diff"] < 1e-5 and result["grad_diff"] < 1e-6, result
    assert result["attention_grad_max"] > 1e-4  # the attention weights take part
    assert result["scales"][0] == pytest.approx(result["scales"][1], rel=1e-12)
    q_names = {"linear_q_down_proj.weight", "linear_q_up_proj.weight"} if CONFIGS[name].get("q_lora_rank") \
        else {"linear_q_proj.weight"}
    assert q_names <= set(result["names"]), result["names"]


# -- YaRN itself against megatron-core's YarnRotaryEmbedding ------------------------------------
@pytest.mark.parametrize("dim, base, factor, original, fast, slow, mscale, all_dim", [
    (8, 10000, 4.0, 64, 32.0, 1.0, 0.9, 0.7),
    (64, 10000, 40.0, 4096, 32.0, 1.0, 1.0, 1.0),  # DeepSeek-V3's YaRN
    (16, 500, 1.0, 4096, 32.0, 1.0, 1.0, 0.0),  # factor 1: plain RoPE
    (6, 10000, 2.0, 8, 3.0, 3.0, 1.0, 0.0),  # a zero-width ramp
])
def test_yarn_angles_and_concentration_are_megatron_cores(dim, base, factor, original, fast, slow, mscale, all_dim):
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    with mock.patch("torch.cuda.current_device", lambda: "cpu"):  # it moves its frequencies to "the GPU"
        theirs = YarnRotaryEmbedding(dim, rotary_base=base, scaling_factor=factor,
                                     original_max_position_embeddings=original, beta_fast=fast, beta_slow=slow,
                                     mscale=mscale, mscale_all_dim=all_dim, use_cpu_initialization=True)
        emb, their_scale = theirs.get_emb(48)
    ours = yarn_angles(48, dim, base, factor, original, fast, slow)
    assert torch.equal(ours, emb[:, 0, 0, :])
    assert concentration(factor, mscale, all_dim) == their_scale
    if factor == 1.0:  # no stretching: RoPE's frequencies exactly
        from megatron_fsdp.models.rope import rope_angles

        assert torch.equal(ours, rope_angles(48, dim, base, torch.device("cpu")))


# -- the config's rules ----------------------------------------------------------------------
def test_mla_config_defaults_and_refusals():
    cfg = GPTConfig(**SMALL)
    assert cfg.rope_type is RopeType.YARN  # megatron-core's default for MLA
    assert cfg.mla_rotary_dim == 8 and mla_softmax_scale(cfg) == 1 / math.sqrt(16)
    assert GPTConfig(**{**SMALL, "rope_type": "rope", "rotary_percent": 0.5}).mla_rotary_dim == 4
    assert GPTConfig(**{**SMALL, "rotary_percent": 0.5}).mla_rotary_dim == 8  # YaRN turns every channel
    with pytest.raises(ValueError, match="num_query_groups=2 with multi_latent_attention"):
        GPTConfig(**SMALL, num_query_groups=2)
    with pytest.raises(ValueError, match="rope_type='yarn' needs multi_latent_attention"):
        GPTConfig(num_layers=1, rope_type="yarn")
    assert GPTConfig(num_layers=1, rope_type="rope").rope_type is RopeType.ROPE  # accepted, no effect without MLA
    with pytest.raises(ValueError, match="even, non-zero"):
        GPTConfig(**{**SMALL, "qk_pos_emb_head_dim": 5})
    with pytest.raises(ValueError, match="q_lora_rank=0 must be a positive integer, or None"):
        GPTConfig(**SMALL, q_lora_rank=0)
    with pytest.raises(ValueError, match="mscale_all_dim=-20"):
        GPTConfig(**SMALL, rotary_scaling_factor=40.0, mscale_all_dim=-20.0)
