"""Context parallelism of the embedded GPT (megatron_fsdp/models/context_parallel.py).

* The load-balanced split (Megatron-LM's): rank r of CP holds chunks r and 2CP-1-r of 2CP;
  the shares put back in position order are the sequence; lengths not a multiple of 2CP
  are refused with the remedy.
* Without FSDP, at CP 2 (and CP 4): a CP model's logits for its tokens equal the whole
  model's within 1e-6, and its gradients (averaged over the CP ranks, as the engine does)
  the whole model's within 1e-6, for GPT-style (learned positions, LayerNorm, tied), Llama-
  style (RoPE, RMSNorm, SwiGLU, GQA, untied) models, q/k norms + output gate + full
  recomputation, selective recomputation + interleaved/partial RoPE, NoPE, and multi-latent
  attention with YaRN. Per attention layer: forward 1 all-gather (K and V together),
  backward 1 reduce-scatter (full recomputation: 2 all-gathers), counted by the model and
  checked against the calls torch.distributed saw.
* Through ``megatron_fsdp.fully_shard`` (every rank one FSDP shard group, the engine's
  default): CP 2 at world 2 and CP 2 x DP 2 at world 4 (rank = dp_rank x CP + cp_rank), fp32,
  3 steps of 2 micro-batches with an uneven loss mask, SGD and AdamW (eps 1e-4): every
  parameter within 1e-5 of one process training the whole model on the global batch, the
  first micro-batch's logits and loss within 1e-6; also with ``calculate_per_token_loss``.
  All four sharding strategies with ``MFSDP_EPCP_LONG=1``.
* TP 2 x CP 2 at world 4 without FSDP (the TP plan, then CP): the same gradients and weights.
* Refusals: multi-token prediction, attention dropout, seq_length, meshes, twice, shares of
  odd length; MoE models are accepted (their layers take the CP group).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.models.context_parallel import (
    _in_position_order,
    apply_context_parallel,
    context_parallel_loss,
    context_parallel_positions,
    context_parallel_problems,
    context_parallel_shard,
    context_parallel_token_loss,
    kv_exchange_counts,
)
from megatron_fsdp.models.tensor_parallel import apply_tensor_parallel
from models import make_optimizer, max_param_diff

TOL, EXACT = 1e-5, 1e-6
SEQ, VOCAB, STEPS, MICRO, PER_MICRO = 16, 96, 3, 2, 2
LONG = os.environ.get("MFSDP_EPCP_LONG") == "1"
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
             seq_length=SEQ, vocab_size=VOCAB, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
GPT_STYLE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                 normalization="LayerNorm", position_embedding_type="learned_absolute", openai_gelu=False)
FAMILIES = {
    "llama": LLAMA,
    "gpt": GPT_STYLE,
    "qk_norm_gate_full_recompute": dict(LLAMA, qk_layernorm=True, attention_output_gate=True, num_layers=3,
                                        recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=2),
    "selective_interleaved_partial_rope": dict(LLAMA, recompute_granularity="selective", rotary_interleaved=True,
                                               rotary_percent=0.5),
    "nope_mha": dict(GPT_STYLE, position_embedding_type="none", untie_embeddings_and_output_weights=True),
    "mla_yarn": dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=10, kv_lora_rank=12,
                     qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6, qk_layernorm=True, rope_type="yarn",
                     rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7, original_max_position_embeddings=8),
}


# -- the split (pure) ------------------------------------------------------------------------
@pytest.mark.parametrize("cp, length", [(1, 6), (2, 8), (2, 16), (3, 12), (4, 32)])
def test_shares_are_chunks_r_and_2cp_minus_1_minus_r(cp, length):
    x = torch.arange(2 * length).view(2, length)  # (b, T)
    shares = [context_parallel_shard(x, r, cp) for r in range(cp)]
    chunk = length // (2 * cp)
    for r, share in enumerate(shares):
        expected = torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                              torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])
        assert torch.equal(share[0], expected) and torch.equal(share[1], expected + length)
        assert torch.equal(context_parallel_positions(length, r, cp), expected)
    assert sorted(torch.cat(shares, dim=1)[0].tolist()) == list(range(length))  # every token once
    assert torch.equal(_in_position_order(shares, 1), x)  # what the K/V all-gather reassembles
    if cp == 2 and length == 8:
        assert [s[0].tolist() for s in shares] == [[0, 1, 6, 7], [2, 3, 4, 5]]  # Megatron-LM's docstring example
    # another dimension: (T, b) with seq_dim=0
    assert torch.equal(context_parallel_shard(x.T, cp - 1, cp, seq_dim=0), shares[-1].T)


@pytest.mark.parametrize("cp, length", [(2, 6), (2, 18), (3, 9), (4, 12)])
def test_lengths_not_a_multiple_of_2cp_are_refused_with_the_remedy(cp, length):
    with pytest.raises(ValueError, match=rf"multiple of 2 x context-parallel size = {2 * cp}.*pad or trim"):
        context_parallel_shard(torch.zeros(1, length), 0, cp)
    with pytest.raises(ValueError, match="cp_rank=2 is not a rank"):
        context_parallel_shard(torch.zeros(1, 8), 2, 2)


@pytest.mark.parametrize("overrides, words", [
    (dict(mtp_num_layers=1), "multi-token prediction (mtp_num_layers=1)"),
    (dict(attention_dropout=0.1), "attention dropout (attention_dropout=0.1)"),
    (dict(seq_length=18), "seq_length=18 is not a multiple of 2 x context-parallel size = 4"),
])
def test_problems_name_the_feature_why_and_the_remedy(overrides, words):
    assert context_parallel_problems(GPTConfig(**LLAMA), 2) == []
    problems = context_parallel_problems(GPTConfig(**dict(LLAMA, **overrides)), 2)
    assert len(problems) == 1 and words in problems[0], problems


def test_moe_layers_are_told_the_cp_group():
    assert context_parallel_problems(GPTConfig(**dict(LLAMA, num_moe_experts=4, moe_router_topk=2)), 2) == []


# -- helpers ---------------------------------------------------------------------------------
def _two(cfg: GPTConfig) -> tuple[GPT, GPT]:
    """Two builds from one seed: the whole model (reference) and the one to parallelise."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg))
    return models[0], models[1]


def _batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of SEQ + 1 tokens and an uneven loss mask (b, SEQ): about a quarter of the
    labels masked, so the CP ranks of a sequence count different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.25).float()
    mask[:, :SEQ // 4] = 1.0  # rank 0's early chunk fully counted, the others not
    return tokens, mask


def _masked_mean(logits, labels, mask):
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum() / mask.sum()


def _cp_mesh(world: int, cp: int):
    """(dp, cp) mesh, CP ranks consecutive (rank = dp_rank x CP + cp_rank, Megatron-LM's order at TP 1)."""
    return init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _average_over(model, group, size) -> None:
    """What the engine does to the CP ranks' gradients: their mean."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(_local(p.grad), group=group)
            _local(p.grad).div_(size)


# -- the model alone -------------------------------------------------------------------------
class _Calls:
    """Counts the torch.distributed calls made while patched in."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_reduce", "all_gather", "broadcast", "send", "recv", "isend", "irecv")

    def __init__(self):
        self.calls: dict[str, int] = {}
        self._patches = [mock.patch.object(dist, name, self._wrap(name, getattr(dist, name)))
                         for name in self.NAMES if hasattr(dist, name)]

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    def __enter__(self):
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()


def model_parity_worker(rank, world, *, families, cp):
    """Per family: largest differences of the CP model's logits / loss / averaged gradients
    from the whole model's, its per-layer collective counts, and torch.distributed's calls."""
    mesh = _cp_mesh(world, cp)
    cp_rank, group = mesh.get_local_rank(), mesh.get_group()
    out = {}
    for family in families:
        cfg = GPTConfig(**FAMILIES[family])
        whole, model = _two(cfg)
        apply_context_parallel(model, mesh)
        tokens, mask = _batch(11, 2)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        ref_logits = whole(inputs)
        ref_loss = _masked_mean(ref_logits, labels, mask)
        ref_loss.backward()
        shard = lambda t: context_parallel_shard(t, cp_rank, cp)  # noqa: E731
        with _Calls() as seen:
            logits = model(shard(inputs))
            loss = context_parallel_loss(logits, shard(labels), group, shard(mask))
            loss.backward()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=group)  # the micro-batch's mean, times CP
        _average_over(model, group, cp)
        ref = dict(whole.named_parameters())
        out[family] = {
            "logits": (logits - shard(ref_logits)).abs().max().item(),
            "loss": abs(reported.item() / cp - ref_loss.item()),
            "grad": max((p.grad - ref[n].grad).abs().max().item() for n, p in model.named_parameters()),
            "counts": {name: (c.all_gathers, c.reduce_scatters, c.gathered_bytes, c.scattered_bytes)
                       for name, c in kv_exchange_counts(model).items()},
            "calls": seen.calls,
        }
    return out


def _kv_bytes(cfg: GPTConfig, batch: int) -> int:
    """Bytes of the whole sequence's exchanged K/V of one layer (fp32)."""
    if cfg.multi_latent_attention:
        per_token = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) + cfg.qk_pos_emb_head_dim
    else:
        per_token = 2 * cfg.num_query_groups * cfg.kv_channels
    return batch * SEQ * per_token * 4


def _check_model_parity(results, families, cp):
    for out in results:
        for family in families:
            got, cfg = out[family], GPTConfig(**FAMILIES[family])
            assert got["logits"] <= EXACT and got["loss"] <= EXACT and got["grad"] <= EXACT, (family, got)
            full = cfg.recompute_granularity is not None and cfg.recompute_granularity.value == "full"
            gathers = 2 if full else 1  # full recomputation replays the forward, gather included
            assert sorted(got["counts"]) == [f"blocks.{i}.attn" for i in range(cfg.num_layers)]
            size = _kv_bytes(cfg, 2)
            assert all(c == (gathers, 1, gathers * size, size) for c in got["counts"].values()), (family, got)
            # torch.distributed saw exactly those, and the loss's one all-reduce of the token count
            calls = got["calls"]
            assert calls.get("all_gather_single", 0) + calls.get("all_gather_into_tensor", 0) \
                == gathers * cfg.num_layers, calls
            assert calls.get("reduce_scatter_single", 0) + calls.get("reduce_scatter_tensor", 0) \
                == cfg.num_layers, calls
            assert calls.get("all_reduce") == 1, calls
            assert set(calls) <= {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                                  "reduce_scatter_tensor", "all_reduce"}, calls


def test_cp2_model_computes_what_the_whole_model_computes(pool2):
    families = sorted(FAMILIES)
    _check_model_parity(pool2.run(model_parity_worker, families=families, cp=2), families, 2)


def test_cp4_model_computes_what_the_whole_model_computes(pool4):
    families = ["llama", "gpt"] + (["mla_yarn", "qk_norm_gate_full_recompute"] if LONG else [])
    _check_model_parity(pool4.run(model_parity_worker, families=families, cp=4), families, 4)


# -- through megatron_fsdp -------------------------------------------------------------------
def _reference(model: GPT, data, optimizer: str, dp: int, per_token: bool) -> GPT:
    """One process, the whole model, the global batch: each data-parallel rank's micro-batch
    mean averaged (per_token: the global batch's token mean)."""
    opt = make_optimizer(optimizer)(model.parameters())
    for tokens, mask in data:
        opt.zero_grad()
        total = mask.sum()
        for share, share_mask in zip(tokens.chunk(dp), mask.chunk(dp)):
            for micro, micro_mask in zip(share.chunk(MICRO), share_mask.chunk(MICRO)):
                logits = model(micro[:, :-1])
                if per_token:
                    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), micro[:, 1:].reshape(-1),
                                                               reduction="none")
                    loss = (losses * micro_mask.reshape(-1)).sum() / total
                else:
                    loss = _masked_mean(logits, micro[:, 1:], micro_mask) / (MICRO * dp)
                loss.backward()
        opt.step()
    return model


def fsdp_parity_worker(rank, world, *, family, strategy, optimizer, per_token=False, meta=False):
    cp = 2
    dp, cfg = world // cp, GPTConfig(**FAMILIES[family])
    whole, model = _two(cfg)
    first_tokens = None
    data = [_batch(100 + step, dp * MICRO * PER_MICRO) for step in range(STEPS)]
    torch.manual_seed(0)
    initial = GPT(cfg)
    reference = _reference(whole, data, optimizer, dp, per_token)
    if meta:  # built on the meta device, CP applied there, materialised unit by unit by megatron_fsdp
        torch.manual_seed(0)  # the materialisation draws from the generator as the eager build did
        with torch.device("meta"):
            model = GPT(cfg)
    mesh = _cp_mesh(world, cp)
    cp_rank, group, dp_rank = mesh.get_local_rank(), mesh.get_group(), rank // cp
    apply_context_parallel(model, mesh)
    fsdp_model, opt = mf.fully_shard(model, make_optimizer(optimizer), fsdp_unit_modules=[TransformerBlock],
                                     zero_dp_strategy=strategy, calculate_per_token_loss=per_token,
                                     init_model_with_meta_device=meta)
    shard = lambda t: context_parallel_shard(t, cp_rank, cp)  # noqa: E731
    first, first_loss = {}, None
    for step, (tokens, mask) in enumerate(data):
        opt.zero_grad()
        micros = list(zip(tokens.chunk(dp)[dp_rank].chunk(MICRO), mask.chunk(dp)[dp_rank].chunk(MICRO)))
        count = torch.zeros((), dtype=torch.int64)
        for i, (micro, micro_mask) in enumerate(micros):
            inputs, labels, m = shard(micro[:, :-1]), shard(micro[:, 1:]), shard(micro_mask)
            with fsdp_model.no_sync() if i < MICRO - 1 else torch.enable_grad():
                logits = fsdp_model(inputs)
                if per_token:
                    loss, local_count = context_parallel_token_loss(logits, labels, m)
                    count += local_count
                else:
                    loss = context_parallel_loss(logits, labels, group, m) / MICRO
                loss.backward()
            if step == 0 and i == 0:
                first_tokens = micro
                first["logits"] = (logits.detach() - shard(initial(micro[:, :-1]))).abs().max().item()
                first_loss = loss.detach()
        if per_token:
            fsdp_model.finish_grad_sync()
            dist.all_reduce(count)  # the global batch's tokens: every data x context rank's
            for group_params in opt.param_groups:
                for p in group_params["params"]:
                    if p.grad is not None:
                        p.grad.div_(count.item())
        opt.step()
    first.update(_first_loss_diff(first_loss, initial, first_tokens, data[0][1].chunk(dp)[dp_rank],
                                  group, cp, per_token))
    counts = {(c.all_gathers, c.reduce_scatters) for c in kv_exchange_counts(fsdp_model).values()}
    return {"param": max_param_diff(mf.get_full_state_dict(fsdp_model), reference), **first, "counts": counts}


def _first_loss_diff(local, initial, micro, share_mask, group, cp, per_token) -> dict:
    """The first micro-batch's mean loss from the CP ranks' values vs the whole model's."""
    summed = local.clone()
    dist.all_reduce(summed, group=group)
    mask = share_mask.chunk(MICRO)[0]
    expected = _masked_mean(initial(micro[:, :-1]), micro[:, 1:], mask)
    got = summed / mask.sum() if per_token else summed * MICRO / cp
    return {"loss": abs(got.item() - expected.item())}


def _check_fsdp(results):
    for out in results:
        assert out["param"] <= TOL and out["logits"] <= EXACT and out["loss"] <= EXACT, out
        assert out["counts"] == {(STEPS * MICRO, STEPS * MICRO)}, out  # one gather and one scatter per micro-batch


DEFAULT_GRID = [  # (world, family, strategy, optimizer): 2-3 strategies, both optimizers, both families
    (2, "llama", "optim_grads_params", "adamw"),
    (2, "gpt", "no_shard", "sgd"),
    (2, "gpt", "optim", "adamw"),
    (4, "llama", "optim_grads", "sgd"),
    (4, "gpt", "optim_grads_params", "adamw"),
]
LONG_GRID = [(w, f, s, o) for w in (2, 4) for f in ("llama", "gpt")
             for s in ("no_shard", "optim", "optim_grads", "optim_grads_params") for o in ("sgd", "adamw")
             if (w, f, s, o) not in DEFAULT_GRID]
_LONG_ONLY = pytest.mark.skipif(not LONG, reason="the whole strategy grid: MFSDP_EPCP_LONG=1 (the suite's time budget)")


def _pool(request, world):
    return request.getfixturevalue(f"pool{world}")


@pytest.mark.parametrize("world, family, strategy, optimizer", DEFAULT_GRID + [
    pytest.param(*case, marks=_LONG_ONLY) for case in LONG_GRID])
def test_cp_through_fsdp_trains_like_one_process(request, world, family, strategy, optimizer):
    _check_fsdp(_pool(request, world).run(fsdp_parity_worker, family=family, strategy=strategy,
                                          optimizer=optimizer))


def test_cp_model_built_on_the_meta_device(pool4):
    _check_fsdp(pool4.run(fsdp_parity_worker, family="gpt", strategy="optim_grads_params", optimizer="adamw",
                          meta=True))


@pytest.mark.parametrize("world, family, strategy", [(4, "llama", "optim_grads_params")] + [
    pytest.param(w, f, s, marks=_LONG_ONLY) for w in (2, 4) for f in ("llama", "gpt")
    for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    if (w, f, s) != (4, "llama", "optim_grads_params")])
def test_per_token_loss_through_fsdp_trains_like_one_process(request, world, family, strategy):
    _check_fsdp(_pool(request, world).run(fsdp_parity_worker, family=family, strategy=strategy,
                                          optimizer="adamw", per_token=True))


# -- with tensor parallelism -------------------------------------------------------------------
def tp_cp_worker(rank, world, *, family, sp):
    """TP 2 x CP 2 (rank = cp_rank x TP + tp_rank), no FSDP: first-step logits and gradients,
    then weights after STEPS SGD steps, against the whole model."""
    cfg = GPTConfig(**FAMILIES[family])
    whole, model = _two(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sp)
    apply_context_parallel(model, mesh["cp"])
    cp_rank, group = mesh["cp"].get_local_rank(), mesh["cp"].get_group()
    shard = lambda t: context_parallel_shard(t, cp_rank, 2)  # noqa: E731
    ref_opt = torch.optim.SGD(whole.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref = dict(whole.named_parameters())
    out = {"logits": 0.0, "grad": 0.0}
    for step in range(STEPS):
        tokens, mask = _batch(200 + step, 2)
        ref_logits = whole(tokens[:, :-1])
        _masked_mean(ref_logits, tokens[:, 1:], mask).backward()
        logits = model(shard(tokens[:, :-1]))
        context_parallel_loss(logits, shard(tokens[:, 1:]), group, shard(mask)).backward()
        _average_over(model, group, 2)
        if step == 0:
            out["logits"] = (_full(logits) - shard(ref_logits)).abs().max().item()
            out["grad"] = max((_full(p.grad) - ref[n].grad).abs().max().item() for n, p in model.named_parameters())
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    out["weights"] = max((_full(p.detach()) - ref[n].detach()).abs().max().item() for n, p in model.named_parameters())
    out["sharded"] = isinstance(model.blocks[0].attn.qkv.weight, DTensor)
    return out


@pytest.mark.parametrize("family, sp", [("llama", False), ("gpt", True)] + [
    pytest.param("llama", True, marks=_LONG_ONLY), pytest.param("gpt", False, marks=_LONG_ONLY)])
def test_tp2_x_cp2_computes_what_the_whole_model_computes(pool4, family, sp):
    for out in pool4.run(tp_cp_worker, family=family, sp=sp):
        assert out["sharded"] and out["logits"] <= EXACT and out["grad"] <= EXACT and out["weights"] <= TOL, out


# -- refusals ----------------------------------------------------------------------------------
def refusal_worker(rank, world):
    mesh = _cp_mesh(world, 2)
    messages = {}

    def attempt(case, call):
        try:
            call()
        except (NotImplementedError, ValueError, TypeError) as exc:
            messages[case] = (type(exc).__name__, str(exc))

    refused = {"mtp": dict(LLAMA, mtp_num_layers=1), "dropout": dict(LLAMA, attention_dropout=0.1),
               "seq_length": dict(LLAMA, seq_length=18)}
    untouched = True
    for case, kwargs in refused.items():
        model = GPT(GPTConfig(**kwargs))
        attempt(case, lambda: apply_context_parallel(model, mesh))
        untouched &= model.context_parallel is None and all(b.attn.context_parallel is None for b in model.blocks)
    attempt("not_gpt", lambda: apply_context_parallel(torch.nn.Linear(2, 2), mesh))
    two_dims = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    attempt("two_dims", lambda: apply_context_parallel(GPT(GPTConfig(**LLAMA)), two_dims))
    model = apply_context_parallel(GPT(GPTConfig(**LLAMA)), mesh)
    attempt("twice", lambda: apply_context_parallel(model, mesh))
    attempt("odd_share", lambda: model(torch.zeros(1, 7, dtype=torch.long)))
    attempt("too_long", lambda: model(torch.zeros(1, SEQ, dtype=torch.long)))  # the whole sequence, not a share
    return messages, untouched


def test_refusals_say_what_why_and_the_remedy(pool2):
    for messages, untouched in pool2.run(refusal_worker):
        assert untouched, "a refused model was changed"
        assert messages["mtp"][0] == "NotImplementedError" and "at context-parallel size 1" in messages["mtp"][1]
        assert "set attention_dropout=0" in messages["dropout"][1]
        assert "seq_length=18 is not a multiple of 2 x context-parallel size = 4" in messages["seq_length"][1]
        assert messages["not_gpt"][0] == "TypeError"
        assert "pass the 1-D context-parallel sub-mesh" in messages["two_dims"][1]
        assert "apply it once" in messages["twice"][1]
        assert "an even number" in messages["odd_share"][1] and "context_parallel_shard" in messages["odd_share"][1]
        assert "sequence of 32 tokens (16 on each of 2 context-parallel ranks) exceeds seq_length=16" \
            in messages["too_long"][1]
