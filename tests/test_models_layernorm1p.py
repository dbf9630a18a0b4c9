"""Megatron-LM's ``--apply-layernorm-1p`` (megatron-core's ``layernorm_zero_centered_gamma``):
every norm stores w, starting at 0, and scales by 1 + w.

* the embedded GPT computes what megatron-core's GPTModel computes with the same
  weights -- logits and gradients, with the norm weights and biases moved away from
  their zero start so that the "1 +" is exercised -- for LayerNorm, RMSNorm with
  q/k norms, and MoE;
* megatron-core's model starts its norm weights at zero and keeps its usual
  state-dict keys (a 1p checkpoint has the keys of a plain one);
* the launcher builds both models with the flag, gives the norm weights no weight
  decay (Megatron-LM's 1-D rule), and refuses only what Megatron-LM cannot build.

megatron-core's CUDA calls on this CPU machine are bridged by tests/mcore_cpu_shim.py.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from mcore_parity import LLAMA, SEQ, SMALL, VOCAB, mcore_device, ours_and_tokens
from megatron_fsdp.models import GPT, GPTConfig, gpt_loss
from megatron_fsdp.models.layers import ZeroCenteredNorm

CONFIGS = {
    "gpt_layernorm": dict(apply_layernorm_1p=True),
    "llama_rmsnorm_qk_norm": dict(LLAMA, apply_layernorm_1p=True, qk_layernorm=True),
    # megatron-core's experts cannot take a GELU MLP with biases (an in-place bias add on a view): swiglu.
    "moe_layernorm_qk_norm": dict(LLAMA, normalization="LayerNorm", apply_layernorm_1p=True, qk_layernorm=True,
                                  num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01),
}


def _norm_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.ndim == 1 and ("ln" in n or "layernorm" in n)}


# -- the embedded GPT ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_embedded_norm_is_zero_centred(kind):
    model = GPT(GPTConfig(**SMALL, normalization=kind, apply_layernorm_1p=True, qk_layernorm=True))
    norms = [m for m in model.modules() if isinstance(m, ZeroCenteredNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # ln_1, ln_2, q/k norms per block, final norm
    for norm in norms:
        assert torch.count_nonzero(norm.weight) == 0  # stored w starts at 0: scale 1
        assert norm.bias is None if kind == "RMSNorm" else torch.count_nonzero(norm.bias) == 0
    norm = model.blocks[0].ln_1
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3)
    x = torch.randn(3, 5, 32)
    if kind == "LayerNorm":
        expected = F.layer_norm(x, (32,), 1 + norm.weight, norm.bias, 1e-5)
    else:
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


# -- against megatron-core -----------------------------------------------------------------
def parity_worker(rank, world, *, cfg_kwargs, randomize_norms=True):
    """Our GPT and megatron-core's GPTModel with the same weights: (missing, unexpected)
    keys of the mapped state dict, logits and gradient differences, and megatron-core's
    own norms at initialisation."""
    from megatron_fsdp.models.mcore import ZeroCenteredMcoreNorm, build_mcore_gpt, to_mcore_state_dict
    from test_models_mcore import _mcore_on_cpu

    cfg = GPTConfig(**SMALL, **cfg_kwargs)
    device = mcore_device()
    ours, inputs, targets, positions = ours_and_tokens(cfg, seq=SEQ, vocab=VOCAB, device=device)
    if randomize_norms:  # move w away from 0 so that the "1 +" matters
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in _norm_params(ours).values():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True).to(device)
        own_norms = {n: (type(m).__name__, m.weight.detach().abs().max().item())
                     for n, m in theirs.named_modules() if isinstance(m, ZeroCenteredMcoreNorm)}
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        theirs.eval(), ours.eval()
        with torch.no_grad():
            logit_diff = (ours(inputs) - theirs(inputs, positions, None)).abs().max().item()
        theirs.train(), ours.train()
        gpt_loss(ours(inputs), targets).backward()
        theirs(inputs, positions, None, labels=targets).mean().backward()
    our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    grad_diff = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters())
    norm_grad_diff = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters()
                         if "layernorm" in n)
    return dict(missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                logit_diff=logit_diff, grad_diff=grad_diff, norm_grad_diff=norm_grad_diff, own_norms=own_norms,
                keys=sorted(k for k in theirs.state_dict() if not k.endswith("_extra_state")))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_embedded_gpt_with_layernorm_1p_computes_what_megatron_core_computes(pool2, name):
    pytest.importorskip("megatron.core")
    result = pool2.run(parity_worker, cfg_kwargs=CONFIGS[name])[0]
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight maps one to one
    assert result["logit_diff"] < 1e-5 and result["grad_diff"] < 1e-6, result
    assert result["norm_grad_diff"] < 1e-6, result
    # megatron-core's norms are zero-centred and start at 0, the final norm and the q/k norms included.
    norms = result["own_norms"]
    expected = 2 * 2 + 1 + (2 * 2 if CONFIGS[name].get("qk_layernorm") else 0)
    assert len(norms) == expected and all(w == 0.0 for _, w in norms.values()), norms
    assert "decoder.final_layernorm" in norms


def test_layernorm_1p_keeps_megatron_cores_state_dict_keys(pool2):
    """A zero-centred model's checkpoint keys are the plain model's (megatron-core stores
    the centred weight under the same name)."""
    pytest.importorskip("megatron.core")
    cfg = dict(LLAMA, qk_layernorm=True)
    one_p = pool2.run(parity_worker, cfg_kwargs=dict(cfg, apply_layernorm_1p=True))[0]
    plain = pool2.run(parity_worker, cfg_kwargs=cfg, randomize_norms=False)[0]
    assert plain["own_norms"] == {}  # megatron-core's own torch norms without the flag
    assert one_p["keys"] == plain["keys"]
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in one_p["keys"]
    assert "decoder.final_layernorm.weight" in one_p["keys"]


# -- the launcher --------------------------------------------------------------------------
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --apply-layernorm-1p").split()


def test_launcher_builds_zero_centred_norms_without_weight_decay():
    """Megatron-LM's optimizer groups: 1-D parameters (the centred norm weights among
    them) take no weight decay; the q/k norms do with --apply-wd-to-qk-layernorm."""
    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.model_setup import build_optimizer, gpt_config_from_args

    for qk_decay in (False, True):
        args = parse_args(BASE + ["--qk-layernorm", "--weight-decay", "0.1"]
                          + (["--apply-wd-to-qk-layernorm"] if qk_decay else []), world_size=1)
        cfg = gpt_config_from_args(args)
        assert cfg.apply_layernorm_1p
        model = GPT(cfg)
        optimizer = build_optimizer(model, args)
        decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
        for name, param in _norm_params(model).items():
            qk = "q_layernorm" in name or "k_layernorm" in name
            assert decay_of[id(param)] == (0.1 if qk and qk_decay else 0.0), name  # q/k biases too, as Megatron-LM


def test_launcher_accepts_layernorm_1p_with_mcore_models_as_megatron_lm(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 1)
    mcore = BASE + ["--use-mcore-models", "--distributed-backend", "nccl"]
    for extra in ([], ["--normalization", "RMSNorm"], ["--transformer-impl", "local"]):
        args = parse_args(mcore + extra, world_size=1)
        assert args.flag_warnings == [] or all("transformer-impl" in w for w in args.flag_warnings)
        assert gpt_config_from_args(args).apply_layernorm_1p
    # Megatron-LM's local spec builds RMSNorm from torch, which asserts the setting off.
    with pytest.raises(ArgumentError) as info:
        parse_args(mcore + ["--normalization", "RMSNorm", "--transformer-impl", "local"], world_size=1)
    assert "use --transformer-impl transformer_engine" in str(info.value)


def test_zero_centred_mcore_norm_takes_megatron_cores_constructor_arguments():
    pytest.importorskip("megatron.core")
    from megatron_fsdp.models.mcore import ZeroCenteredMcoreNorm

    config = argparse.Namespace(normalization="RMSNorm")
    norm = ZeroCenteredMcoreNorm(config=config, hidden_size=8, eps=1e-6)
    assert norm.bias is None and norm.eps == 1e-6 and torch.count_nonzero(norm.weight) == 0
    norm = ZeroCenteredMcoreNorm(config, 8, 1e-5, normalization="LayerNorm")
    assert norm.bias is not None
