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
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
import torch

from mcore_parity import mcore_device, ours_and_tokens
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
    """The CPU bridge, with megatron-core's class-level aux-loss gradient scale reset to its
    default 1 (a launcher run earlier in the process sets it to 1 / micro batches; see
    test_models_mcore.py's twin) and its layer-wise loss tracker emptied."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from mcore_cpu_shim import cpu_shim

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    te_present = importlib.util.find_spec("transformer_engine") is not None
    with cpu_shim(), mock.patch.object(moe_utils, "te_general_gemm", None, create=True), \
            mock.patch.object(multi_latent_attention, "HAVE_TE", te_present):
        yield


def mla_compare_worker(rank, world, *, name):
    from megatron_fsdp.models.mcore import build_mcore_gpt, to_mcore_state_dict

    cfg = GPTConfig(**{**SMALL, **CONFIGS[name]})
    device = mcore_device()
    ours, inputs, targets, positions = ours_and_tokens(cfg, seq=SEQ, vocab=VOCAB, device=device)
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


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="block",
                                            recompute_num_layers=1)], ids=["selective", "full_block"])
def test_mla_recomputation_changes_no_number(recompute):
    cfg = GPTConfig(**{**SMALL, **CONFIGS["q_lora_yarn"]})
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    grads = []
    for c in (cfg, GPTConfig(**{**SMALL, **CONFIGS["q_lora_yarn"], **recompute})):
        torch.manual_seed(0)
        model = GPT(c)
        gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# -- the launcher ------------------------------------------------------------------------------
# Megatron-LM's DeepSeek proxy recipe (tests/functional_tests/.../deepseek_proxy_fsdp_ep2_fsdp2), scaled
# down: 8 -> 2 layers (first dense, then MoE), 512 -> 64 hidden, 8 -> 4 experts; MLA ranks and head widths
# shrunk alike. Left out: EP, FP8, TransformerEngine, the sigmoid / grouped router (not MLA's business).
DEEPSEEK_PROXY = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
    --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000
    --make-vocab-size-divisible-by 64 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0
    --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --disable-bias-linear --no-rope-fusion
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-fraction .1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.02 --micro-batch-size 2 --global-batch-size 8 --train-iters 12
    --num-experts 4 --moe-layer-freq ([0]*1+[1]*1) --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
    --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-router-pre-softmax
    --moe-aux-loss-coeff 1e-4 --moe-router-topk-scaling-factor 2.0 --moe-router-dtype fp32
    --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --rotary-scaling-factor 1.0 --mscale 1.0 --mscale-all-dim 1.0
    --log-interval 4 --eval-interval 6 --eval-iters 1 --plot-path none --split 949,50,1
"""
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"


def _launch(pool, flags: str, log: Path) -> str:
    """A 2-rank launcher run in the shared gloo pool: rank 0's log lines."""
    from launcher_inprocess import launch_task

    return "\n".join(pool.run(launch_task, flags=f"{flags} --log-json {log}")[0])


def test_deepseek_proxy_command_trains_on_cpu_fsdp_equals_ddp(pool2, tmp_path):
    fsdp, ddp = tmp_path / "fsdp.json", tmp_path / "ddp.json"
    stdout = _launch(pool2, f"{DEEPSEEK_PROXY} {FSDP}", fsdp)
    _launch(pool2, DEEPSEEK_PROXY, ddp)
    assert "Megatron-FSDP (optim_grads_params)" in stdout
    # Said (rank 0 logs the parser's warnings at start-up), not silently dropped.
    assert any("--kv-channels 16: no effect with --multi-latent-attention" in w
               for w in _proxy_args(FSDP).flag_warnings)
    a, b = json.loads(fsdp.read_text()), json.loads(ddp.read_text())
    assert a["iterations"] == b["iterations"] == list(range(1, 13))
    for it, x, y in zip(a["iterations"], a["lm_loss"], b["lm_loss"]):
        assert abs(x - y) <= 1e-5, f"iteration {it}: Megatron-FSDP {x} vs DDP {y}"
    assert sum(a["lm_loss"][-3:]) / 3 < sum(a["lm_loss"][:3]) / 3 - 0.5, a["lm_loss"]


def _proxy_args(extra: str = "", drop: tuple[str, ...] = ()):
    from megatron_fsdp.training.args.arguments import parse_args

    tokens = shlex.split(DEEPSEEK_PROXY + " " + extra)
    for flag in drop:
        i = tokens.index(flag)
        del tokens[i:i + (1 if tokens[i + 1].startswith("--") else 2)]
    return parse_args(tokens, world_size=2)


def test_launcher_maps_the_mla_flags_onto_the_model():
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    cfg = gpt_config_from_args(_proxy_args())
    assert cfg.multi_latent_attention and cfg.rope_type is RopeType.YARN  # --rope-type left out: MLA's default
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
        (32, 16, 16, 8, 16)
    assert (cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim, cfg.qk_layernorm) == (1.0, 1.0, 1.0, True)
    # megatron-core's YaRN constants: Megatron-LM's --yarn-* flags never reach MLA
    assert (cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow) == (4096, 32.0, 1.0)
    assert gpt_config_from_args(_proxy_args(drop=("--q-lora-rank",))).q_lora_rank is None
    assert gpt_config_from_args(_proxy_args("--rope-type rope")).rope_type is RopeType.ROPE


def test_launcher_warns_where_a_flag_has_no_effect():
    args = _proxy_args("--rope-type yarn --rotary-percent 0.5 --yarn-beta-fast 16")
    warnings = "\n".join(args.flag_warnings)
    assert "--rotary-percent 0.5: no effect with MLA's YaRN" in warnings
    assert "--yarn-beta-fast 16.0: accepted, no effect here" in warnings and "keeps megatron-core's 32" in warnings
    args = _proxy_args("--rope-type rope --mscale 2", drop=("--no-rope-fusion",))
    warnings = "\n".join(args.flag_warnings)
    assert "--mscale 2.0: no effect with --rope-type rope" in warnings
    assert "Megatron-LM refuses this" in warnings and "Add --no-rope-fusion" in warnings
    args = _proxy_args(drop=("--multi-latent-attention",))
    assert "--q-lora-rank: no effect without --multi-latent-attention" in "\n".join(args.flag_warnings)


@pytest.mark.parametrize("extra, drop, match", [
    ("--group-query-attention --num-query-groups 2", (), "--group-query-attention with --multi-latent-attention"),
    ("--rope-type yarn", ("--multi-latent-attention",), "--rope-type yarn without --multi-latent-attention"),
    ("--qk-pos-emb-head-dim 6 --rope-type rope --rotary-percent 0.5", (), "gives 3 rotary channels"),
    ("--q-lora-rank 0", (), "--q-lora-rank=0 must be a positive integer"),
    ("--rotary-scaling-factor 40 --mscale-all-dim -20", (), "--mscale-all-dim=-20.0 with --rotary-scaling-factor"),
    ("--cache-mla-latents", (), "megatron-core refuses it in training"),
])
def test_launcher_refuses_what_mla_cannot_honour(extra, drop, match):
    from megatron_fsdp.training.args.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=re.escape(match)):
        _proxy_args(extra, drop)


def test_mcore_mla_needs_transformer_engine():
    from megatron_fsdp.training.args import mla_flags
    from megatron_fsdp.training.args.arguments import ArgumentError

    if mla_flags.transformer_engine_installed():
        pytest.skip("TransformerEngine is installed")
    from megatron_fsdp.comm import device as device_mod

    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: 2), \
            pytest.raises(ArgumentError, match="needs TransformerEngine installed"):
        _proxy_args("--use-mcore-models --distributed-backend nccl")


def launcher_mcore_mla_keys_worker(rank, world, *, directory):
    """The launcher's --use-mcore-models --multi-latent-attention --save: megatron-core's own keys."""
    from test_models_mcore import launcher_saved_and_own_keys

    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.training.args import mla_flags

    # Validation refuses --use-mcore-models without CUDA (and MLA without TransformerEngine): the shim bridges both.
    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world), \
            mock.patch.object(mla_flags, "transformer_engine_installed", lambda: True):
        args = _proxy_args(f"--use-mcore-models --distributed-backend nccl --train-iters 1 {FSDP}")
    _, saved, own = launcher_saved_and_own_keys(args, directory, _mcore_on_cpu)
    return dict(saved=saved, own=sorted(own.state_dict()), attention=type(own.decoder.layers[0].self_attention).__name__)


def test_launcher_builds_megatron_core_mla_and_saves_its_keys(pool2, tmp_path):
    pytest.importorskip("megatron.core")
    result = pool2.run(launcher_mcore_mla_keys_worker, directory=str(tmp_path))[0]
    assert result["attention"] == "MLASelfAttention"
    assert result["saved"] == result["own"]
    weights = set(result["saved"])
    for name in ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
                 "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight", "linear_proj.weight"):
        assert f"decoder.layers.1.self_attention.{name}" in weights, name
