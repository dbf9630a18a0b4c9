"""Megatron-LM's output gates: ``--moe-shared-expert-gate`` (the shared expert's output
scaled per token by sigmoid(x . w)) and ``--attention-output-gate`` (each head's
attention output scaled channel-wise by sigmoid of a gate the QKV projection also
yields, in fp32).

* the embedded GPT computes what megatron-core 0.16.1's GPTModel computes with the same
  weights -- logits and gradients -- with the gate weights enlarged so that the gates
  vary from token to token (at N(0, 0.02) every gate sits near 0.5), and the test shown
  to tell the gated function from a constant 0.5 gate;
* a model built on the meta device and materialised gets the eager model's weights;
* the launcher maps both flags onto both models, decays the gate weights (2-D, as
  Megatron-LM's optimizer groups) and refuses or warns where Megatron-LM would.

megatron-core's CUDA calls on this CPU machine are bridged by tests/mcore_cpu_shim.py.
"""

from __future__ import annotations

import pytest
import torch

from mcore_parity import LLAMA, SEQ, SMALL, VOCAB, mcore_device, ours_and_tokens
from megatron_fsdp.models import GPT, GPTConfig, gpt_loss

CONFIGS = {
    # Both gates, grouped-query attention (megatron-core interleaves the gate rows per group).
    "llama_moe_both_gates": dict(LLAMA, qk_layernorm=True, attention_output_gate=True, num_moe_experts=4,
                                 moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=24,
                                 moe_shared_expert_gate=True),
    # GPT-style: the gate rows of the QKV projection carry a bias.
    "gpt_attention_gate_bias_gqa": dict(num_query_groups=2, attention_output_gate=True),
}


def _gate_tensors(model: GPT) -> list[torch.Tensor]:
    """The gate parameters of our GPT: shared-expert gate weights and the QKV rows (and bias
    entries) that make the attention gate."""
    tensors = []
    for block in model.blocks:
        gate = getattr(getattr(block.mlp, "shared_experts", None), "gate", None)
        if gate is not None:
            tensors.append(gate.weight)
        attn = block.attn
        if attn.gate_size:
            tensors += [p[-attn.gate_size:] for p in (attn.qkv.weight, attn.qkv.bias) if p is not None]
    return tensors


def parity_worker(rank, world, *, name):
    """Our GPT and megatron-core's with the same weights: key mapping, logits and gradient
    differences, and how far our logits move when every gate is made a constant 0.5."""
    from megatron_fsdp.models.mcore import build_mcore_gpt, to_mcore_state_dict
    from test_models_mcore import _mcore_on_cpu

    cfg = GPTConfig(**SMALL, **CONFIGS[name])
    device = mcore_device()
    ours, inputs, targets, positions = ours_and_tokens(cfg, seq=SEQ, vocab=VOCAB, device=device)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in _gate_tensors(ours):  # gates spread over (0, 1) instead of ~0.5
            t.copy_(torch.randn(t.shape, generator=g))
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True).to(device)
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        theirs.eval(), ours.eval()
        with torch.no_grad():
            reference = theirs(inputs, positions, None)
            logit_diff = (ours(inputs) - reference).abs().max().item()
            saved = [t.clone() for t in _gate_tensors(ours)]
            for t in _gate_tensors(ours):
                t.zero_()
            constant_gate_diff = (ours(inputs) - reference).abs().max().item()
            for t, s in zip(_gate_tensors(ours), saved):
                t.copy_(s)
        theirs.train(), ours.train()
        gpt_loss(ours(inputs), targets).backward()
        theirs(inputs, positions, None, labels=targets).mean().backward()
    our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    grad_diff = {n: (our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters()}
    return dict(missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                logit_diff=logit_diff, constant_gate_diff=constant_gate_diff, grad_diff=max(grad_diff.values()),
                gate_grad_diff=max((d for n, d in grad_diff.items() if "gate_weight" in n), default=None),
                gate_grad=sum(p.grad.abs().sum().item() for n, p in theirs.named_parameters() if "gate_weight" in n),
                qkv_rows=theirs.decoder.layers[0].self_attention.linear_qkv.weight.shape[0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gated_gpt_computes_what_megatron_core_computes(pool2, name):
    pytest.importorskip("megatron.core")
    result = pool2.run(parity_worker, name=name)[0]
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight maps one to one
    assert result["logit_diff"] < 1e-5 and result["grad_diff"] < 1e-6, result
    assert result["constant_gate_diff"] > 1e-2, result  # the tolerance tells the gates from a constant 0.5
    assert result["qkv_rows"] == 4 * 8 + 2 * 2 * 8 + 4 * 8  # q, k, v and a gate per query channel
    if CONFIGS[name].get("moe_shared_expert_gate"):
        assert result["gate_grad"] > 0 and result["gate_grad_diff"] < 1e-6, result
    else:
        assert result["gate_grad_diff"] is None  # no shared-expert gate built


def test_bf16_attention_gate_is_megatron_cores_bit_for_bit():
    """sigmoid and product in fp32, rounded once to bf16: megatron-core's ``_apply_output_gate``
    (called without its torch.compile wrapper), not the all-bf16 product."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.attention import Attention

    from megatron_fsdp.models.transformer import apply_output_gate

    theirs = Attention._apply_output_gate._torchdynamo_orig_callable
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 5, 4 * 8, generator=g).bfloat16()  # (b, t, h*d)
    gate = (3 * torch.randn(3, 5, 4 * 8, generator=g)).bfloat16()
    ours = apply_output_gate(y, gate)
    # megatron-core's shapes: x (t, b, h*d), gate (t, b, h, d).
    megatron = theirs(None, y.transpose(0, 1), gate.transpose(0, 1).reshape(5, 3, 4, 8)).transpose(0, 1)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, megatron)
    assert not torch.equal(ours, y * torch.sigmoid(gate))


def test_gated_model_built_on_the_meta_device_gets_the_eager_weights():
    """Each gate initialises itself in ``reset_parameters``, in construction order."""
    from megatron_fsdp.training.model_setup import _materialize

    cfg = GPTConfig(**SMALL, **CONFIGS["llama_moe_both_gates"])
    torch.manual_seed(0)
    eager = GPT(cfg)
    with torch.device("meta"):
        meta = GPT(cfg)
    torch.manual_seed(0)
    materialised = _materialize(meta, torch.device("cpu"))
    for (name, a), (_, b) in zip(eager.state_dict().items(), materialised.state_dict().items()):
        assert torch.equal(a, b), name
    gate = eager.blocks[0].mlp.shared_experts.gate.weight
    assert gate.shape == (1, 32) and 0.01 < gate.std().item() < 0.04  # N(0, init_method_std)


# -- the launcher --------------------------------------------------------------------------
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 2 --swiglu --disable-bias-linear --num-experts 4 "
        "--moe-shared-expert-intermediate-size 24").split()
GATES = ["--moe-shared-expert-gate", "--attention-output-gate"]


def test_launcher_builds_gates_with_weight_decay():
    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.model_setup import build_optimizer, gpt_config_from_args

    args = parse_args(BASE + GATES + ["--weight-decay", "0.1"], world_size=1)
    assert args.flag_warnings == []
    cfg = gpt_config_from_args(args)
    assert cfg.moe_shared_expert_gate and cfg.attention_output_gate
    model = GPT(cfg)
    decay_of = {id(p): g["weight_decay"] for g in build_optimizer(model, args).param_groups for p in g["params"]}
    gates = [p for n, p in model.named_parameters() if "shared_experts.gate" in n]
    assert len(gates) == 2 and all(decay_of[id(p)] == 0.1 for p in gates)  # 2-D: decayed, as Megatron-LM


def test_launcher_maps_gates_to_megatron_core_and_refuses_mla(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models.mcore import _transformer_config, mcore_args
    from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: 1)
    args = parse_args(BASE + GATES + ["--use-mcore-models", "--distributed-backend", "nccl"], world_size=1)
    cfg = gpt_config_from_args(args)
    config = _transformer_config(cfg, mcore_args(cfg))
    assert config.moe_shared_expert_gate and config.attention_output_gate
    # Megatron-LM ignores the shared-expert gate without a shared expert: a warning here.
    args = parse_args(BASE[:-2] + ["--moe-shared-expert-gate"], world_size=1)
    assert any("--moe-shared-expert-gate has no effect" in w for w in args.flag_warnings)
    assert not GPT(gpt_config_from_args(args)).blocks[0].mlp.__dict__.get("shared_experts")
    with pytest.raises(ArgumentError, match="--attention-output-gate with --multi-latent-attention"):
        parse_args(BASE + ["--attention-output-gate", "--multi-latent-attention"], world_size=1)
    with pytest.raises(ValueError, match="attention_output_gate=True with multi_latent_attention"):
        GPTConfig(**SMALL, attention_output_gate=True, multi_latent_attention=True)
