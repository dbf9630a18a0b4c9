"""Multi-token prediction (``--mtp-num-layers``): the embedded GPT computes what
megatron-core 0.16.1's GPTModel with its ``MultiTokenPredictionBlock`` (local spec)
computes for the same weights -- main logits and LM loss, each depth's MTP loss, and
every gradient (the MTP loss's included) -- dense and MoE, one and two depths, tied and
untied output layers, RoPE and learned positions, recomputation and per-token mode.

megatron-core's CUDA calls are bridged on CPU by ``mcore_cpu_shim.cpu_shim`` (tests only).
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from mcore_parity import mcore_device, ours_and_tokens  # noqa: E402
from megatron_fsdp.models import GPTConfig, gpt_loss  # noqa: E402
from mcore_parity import LLAMA, SEQ, SMALL, VOCAB  # noqa: E402
from test_models_mcore import _mcore_on_cpu  # noqa: E402

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05)
CONFIGS = {
    # GPT-2 shaped: learned positions (rolled with the tokens), tied output layer, biases.
    "gpt_1": dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
    "llama_2": dict(LLAMA, mtp_num_layers=2, mtp_loss_scaling_factor=0.3),
    # The last decoder layer is MoE, so the MTP layers are; the first is dense.
    "moe_2_dense_first": dict(LLAMA, **MOE, moe_layer_freq=[0, 1], mtp_num_layers=2, mtp_loss_scaling_factor=0.5),
    # The last decoder layer is dense, so the MTP layer is too.
    "moe_1_dense_last_recompute": dict(LLAMA, **MOE, moe_layer_freq=[1, 0], mtp_num_layers=1,
                                       recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1),
    # --calculate-per-token-loss: megatron-core 0.16.1 with McoreMTPLoss's correction.
    "llama_1_per_token": dict(LLAMA, qk_layernorm=True, apply_layernorm_1p=True, normalization="LayerNorm",
                              mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
}


@contextlib.contextmanager
def _mtp_on_cpu():
    """The CPU bridge, with megatron-core's process-wide MTP state (loss tracker, backward
    scale) reset before and after: a pooled worker builds many models."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    try:
        with _mcore_on_cpu():
            yield
    finally:
        MTPLossLoggingHelper.tracker.clear()
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def mtp_compare_worker(rank, world, *, name, per_token=False):
    from megatron_fsdp.models.mcore import balancing_loss_reader, build_mcore_gpt, mtp_loss_reader, \
        to_mcore_state_dict

    cfg = GPTConfig(**{**SMALL, **CONFIGS[name]})
    device = mcore_device()
    ours, inputs, targets, positions = ours_and_tokens(cfg, seq=SEQ, vocab=VOCAB, device=device)
    ours.set_mtp_loss_settings(per_token=per_token)
    reduce = (lambda x: x.sum()) if per_token else (lambda x: x.mean())
    with _mtp_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True, calculate_per_token_loss=per_token)
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        mtp_reader = mtp_loss_reader(cfg, sequence_length=SEQ, per_token=per_token)
        mtp_reader.set_mtp_loss_settings(backward_scale=1.0, per_token=per_token)
        balancing = balancing_loss_reader(cfg)
        if balancing is not None:
            balancing.clear()
        logits = ours(inputs, labels=targets)
        lm_ours = gpt_loss(logits, targets) * (targets.numel() if per_token else 1)
        lm_ours.backward()
        lm_theirs = reduce(theirs(inputs, positions, None, labels=targets))  # per-token losses (b, t)
        lm_theirs.backward()
        mtp_theirs = mtp_reader.mtp_losses()
        balancing_pair = None if balancing is None else (ours.moe_load_balancing_loss().item(), balancing().item())
    our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    grad_diff = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters())
    # The MTP part of the gradient must be large against the tolerance, or the comparison says nothing.
    mtp_grad = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    (gpt_loss(ours(inputs), targets) * (targets.numel() if per_token else 1)).backward()  # no labels: no MTP
    mtp_part = max((mtp_grad[n] - p.grad).abs().max().item() for n, p in ours.named_parameters()
                   if not n.startswith("mtp."))  # in the decoder and the shared embedding / output layer
    return dict(missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                lm_diff=abs(lm_ours.item() - lm_theirs.item()), grad_diff=grad_diff, mtp_part=mtp_part,
                mtp_ours=ours.mtp_losses().tolist(), mtp_theirs=mtp_theirs.tolist(), balancing=balancing_pair,
                mtp_params=sum(1 for n, _ in theirs.named_parameters() if n.startswith("mtp.")))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_embedded_mtp_computes_what_megatron_core_computes(pool2, name):
    per_token = name.endswith("per_token")
    result = pool2.run(mtp_compare_worker, name=name, per_token=per_token)[0]
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight maps one to one
    assert result["mtp_params"] > 0
    assert result["lm_diff"] < 1e-5 * (SEQ * 2 if per_token else 1), result  # the LM loss stays the main one
    assert len(result["mtp_ours"]) == CONFIGS[name]["mtp_num_layers"]
    assert max(abs(a - b) for a, b in zip(result["mtp_ours"], result["mtp_theirs"])) < 1e-5, result
    assert result["grad_diff"] < 1e-5 and result["mtp_part"] > 1e-3, result
    if result["balancing"] is not None:  # MTP MoE layers counted in the logged average, as Megatron-LM
        ours, theirs = result["balancing"]
        assert abs(ours - theirs) < 1e-6, result


def test_mtp_config_and_megatron_core_refusals():
    with pytest.raises(ValueError, match="mtp_num_layers=0 must be a positive integer"):
        GPTConfig(**SMALL, mtp_num_layers=0)
    with pytest.raises(ValueError, match="recompute_num_layers=1"):
        GPTConfig(**SMALL, mtp_num_layers=1, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=2)
    from megatron_fsdp.models.mcore_specs import megatron_core_rescales_per_token_mtp, per_token_rolled_count_problem

    if not megatron_core_rescales_per_token_mtp():  # megatron-core 0.16.1
        assert "--mtp-num-layers 2" in per_token_rolled_count_problem(2, True)
    assert per_token_rolled_count_problem(1, True) is None and per_token_rolled_count_problem(2, False) is None
