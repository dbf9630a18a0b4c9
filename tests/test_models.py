"""The embedded GPT's features, one at a time: shapes and numbers against direct
formulas (single process, no process group)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_fsdp.param_marks import is_expert_param
from megatron_fsdp.models import (
    GPT,
    GPTConfig,
    MoELayer,
    Normalization,
    PositionEmbeddingType,
    RecomputeGranularity,
    RouterDtype,
    gpt_loss,
    has_expert_parameters,
    presets,
    vocab_size_with_padding,
)
from megatron_fsdp.models.config import megatron_swiglu_ffn_hidden_size
from megatron_fsdp.models.layers import MLP
from megatron_fsdp.models.mcore import to_mcore_state_dict
from megatron_fsdp.models.moe import route, switch_load_balancing_loss
from megatron_fsdp.models.rope import apply_rope, rope_angles

LLAMA = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope", num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def _gpt(seed: int = 0, **kwargs) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kwargs))


def _tokens(b: int = 3, t: int = 12, vocab: int = 256, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _grads(model: GPT, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# -- config -----------------------------------------------------------------------------
def test_default_config_is_the_old_gpt():
    cfg = GPTConfig()
    assert (cfg.ffn_hidden_size, cfg.kv_channels, cfg.num_query_groups) == (256, 16, 4)
    assert cfg.normalization is Normalization.LAYER_NORM
    assert cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE
    assert cfg.hidden_dropout == cfg.attention_dropout == 0.0 and cfg.recompute_granularity is None
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    assert names[:4] == ["wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias"]
    assert names[4:10] == [f"blocks.0.{m}.{w}" for m in ("attn.qkv", "attn.proj") for w in ("weight", "bias")] + [
        "blocks.0.ln_2.weight", "blocks.0.ln_2.bias"]
    assert model.lm_head.weight is model.wte.weight
    # 2 x (4*64^2 + 8*64^2 + biases 3*64+64+256+64 + norms 4*64) + embeddings (256+64)*64 + final norm 128
    assert model.num_parameters() == 2 * (12 * 64 * 64 + 576 + 256) + 320 * 64 + 128


@pytest.mark.parametrize("kwargs, loss, grad_l1, wte_sum", [
    (dict(), 5.577077865600586, 525.5487979501486, -2.4822542667388916),
    (dict(tie_embeddings=False, num_layers=3, hidden_size=48, num_attention_heads=6, ffn_hidden_size=100),
     5.545067310333252, 298.7059806827456, -3.098935604095459),
])
def test_default_numbers_are_pinned(kwargs, loss, grad_l1, wte_sum):
    """Values measured with the GPT as it was before the Megatron-LM fields existed:
    the same seed still gives the same weights, loss and gradients."""
    model = _gpt(**kwargs)
    grads = _grads(model, _tokens(t=13))
    assert model.wte.weight.sum().item() == pytest.approx(wte_sum, rel=1e-6)
    assert gpt_loss(model(_tokens(t=13)[:, :-1]), _tokens(t=13)[:, 1:]).item() == pytest.approx(loss, rel=1e-6)
    assert sum(g.abs().sum().item() for g in grads.values()) == pytest.approx(grad_l1, rel=1e-5)


def test_legacy_field_names_still_work():
    assert GPTConfig(tie_embeddings=False).untie_embeddings_and_output_weights
    assert GPTConfig(recompute=True).recompute_granularity is RecomputeGranularity.FULL
    with pytest.raises(ValueError, match="recompute_granularity"):
        GPTConfig(recompute=True, recompute_granularity="selective")


@pytest.mark.parametrize("kwargs, match", [
    (dict(normalization="BatchNorm"), "'LayerNorm', 'RMSNorm'"),
    (dict(position_embedding_type="alibi"), "learned_absolute"),
    (dict(num_query_groups=3), "num_query_groups=3 must divide"),
    (dict(position_embedding_type="rope", rotary_percent=0.1), "even"),
    (dict(hidden_size=62), "kv_channels"),
    (dict(num_moe_experts=4, moe_router_topk=5), "moe_router_topk=5"),
    (dict(num_moe_experts=4, moe_layer_freq=[1, 0, 1]), "moe_layer_freq"),
    (dict(swiglu=True, hidden_size=16, num_attention_heads=2), "pass ffn_hidden_size"),
    (dict(hidden_dropout=1.0), "hidden_dropout=1.0"),
])
def test_bad_configs_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_enums_accept_megatron_strings():
    cfg = GPTConfig(normalization="rmsnorm", position_embedding_type="RoPE", recompute_granularity="Full")
    assert cfg.normalization is Normalization.RMS_NORM
    assert cfg.position_embedding_type is PositionEmbeddingType.ROPE
    assert cfg.recompute_granularity is RecomputeGranularity.FULL


def test_vocab_padding_is_megatrons():
    assert vocab_size_with_padding(50257, 128) == 50304
    assert vocab_size_with_padding(128256, 128) == 128256
    assert vocab_size_with_padding(50257, 128, tensor_model_parallel_size=2) == 50432
    assert vocab_size_with_padding(256, 1) == 256 and vocab_size_with_padding(257, 64) == 320
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by=0"):
        vocab_size_with_padding(10, 0)


# -- RoPE -------------------------------------------------------------------------------
def _rope_reference(x: torch.Tensor, rot_dim: int, base: float) -> torch.Tensor:
    """Rotation of the complex number x_j + i x_{j + rot_dim/2} by position * base^(-2j/rot_dim)."""
    half = rot_dim // 2
    out = x.clone().double()
    for p in range(x.shape[2]):
        for j in range(half):
            theta = p * base ** (-2 * j / rot_dim)
            z = torch.complex(x[:, :, p, j].double(), x[:, :, p, j + half].double()) * complex(math.cos(theta), math.sin(theta))
            out[:, :, p, j], out[:, :, p, j + half] = z.real, z.imag
    return out.float()


@pytest.mark.parametrize("rot_dim, base", [(8, 10000.0), (4, 500000.0)])
def test_rope_matches_the_rotation_formula(rot_dim, base):
    x = torch.randn(2, 3, 7, 8)  # (b, h, t, d); rot_dim 4 leaves half the channels unrotated
    got = apply_rope(x, rope_angles(7, rot_dim, base, x.device))
    torch.testing.assert_close(got, _rope_reference(x, rot_dim, base), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., rot_dim:], x[..., rot_dim:])


def test_rope_scores_depend_on_relative_position_only():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    angles = rope_angles(20, 16, 10000.0, q.device)

    def score(p: int, s: int) -> torch.Tensor:
        return (apply_rope(q, angles[p:p + 1]) * apply_rope(k, angles[s:s + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(15, 12), rtol=1e-5, atol=1e-5)


def test_rope_model_has_no_position_table_and_percent_applies():
    model = _gpt(position_embedding_type="rope", rotary_percent=0.5)
    assert not hasattr(model, "wpe") and model.blocks[0].attn.rotary_dim == 8
    assert model(_tokens()).shape == (3, 12, 256)


# -- attention ----------------------------------------------------------------------------
def test_gqa_with_one_group_per_head_is_mha():
    a, b = _gpt(num_query_groups=4), _gpt()
    tokens = _tokens()
    assert torch.equal(a(tokens), b(tokens))


def test_gqa_equals_mha_with_shared_key_value_heads():
    """GQA with 2 groups of 2 heads = MHA whose k/v heads are copies of their group's."""
    gqa, mha = _gpt(num_query_groups=2, add_bias_linear=False), _gpt(add_bias_linear=False)
    with torch.no_grad():
        for (name, src), (_, dst) in zip(gqa.named_parameters(), mha.named_parameters()):
            if "attn.qkv" in name:
                q, k, v = src.split([64, 32, 32])  # rows [q: 4 heads x 16 | k: 2 groups x 16 | v: 2 x 16]
                per_head = lambda t: t.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)  # noqa: E731
                dst.copy_(torch.cat([q, per_head(k), per_head(v)]))
            else:
                dst.copy_(src)
    assert gqa.blocks[0].attn.qkv.weight.shape == (128, 64)
    tokens = _tokens()
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_kv_channels_sets_head_width():
    model = _gpt(kv_channels=24, num_query_groups=2)  # 4 heads x 24 = 96 != hidden 64
    assert model.blocks[0].attn.qkv.weight.shape == (4 * 24 + 2 * 2 * 24, 64)
    assert model.blocks[0].attn.proj.weight.shape == (64, 96)
    assert model(_tokens()).shape == (3, 12, 256)


def test_qk_layernorm_normalises_each_head():
    model = _gpt(qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-10)
    attn = model.blocks[0].attn
    assert attn.q_layernorm.weight.shape == (16,) and attn.k_layernorm.weight.shape == (16,)
    seen = {}
    attn.q_layernorm.register_forward_hook(lambda m, args, out: seen.setdefault("q", out))
    model(_tokens())
    rms = seen["q"].pow(2).mean(-1).sqrt()  # (b, h, t): unit RMS per head with weight 1
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)


# -- norms, MLP, output, biases ---------------------------------------------------------
def test_rmsnorm_formula():
    model = _gpt(normalization="RMSNorm", norm_epsilon=1e-3)
    norm = model.blocks[0].ln_1
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def test_layernorm_epsilon_and_layernorm_1p():
    x = torch.randn(2, 5, 64)
    plain = _gpt(norm_epsilon=1e-2).blocks[0].ln_1
    torch.testing.assert_close(plain(x), F.layer_norm(x, (64,), eps=1e-2))
    for kind in ("LayerNorm", "RMSNorm"):
        one_p = _gpt(apply_layernorm_1p=True, normalization=kind).blocks[0].ln_1
        assert torch.count_nonzero(one_p.weight) == 0  # scale (1 + 0) at init
        ref = _gpt(normalization=kind).blocks[0].ln_1
        torch.testing.assert_close(one_p(x), ref(x))
        with torch.no_grad():
            one_p.weight.fill_(0.5)
        torch.testing.assert_close(one_p(x), 1.5 * ref(x))


def test_swiglu_mlp_formula_and_megatron_default_width():
    cfg = GPTConfig(swiglu=True, ffn_hidden_size=48, add_bias_linear=False)
    torch.manual_seed(0)
    mlp = MLP(cfg)
    assert mlp.fc.weight.shape == (96, 64) and mlp.proj.weight.shape == (64, 48)
    x = torch.randn(3, 64)
    gate, up = mlp.fc.weight[:48], mlp.fc.weight[48:]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
    # Megatron-LM: swiglu without --ffn-hidden-size is 2/3 * 4h, rounded down to a multiple of 64.
    assert megatron_swiglu_ffn_hidden_size(4096) == 10880
    assert GPTConfig(swiglu=True, hidden_size=4096, num_attention_heads=32).ffn_hidden_size == 10880
    assert GPTConfig(swiglu=True).ffn_hidden_size == 128


def test_gelu_flavours():
    x = torch.randn(3, 64)
    for openai, approximate in ((True, "tanh"), (False, "none")):
        torch.manual_seed(0)
        mlp = MLP(GPTConfig(openai_gelu=openai))
        expected = F.gelu(x @ mlp.fc.weight.T + mlp.fc.bias, approximate=approximate) @ mlp.proj.weight.T + mlp.proj.bias
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_untied_output_layer():
    tied, untied = _gpt(), _gpt(untie_embeddings_and_output_weights=True)
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 256 * 64
    grads = _grads(untied, _tokens())
    assert "lm_head.weight" in grads and grads["lm_head.weight"].abs().sum() > 0


def test_disable_bias_linear():
    model = _gpt(add_bias_linear=False)
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert biases and all(".ln_" in n or n.startswith("ln_f") for n in biases)  # LayerNorm keeps its bias
    assert not [n for n, _ in _gpt(**LLAMA).named_parameters() if n.endswith(".bias")]


def test_init_std_and_scaled_output_init():
    std, layers = 0.05, 8
    model = _gpt(num_layers=layers, hidden_size=256, num_attention_heads=8, init_method_std=std,
                 untie_embeddings_and_output_weights=True)
    scaled = std / math.sqrt(2 * layers)
    block = model.blocks[3]
    checks = {"qkv": (block.attn.qkv.weight, std), "fc": (block.mlp.fc.weight, std),
              "attn proj": (block.attn.proj.weight, scaled), "mlp proj": (block.mlp.proj.weight, scaled),
              "wte": (model.wte.weight, std), "wpe": (model.wpe.weight, std), "output": (model.lm_head.weight, std)}
    for name, (weight, expected) in checks.items():
        assert abs(weight.std().item() / expected - 1) < 0.03, (name, weight.std().item(), expected)
        assert abs(weight.mean().item()) < 0.1 * expected, name
    assert torch.count_nonzero(block.attn.qkv.bias) == 0 and torch.count_nonzero(block.mlp.proj.bias) == 0


# -- recompute and dropout --------------------------------------------------------------
RECOMPUTE = {"full": dict(recompute_granularity="full"), "selective": dict(recompute_granularity="selective"),
             "uniform2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
             "block1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)}


@pytest.mark.parametrize("granularity", list(RECOMPUTE))
@pytest.mark.parametrize("family", ["gpt", "llama_moe"])
def test_recompute_gives_identical_grads(granularity, family):
    kwargs = dict(hidden_dropout=0.1, attention_dropout=0.1, num_layers=3)
    if family == "llama_moe":
        kwargs.update(LLAMA, num_moe_experts=4, moe_aux_loss_coeff=0.01, qk_layernorm=True)
    tokens = _tokens()
    base = _gpt(**kwargs)
    torch.manual_seed(11)
    expected = _grads(base, tokens)
    model = _gpt(**RECOMPUTE[granularity], **kwargs)
    torch.manual_seed(11)  # same dropout masks: recompute replays the RNG state
    got = _grads(model, tokens)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-7, msg=name)


def test_recompute_plan_checkpoints_the_right_blocks():
    plans = {None: [(0, 5, False)], "full": [(i, i + 1, True) for i in range(5)],
             "uniform2": [(0, 2, True), (2, 4, True), (4, 5, True)], "block1": [(0, 1, True), (1, 5, False)]}
    for name, expected in plans.items():
        assert _gpt(num_layers=5, **RECOMPUTE.get(name, {}))._block_chunks() == expected, name
    with pytest.raises(ValueError, match="full' only"):
        GPTConfig(recompute_granularity="selective", recompute_num_layers=1)
    with pytest.raises(ValueError, match="recompute_num_layers=3 must be between 1 and num_layers=2"):
        GPTConfig(recompute_granularity="full", recompute_num_layers=3)


def test_dropout_defaults_off_and_applies_in_training_only():
    tokens = _tokens()
    model = _gpt(hidden_dropout=0.3, attention_dropout=0.3)
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
    plain = _gpt()
    assert torch.equal(plain(tokens), plain(tokens))  # default dropout 0: training is deterministic


# -- mixture of experts -------------------------------------------------------------------
def test_router_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    probs, idx = route(logits, 2)
    assert idx.tolist() == [[1, 3], [0, 3]]
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[3.0, 2.0], [5.0, 4.0]]), -1))
    probs, idx = route(logits, 2, pre_softmax=True)
    torch.testing.assert_close(probs, torch.softmax(logits, -1).gather(1, idx))


def test_moe_layer_is_the_weighted_sum_of_its_top_k_experts():
    cfg = GPTConfig(swiglu=True, ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x = torch.randn(2, 5, 64)
    tokens = x.reshape(-1, 64)
    probs, idx = route(layer.router(tokens), 2)
    expected = torch.stack([
        sum(probs[n, j] * layer.experts[idx[n, j]](tokens[n]) for j in range(2)) for n in range(tokens.shape[0])
    ]).view_as(x)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_shared_expert_and_topk_scaling():
    cfg = GPTConfig(num_moe_experts=4, ffn_hidden_size=32, add_bias_linear=False,
                    moe_shared_expert_intermediate_size=24, moe_router_topk_scaling_factor=2.5)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    assert layer.shared_experts.fc.weight.shape == (24, 64)
    assert not any(is_expert_param(p) for p in layer.shared_experts.parameters())
    x = torch.randn(2, 3, 64)
    routed = layer(x) - layer.shared_experts(x)
    layer.scaling_factor = None
    torch.testing.assert_close(routed, 2.5 * (layer(x) - layer.shared_experts(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        GPTConfig(num_moe_experts=4, moe_shared_expert_intermediate_size=24)


def test_switch_aux_loss_formula():
    logits, coeff = torch.randn(10, 4), 0.3
    _, idx = route(logits, 2)
    counts = torch.zeros(4)
    for e in idx.reshape(-1).tolist():
        counts[e] += 1
    f = counts / (10 * 2)  # fraction of routed slots per expert
    p = torch.softmax(logits, -1).mean(0)  # mean router probability per expert
    torch.testing.assert_close(switch_load_balancing_loss(logits, idx, coeff), coeff * 4 * (f * p).sum())
    # Uniform routing costs exactly coeff.
    zeros = torch.zeros(8, 4)
    assert switch_load_balancing_loss(zeros, route(zeros, 2)[1], coeff).item() == pytest.approx(coeff)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_gradient_is_added_to_the_loss(scale):
    """The attached aux loss gives the gradient of loss + scale * aux."""
    cfg = GPTConfig(num_moe_experts=4, moe_aux_loss_coeff=0.5, ffn_hidden_size=32)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x, w = torch.randn(3, 4, 64, requires_grad=True), torch.randn(3, 4, 64)
    layer.aux_loss_scale = scale
    (layer(x) * w).sum().backward()
    attached = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    assert layer.last_aux_loss is not None
    layer.zero_grad()
    x.grad = None
    layer.aux_loss_coeff = 0.0  # now compute the aux loss by hand and add it
    out = layer(x)
    logits = layer.router(x.reshape(-1, 64))
    aux = switch_load_balancing_loss(logits, route(logits, 2)[1], 0.5)
    ((out * w).sum() + scale * aux).backward()
    explicit = [p.grad for p in layer.parameters()] + [x.grad]
    assert layer.router.weight.grad.abs().sum() > 0
    for a, b in zip(attached, explicit):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- router dtype (Megatron's --moe-router-dtype) --------------------------------------------------
def _near_tie_layer(router_dtype) -> MoELayer:
    """A bf16 MoE layer whose router scores an all-ones token 32 (expert 0) and 32 + 2**-8
    (expert 1), 0 for the rest: fp32 tells the two apart, a bf16 logit (spacing 0.25 at 32)
    cannot. Every weight is exact in bf16."""
    torch.manual_seed(0)
    layer = MoELayer(GPTConfig(num_moe_experts=4, ffn_hidden_size=32, moe_router_dtype=router_dtype)).bfloat16()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.bias.zero_()
        layer.router.weight[:2] = 0.5
        layer.router.weight[1, 0] += 2**-8
    return layer


def test_fp32_router_separates_experts_that_bf16_rounds_together():
    tokens = torch.ones(3, 64, dtype=torch.bfloat16)
    logits = _near_tie_layer("fp32").router(tokens)
    assert logits.dtype == torch.float32 and logits[0, :2].tolist() == [32.0, 32.0 + 2**-8]
    probs, idx = route(logits, 2)
    assert idx[0].tolist() == [1, 0] and probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor([2**-8, 0.0]), -1), rtol=0, atol=1e-7)
    bf16_logits = _near_tie_layer(None).router(tokens)
    assert bf16_logits.dtype == torch.bfloat16 and bf16_logits[0, 0] == bf16_logits[0, 1] == 32  # a tie
    assert route(bf16_logits, 2)[0][0].tolist() == [0.5, 0.5]  # fp32 gives 0.50098 / 0.49902


@pytest.mark.parametrize("router_dtype, dtype", [("fp32", torch.float32), ("fp64", torch.float64)])
def test_router_dtype_routes_as_an_explicit_computation_in_that_dtype(router_dtype, dtype):
    """bf16 weights (the Megatron-FSDP path) and fp32 weights under bf16 autocast (the DDP
    path): logits, choice and weights are those of x W^T computed in the router dtype."""
    cfg = GPTConfig(num_moe_experts=8, moe_router_topk=2, ffn_hidden_size=32, moe_router_dtype=router_dtype)
    assert cfg.moe_router_dtype is RouterDtype(router_dtype)
    tokens = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    for bf16_weights in (True, False):
        model = MoELayer(cfg).bfloat16() if bf16_weights else layer
        model.load_state_dict(layer.state_dict())
        weight, bias = model.router.weight.detach(), model.router.bias.detach()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_weights):
            logits = model.router(tokens)
        explicit = torch.addmm(bias.to(dtype), tokens.to(dtype), weight.to(dtype).T)  # outside autocast
        assert logits.dtype == dtype and torch.equal(logits, explicit)
        probs, idx = route(logits, 2)
        top, expected_idx = explicit.topk(2, dim=-1)
        assert torch.equal(idx, expected_idx)
        assert torch.equal(probs, torch.softmax(top.float(), -1).to(dtype))


@pytest.mark.parametrize("biases", [True, False])
def test_router_has_a_bias_exactly_when_linear_layers_do(biases):
    """Megatron-core's router (0.16.1 and Megatron-LM's main) has a bias when
    add_bias_linear, initialised like the weight (N(0, std), not zeros); it used to be
    missing here, so a GPT-style MoE computed other logits than Megatron-LM's."""
    cfg = GPTConfig(num_moe_experts=8, ffn_hidden_size=32, add_bias_linear=biases, init_method_std=0.5)
    torch.manual_seed(0)
    router = MoELayer(cfg).router
    names = sorted(n for n, _ in router.named_parameters())
    assert names == (["bias", "weight"] if biases else ["weight"])
    tokens = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    expected = tokens @ router.weight.detach().T
    if biases:
        assert 0.2 < router.bias.detach().std().item() < 1.0  # drawn, not zeroed
        expected = expected + router.bias.detach()
    torch.testing.assert_close(router(tokens), expected)
    if biases:
        cfg_mcore = GPTConfig(num_layers=1, num_moe_experts=8, ffn_hidden_size=32)
        names = to_mcore_state_dict(GPT(cfg_mcore).state_dict(), cfg_mcore)
        assert "decoder.layers.0.mlp.router.bias" in names


def test_expert_scales_its_activation_in_the_routing_weights_dtype():
    """Megatron-core's experts weight the activation before the output projection and the
    bias after it; an fp32 weight is applied in fp32 and rounded once to bf16."""
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(ffn_hidden_size=32))
    with torch.no_grad():
        mlp.proj.bias.normal_()
    x, p = torch.randn(5, 64), torch.rand(5)
    torch.testing.assert_close(mlp(x, per_token_scale=p), p[:, None] * mlp(x), rtol=1e-5, atol=1e-6)
    mlp, xb = mlp.bfloat16(), x.bfloat16()
    h = F.gelu(mlp.fc(xb), approximate="tanh")
    expected = (F.linear((h * p[:, None]).bfloat16(), mlp.proj.weight) + mlp.proj.bias * p[:, None]).bfloat16()
    assert torch.equal(mlp(xb, per_token_scale=p), expected)


@pytest.mark.parametrize("router_dtype", [None, "fp32"])
def test_moe_gpt_trains_under_bf16_autocast(router_dtype):
    """The launcher's DDP path in bf16 (fp32 weights, autocast): expert outputs come back in
    bf16 and are summed in bf16 (this used to fail in index_add on a dtype mismatch)."""
    model = _gpt(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_router_dtype=router_dtype, ffn_hidden_size=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gpt_loss(model(_tokens()[:, :-1]), _tokens()[:, 1:])
    loss.backward()
    router = model.blocks[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_router_dtype_names_a_bad_value():
    with pytest.raises(ValueError, match="moe_router_dtype='bf16' is not one of 'fp32', 'fp64'"):
        GPTConfig(num_moe_experts=4, moe_router_dtype="bf16")


def test_moe_gpt_marks_experts_and_reports_aux_loss():
    model = _gpt(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_layer_freq=[0, 1], **LLAMA)
    assert isinstance(model.blocks[1].mlp, MoELayer) and not isinstance(model.blocks[0].mlp, MoELayer)
    experts = {n for n, p in model.named_parameters() if is_expert_param(p)}
    assert experts and all(".mlp.experts." in n for n in experts)
    assert not any(is_expert_param(p) for n, p in model.named_parameters() if n not in experts)
    assert has_expert_parameters(model) and not has_expert_parameters(_gpt())
    assert model.moe_aux_loss() is None
    model(_tokens())
    assert model.moe_aux_loss().item() >= 0.01 * 0.999  # the balancing loss is >= coeff, = coeff when uniform
    with torch.no_grad():  # evaluation attaches nothing and keeps the last training value
        model.eval()
        model(_tokens())


def test_moe_load_balancing_loss_is_megatrons_logged_value():
    """Megatron-core logs each layer's balancing loss without its coefficient, averaged over the MoE layers."""
    model = _gpt(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_layer_freq=[1, 1], **LLAMA)
    assert _gpt().moe_load_balancing_loss() is None
    model(_tokens())
    per_layer = [layer.last_aux_loss / 0.01 for layer in model.moe_layers()]
    assert len(per_layer) == 2 and all(v.item() >= 0.999 for v in per_layer)
    torch.testing.assert_close(model.moe_load_balancing_loss(), (per_layer[0] + per_layer[1]) / 2)
    no_aux = _gpt(num_moe_experts=4, moe_aux_loss_coeff=0.0, **LLAMA)
    no_aux(_tokens())
    assert no_aux.moe_load_balancing_loss() is None  # nothing recorded, nothing logged, as in Megatron-LM


# -- presets ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, params", [("llama3-8b", 8_030_261_248), ("mixtral-8x7b", 46_702_792_704)])
def test_real_size_presets_have_the_published_parameter_counts(name, params):
    with torch.device("meta"):
        model = GPT(presets.config(name))
    assert model.num_parameters() == params


def test_presets_build_and_spell_as_megatron_flags():
    for name in presets.PRESETS:
        cfg = presets.config(name)
        flags = presets.megatron_flags(cfg)
        assert flags["--num-layers"] == cfg.num_layers and flags["--hidden-size"] == cfg.hidden_size
    llama = presets.megatron_flags(presets.config("llama3-8b"))
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention"):
        assert llama[flag] is True
    assert llama["--num-query-groups"] == 8 and llama["--normalization"] == "RMSNorm"
    # Exact GELU with biases: Megatron-LM needs its bias-GELU fusion off (the fused kernel is tanh GELU).
    gpt3_flags = presets.megatron_flags(presets.config("gpt3-175b"))
    assert gpt3_flags["--no-bias-gelu-fusion"] is True and "--openai-gelu" not in gpt3_flags
    with pytest.raises(ValueError, match="without biases Megatron-LM always uses the exact GELU"):
        presets.megatron_flags(GPTConfig(add_bias_linear=False))
    gpt3 = presets.config("gpt3-175b")
    assert gpt3.vocab_size == 50304 and gpt3.hidden_dropout == 0.1
    for name in ("llama3-tiny", "gpt3-tiny", "mixtral-tiny"):
        model = GPT(presets.config(name, vocab_size=320))
        assert model(_tokens(vocab=320)).shape == (3, 12, 320)
    with pytest.raises(ValueError, match="known presets"):
        presets.config("llama-70b")
