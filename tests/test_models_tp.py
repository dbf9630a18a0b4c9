"""The embedded GPT's tensor-parallel plan (megatron_fsdp/models/tensor_parallel.py) at
TP 2 without FSDP computes what the whole model computes: the same loss and, for every
parameter, the same gradient (``grad.full_tensor()``) within 1e-6 in fp32, with and
without sequence parallelism, for a GPT-style model (LayerNorm, GELU, learned positions,
tied embeddings, biases), a Llama-style one (RMSNorm, SwiGLU, RoPE, GQA) and one with
the rest of the attention options (q/k norms, output gate, zero-centred norms, full
recomputation); a few SGD steps land on the same weights. Models the plan cannot split
are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megatron_fsdp.models import GPT, GPTConfig
from megatron_fsdp.models.tensor_parallel import apply_tensor_parallel, tensor_parallel_problems

TOL = 1e-6
SEQ, BATCH, STEPS = 8, 2, 3
GPT_STYLE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=64,
                 normalization="LayerNorm", position_embedding_type="learned_absolute", openai_gelu=False)
LLAMA_STYLE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                   seq_length=SEQ, vocab_size=64, swiglu=True, normalization="RMSNorm",
                   position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False)
EXTRAS = dict(LLAMA_STYLE, qk_layernorm=True, attention_output_gate=True, apply_layernorm_1p=True,
              recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              num_query_groups=4, add_bias_linear=True)
FAMILIES = {"gpt": GPT_STYLE, "llama": LLAMA_STYLE, "extras": EXTRAS,
            "gpt_untied_rope_selective": dict(GPT_STYLE, untie_embeddings_and_output_weights=True,
                                              position_embedding_type="rope", recompute_granularity="selective")}


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _same_two(cfg: GPTConfig) -> tuple[GPT, GPT]:
    """Two builds from the same seed (a deepcopy would drop the parameters' marks)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg))
    return models[0], models[1]


def _data(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def parity_worker(rank, world, *, family: str, sp: bool):
    """Loss and gradients of the first batch, then weights after STEPS SGD steps: the largest
    differences between the TP model and the whole model, and the parameter types."""
    cfg = GPTConfig(**FAMILIES[family])
    reference, model = _same_two(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sp)
    data = _data(cfg.vocab_size)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_params = dict(reference.named_parameters())
    out = {"loss": [], "grad": 0.0, "weights": 0.0, "sharded": []}
    for step, tokens in enumerate(data):
        ref_loss, loss = _loss(reference, tokens), _loss(model, tokens)
        ref_loss.backward()
        loss.backward()
        out["loss"].append(abs(ref_loss.item() - loss.item()))
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None, name
                out["grad"] = max(out["grad"], (_full(p.grad) - ref_params[name].grad).abs().max().item())
                if isinstance(p, DTensor) and p.placements[0].is_shard():
                    out["sharded"].append(name)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, p in model.named_parameters():
        out["weights"] = max(out["weights"], (_full(p.detach()) - ref_params[name].detach()).abs().max().item())
    out["tied"] = model.lm_head.weight is model.wte.weight
    out["marked"] = bool(getattr(model.wte.weight, "is_embedding_or_output_parameter", False)
                         and getattr(model.lm_head.weight, "is_embedding_or_output_parameter", False))
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_equals_the_whole_model(pool2, family, sp):
    for out in pool2.run(parity_worker, family=family, sp=sp):
        assert max(out["loss"]) <= TOL and out["grad"] <= TOL and out["weights"] <= TOL, out
        assert out["marked"], "is_embedding_or_output_parameter was dropped"
        assert out["tied"] == (family == "gpt")
        # Every projection and the vocabulary are split, not merely replicated.
        for piece in ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.1.mlp.fc.weight",
                      "blocks.1.mlp.proj.weight", "wte.weight"):
            assert piece in out["sharded"], (piece, out["sharded"])


def local_width_worker(rank, world):
    """The fused projections hand each rank its own heads' q, k, v and gate."""
    cfg = GPTConfig(**dict(LLAMA_STYLE, attention_output_gate=True))
    whole, model = _same_two(cfg)
    model = apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"],
                                  sequence_parallel=False)
    x = torch.randn(1, SEQ, cfg.hidden_size)
    mine = model.blocks[0].attn.qkv(x)
    full = whole.blocks[0].attn.qkv(x)
    d, h, g = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    q, k, v, gate = full.split([h * d, g * d, g * d, h * d], dim=-1)
    own = [part.chunk(world, dim=-1)[rank] for part in (q, k, v, gate)]
    return (mine - torch.cat(own, dim=-1)).abs().max().item(), tuple(mine.shape)


def test_fused_qkv_gives_each_rank_its_heads(pool2):
    cfg = GPTConfig(**LLAMA_STYLE)
    for diff, shape in pool2.run(local_width_worker):
        assert diff <= TOL and shape == (1, SEQ, (2 * cfg.num_attention_heads + 2 * cfg.num_query_groups)
                                         * cfg.kv_channels // 2)


# -- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (dict(num_moe_experts=4, moe_router_topk=2), "mixture of experts"),
    (dict(multi_latent_attention=True, num_query_groups=4, kv_lora_rank=16, qk_head_dim=8,
          qk_pos_emb_head_dim=8, v_head_dim=8), "multi-latent attention"),
    (dict(mtp_num_layers=1), "multi-token prediction"),
    (dict(num_query_groups=1), "num_query_groups=1 is not divisible by the tensor-parallel size 2"),
    (dict(num_attention_heads=2, num_query_groups=1, kv_channels=16), "num_query_groups=1"),
    (dict(ffn_hidden_size=51), "ffn_hidden_size=51"),
    (dict(vocab_size=63), "vocab_size=63"),
])
def test_problems_name_the_feature_and_the_remedy(overrides, words):
    cfg = GPTConfig(**dict(LLAMA_STYLE, **overrides))
    problems = tensor_parallel_problems(cfg, 2, sequence_parallel=False)
    assert any(words in p for p in problems), problems


def test_sequence_parallel_needs_a_divisible_sequence():
    cfg = GPTConfig(**dict(LLAMA_STYLE, seq_length=9))
    assert tensor_parallel_problems(cfg, 2, sequence_parallel=False) == []
    assert "seq_length=9" in tensor_parallel_problems(cfg, 2, sequence_parallel=True)[0]


def refusal_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    messages = {}
    cases = {"moe": dict(LLAMA_STYLE, num_moe_experts=4, moe_router_topk=2),
             "groups": dict(LLAMA_STYLE, num_query_groups=1),
             "vocab": dict(LLAMA_STYLE, vocab_size=63)}
    for case, kwargs in cases.items():
        model = GPT(GPTConfig(**kwargs))
        try:
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=False)
        except (NotImplementedError, ValueError) as exc:
            messages[case] = (type(exc).__name__, str(exc),
                              any(isinstance(p, DTensor) for p in model.parameters()))
    model = apply_tensor_parallel(GPT(GPTConfig(**LLAMA_STYLE)), mesh["tp"], sequence_parallel=True)
    for case, call in {"twice": lambda: apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True),
                       "odd_sequence": lambda: model(torch.zeros(1, SEQ - 1, dtype=torch.long))}.items():
        try:
            call()
        except ValueError as exc:
            messages[case] = ("ValueError", str(exc), None)
    return messages


def test_refusals_change_nothing_and_say_why(pool2):
    for messages in pool2.run(refusal_worker):
        assert messages["moe"][0] == "NotImplementedError" and "train MoE models at TP 1" in messages["moe"][1]
        assert messages["groups"][0] == "ValueError" and "Megatron-LM's rule" in messages["groups"][1]
        assert "vocab_size_with_padding" in messages["vocab"][1]
        assert not any(messages[case][2] for case in ("moe", "groups", "vocab")), "a refused model was changed"
        assert "already a DTensor" in messages["twice"][1]
        assert "divisible by 2" in messages["odd_sequence"][1]
