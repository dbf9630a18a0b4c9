"""The embedded GPT computes what megatron-core's GPTModel computes for the same
config and weights: logits and gradients (the MoE load-balancing loss included),
for GPT-2/3-style, Llama-style (RoPE, GQA, swiglu, RMSNorm, qk-layernorm, partial
rotary, odd kv_channels) and MoE configurations. And ``build_mcore_gpt`` refuses
what megatron-core cannot run, naming why.

megatron-core's CUDA calls on this CPU machine are bridged by
``mcore_cpu_shim.cpu_shim`` (tests only). megatron-core 0.16.1 also reads an
undefined ``te_general_gemm`` in its MoE router when TransformerEngine is absent;
the workers define it as ``None`` (its own "no TE" value) for the duration.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from mcore_parity import LLAMA, SEQ, SMALL, VOCAB, mcore_device, ours_and_tokens  # noqa: E402
from megatron_fsdp.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from megatron_fsdp.models.mcore import (  # noqa: E402
    balancing_loss_reader, build_mcore_gpt, mcore_unsupported, to_mcore_state_dict,
)

CONFIGS = {
    "gpt": dict(),
    "gpt_exact_gelu_untied": dict(openai_gelu=False, untie_embeddings_and_output_weights=True),
    "llama": dict(LLAMA, rotary_base=500000),
    "llama_qk_norm_partial_rope": dict(LLAMA, qk_layernorm=True, rotary_percent=0.5, kv_channels=12),
    "llama_rotary_interleaved": dict(LLAMA, rotary_interleaved=True),
    "qwen2_qkv_bias": dict(LLAMA, add_bias_linear=False, add_qkv_bias=True),  # Megatron-LM's --add-qkv-bias
    "squared_relu": dict(squared_relu=True, add_bias_linear=False),
    "moe_squared_relu": dict(squared_relu=True, add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
                             moe_aux_loss_coeff=0.01),
    "llama_rotary_interleaved_partial": dict(LLAMA, rotary_interleaved=True, rotary_percent=0.5, kv_channels=12),
    "moe": dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05, qk_layernorm=True),
    "llama_recompute_uniform": dict(LLAMA, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=2),
    "moe_shared_expert_scaled": dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                                     moe_shared_expert_intermediate_size=24, moe_router_topk_scaling_factor=2.5),
    "moe_pre_softmax": dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_router_pre_softmax=True),
    # --moe-router-load-balancing-type: per-sequence Switch loss, and none despite a coefficient.
    "moe_seq_aux": dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
                        moe_router_load_balancing_type="seq_aux_loss"),
    "moe_balancing_none": dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
                               moe_router_load_balancing_type="none"),
    # DeepSeek-V3's router (router-level parity, expert-bias updates and global_aux_loss: test_moe_router.py).
    "moe_deepseek_router": dict(LLAMA, num_moe_experts=8, moe_router_topk=4, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=1e-3,
                                moe_router_load_balancing_type="seq_aux_loss"),
}


@contextlib.contextmanager
def _mcore_on_cpu():
    """The CPU bridge (tests/mcore_cpu_shim.py), with megatron-core's process-wide aux-loss
    tracker emptied before and after: a pooled worker builds many models, and an entry
    one of them left (sized by its layer count, named by its balancing type) must not
    reach the next. Likewise the aux-loss gradient scale (``MoEAuxLossAutoScaler``,
    class-level), which a launcher run in the same worker sets to 1 / micro batches:
    reset to megatron-core's default 1."""
    from megatron.core.transformer.moe import moe_utils

    from mcore_cpu_shim import cpu_shim

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # the same for multi-token prediction's loss
    try:
        with cpu_shim(), mock.patch.object(moe_utils, "te_general_gemm", None, create=True):
            yield
    finally:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def compare_worker(rank, world, *, name):
    cfg = GPTConfig(**SMALL, **CONFIGS[name])
    device = mcore_device()
    ours, inputs, targets, positions = ours_and_tokens(cfg, seq=SEQ, vocab=VOCAB, device=device)
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True)
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        theirs.eval(), ours.eval()
        with torch.no_grad():
            logit_diff = (ours(inputs) - theirs(inputs, positions, None)).abs().max().item()
        theirs.train(), ours.train()
        reader = balancing_loss_reader(cfg)
        if reader is not None:
            reader.clear()
        gpt_loss(ours(inputs), targets).backward()
        theirs(inputs, positions, None, labels=targets).mean().backward()  # per-token losses (b, t)
        balancing = None if reader is None else tuple(None if v is None else v.item()
                                                      for v in (ours.moe_load_balancing_loss(), reader()))
    our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
    grad_diff = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters())
    router_grad = sum(p.grad.abs().sum().item() for n, p in theirs.named_parameters() if "router" in n)
    return dict(missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                logit_diff=logit_diff, grad_diff=grad_diff, router_grad=router_grad,
                aux=None if ours.moe_aux_loss() is None else ours.moe_aux_loss().item(), balancing=balancing)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_embedded_gpt_computes_what_megatron_core_computes(pool2, name):
    result = pool2.run(compare_worker, name=name)[0]
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight maps one to one
    assert result["logit_diff"] < 1e-5 and result["grad_diff"] < 1e-6, result
    if CONFIGS[name].get("num_moe_experts"):
        assert result["router_grad"] > 0
    if CONFIGS[name].get("moe_router_load_balancing_type") == "none":
        assert result["aux"] is None and result["balancing"] == (None, None), result  # nothing logged
    elif CONFIGS[name].get("moe_aux_loss_coeff"):
        # The balancing loss took part: each of the 2 layers contributes >= coeff.
        assert result["aux"] >= 2 * CONFIGS[name]["moe_aux_loss_coeff"] * 0.999, result
        # The launcher's load_balancing_loss reads megatron-core's tracker for
        # --use-mcore-models (McoreBalancingLoss): the embedded GPT's value.
        ours, theirs = result["balancing"]
        assert abs(ours - theirs) < 1e-6 and ours >= 0.999, result


# -- a bf16 MoE layer and Megatron's --moe-router-dtype ---------------------------------------
def moe_layer_bf16_worker(rank, world, *, router_dtype, extra):
    """Our bf16 MoE layer and megatron-core's, same weights and input: outputs and gradients."""
    cfg = GPTConfig(**SMALL, **LLAMA, num_moe_experts=8, moe_router_topk=2, moe_router_dtype=router_dtype, **extra)
    device = mcore_device()
    torch.manual_seed(0)
    ours = GPT(cfg).to(device, torch.bfloat16)
    x = torch.randn(SEQ, 3, 32, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)  # (s, b, h)
    w = torch.randn(SEQ, 3, 32, generator=torch.Generator().manual_seed(4)).to(device)
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True, params_dtype=torch.bfloat16).to(device, torch.bfloat16)
        theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        mine, megatron = ours.blocks[0].mlp, theirs.decoder.layers[0].mlp
        x_ours, x_theirs = x.transpose(0, 1).clone().requires_grad_(), x.clone().requires_grad_()
        out_ours, (out_theirs, _) = mine(x_ours).transpose(0, 1), megatron(x_theirs)
        (out_ours.float() * w).sum().backward()
        (out_theirs.float() * w).sum().backward()
    ours_grads = to_mcore_state_dict({f"blocks.0.mlp.{n}": p.grad for n, p in mine.named_parameters()}, cfg)
    pairs = [(x_ours.grad.transpose(0, 1), x_theirs.grad)]
    pairs += [(ours_grads[f"decoder.layers.0.mlp.{n}"], p.grad) for n, p in megatron.named_parameters()]
    # A gradient may differ in its last bf16 bit where the two sum the same products in another
    # order (their weight-gradient GEMM is transposed): measure it against the tensor's size.
    grad_rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)
    return dict(out_diff=(out_ours.float() - out_theirs.float()).abs().max().item(), grad_rel=grad_rel,
                their_router_dtype=megatron.config.moe_router_dtype, exact=device.type == "cpu")


@pytest.mark.parametrize("router_dtype, extra", [
    (None, {}), ("fp32", {}), ("fp32", dict(moe_router_topk_scaling_factor=2.5)),
    ("fp32", dict(moe_router_pre_softmax=True)), ("fp64", dict(moe_aux_loss_coeff=0.1)),
], ids=["bf16", "fp32", "fp32_scaled", "fp32_pre_softmax", "fp64_aux_loss"])
def test_bf16_moe_layer_with_router_dtype_is_megatron_cores(pool2, router_dtype, extra):
    """In bf16 the outputs are megatron-core's bit for bit on the CPU -- the same experts
    picked, the routing weights in the same dtype where they meet the experts' activations --
    and every gradient agrees to bf16 rounding. (With a bf16 router, scaling and pre-softmax
    are left out: megatron-core 0.16.1 rounds the softmax to bf16 before them, the pinned
    Megatron-LM commit after, as here.)"""
    result = pool2.run(moe_layer_bf16_worker, router_dtype=router_dtype, extra=extra)[0]
    assert result["their_router_dtype"] == router_dtype  # the mapping reached megatron-core's config
    assert result["out_diff"] == 0.0 if result["exact"] else result["out_diff"] < 1e-2, result
    assert result["grad_rel"] < 2**-8, result


def test_build_refuses_what_megatron_core_cannot_run():
    # Zero-centred norms and MoE layer patterns are mapped (tests/test_models_layernorm1p.py,
    # tests/test_moe_layer_freq.py).
    assert mcore_unsupported(GPTConfig(**SMALL)) == []
    assert mcore_unsupported(GPTConfig(**SMALL, apply_layernorm_1p=True, num_moe_experts=2, moe_layer_freq=[0, 1])) == []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA.*drop --use-mcore-models"):
            build_mcore_gpt(GPTConfig(**SMALL))


# -- the launcher's --use-mcore-models checkpoints -------------------------------------------
LAUNCHER_TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                 "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-3 --train-iters 1 --use-mcore-models")
LAUNCHER_MODELS = {
    "gpt": "",
    "llama_moe": ("--swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention "
                  "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear "
                  "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2"),
    # Zero-centred norms (same keys) and a dense first layer (Megatron-LM's DeepSeek pattern).
    "llama_moe_1p_dense_first": ("--swiglu --normalization RMSNorm --position-embedding-type rope "
                                 "--untie-embeddings-and-output-weights --disable-bias-linear --num-experts 4 "
                                 "--moe-router-topk 2 --apply-layernorm-1p --qk-layernorm --moe-layer-freq ([0]+[1]*1)"),
}


def launcher_checkpoint_keys_worker(rank, world, *, flags, directory):
    """The model keys the launcher's --save writes, and megatron-core GPTModel's own."""
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.training.args.arguments import parse_args

    # Validation refuses --use-mcore-models without CUDA; the shim provides what megatron-core needs.
    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):
        args = parse_args(f"{LAUNCHER_TINY} {flags} --distributed-backend nccl".split(), world_size=world)
    bundle, saved, own = launcher_saved_and_own_keys(args, directory, _mcore_on_cpu)
    return dict(saved=saved, own=sorted(own.state_dict()), wrapper=type(bundle.model).__name__)


def launcher_saved_and_own_keys(args, directory, bridge):
    """The launcher's model for ``args`` saved by its --save at iteration 1 under
    ``bridge`` (a CPU shim context): (bundle, the saved model keys, megatron-core's
    own GPTModel for the same config)."""
    import functools

    import torch.distributed.checkpoint as dcp

    from megatron_fsdp.models import mcore as mcore_models
    from megatron_fsdp.training.checkpoint import dcp_checkpoint as checkpointing
    from megatron_fsdp.training.model_setup import gpt_config_from_args, setup_model_and_optimizer

    with bridge(), mock.patch.object(mcore_models, "build_mcore_gpt",
                                     functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)):
        bundle = setup_model_and_optimizer(args, torch.device("cpu"))
        checkpointing.save(directory, 1, bundle.model, bundle.optimizer, {})
        torch.manual_seed(0)
        own = mcore_models.build_mcore_gpt(gpt_config_from_args(args), allow_cpu=True)
    metadata = dcp.FileSystemReader(checkpointing.checkpoint_dir(directory, 1)).read_metadata().state_dict_metadata
    return bundle, sorted(k.removeprefix("model.") for k in metadata if k.startswith("model.")), own


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
@pytest.mark.parametrize("model", list(LAUNCHER_MODELS))
def test_launcher_saves_megatron_core_keys(pool2, tmp_path, model, wrapper):
    flags = LAUNCHER_MODELS[model] + (" --use-megatron-fsdp" if wrapper == "fsdp" else "")
    result = pool2.run(launcher_checkpoint_keys_worker, flags=flags, directory=str(tmp_path))[0]
    assert result["wrapper"] == ("FullyShardedDataParallel" if wrapper == "fsdp" else "DistributedDataParallel")
    assert result["saved"] == result["own"]  # megatron-core's names, no wrapper prefix
    weights = [k for k in result["saved"] if not k.endswith("_extra_state")]
    assert "embedding.word_embeddings.weight" in weights and "decoder.layers.0.self_attention.linear_qkv.weight" \
        in weights
    if model == "llama_moe":
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in weights
        assert "decoder.layers.0.mlp.router.weight" in weights and "output_layer.weight" in weights
    if model == "llama_moe_1p_dense_first":
        assert "decoder.layers.0.mlp.linear_fc1.weight" in weights and "decoder.layers.0.mlp.router.weight" not in weights
        assert "decoder.layers.1.mlp.router.weight" in weights
        assert "decoder.layers.1.self_attention.q_layernorm.weight" in weights
