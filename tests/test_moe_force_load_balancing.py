"""``--moe-router-force-load-balancing`` (models/forced_routing.py) against megatron-core
0.16.1's own routers (``moe_utils.RandomSTE`` inside ``TopKRouter.forward``).

Same weights, same stream state (megatron-core's expert-parallel tracker stream and ours,
both seed + 1024), a 2-layer GPT on both ranks of a 2-rank gloo pool, two training micro
batches of 3 sequences each (so the (sequence, batch) order of the draws matters, and
each layer and forward advances the one shared stream): per layer and micro batch the
chosen experts are megatron-core's and the routing weights equal to 1e-6; the model's
gradients (straight through the noise into the gating weights) and expert counts equal;
the noise is the same on both data-parallel ranks (as megatron-core's at expert-parallel
size 1). One case runs both models with full recomputation, which must replay the noise.
megatron-core's CUDA RNG tracker runs on CPU generator states here (mcore_cpu_shim): a
fork of it draws exactly what our CPU generator draws.
"""

from __future__ import annotations

import shlex

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from mcore_parity import mcore_device  # noqa: E402
from megatron_fsdp.models import GPT, GPTConfig, gpt_loss  # noqa: E402

SEQ, BATCH, HIDDEN, EXPERTS, SEED = 8, 3, 32, 8, 1234
MODEL = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=64, swiglu=True,
             ffn_hidden_size=24, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
             num_moe_experts=EXPERTS, moe_router_topk=2, moe_router_force_load_balancing=True)
CASES = {
    # DeepSeek-V3's router: sigmoid, expert bias, group-limited, scaled, sequence aux loss.
    "deepseek": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4,
                     moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=1e-2,
                     moe_router_load_balancing_type="seq_aux_loss"),
    "softmax_aux_loss_recompute": dict(moe_aux_loss_coeff=0.05, recompute_granularity="full",
                                       recompute_method="uniform", recompute_num_layers=1),
}


def _reseed_megatron_tracker(seed: int) -> None:
    """Every stream of megatron-core's tracker back to its seed (building the model drew
    the expert weights from the expert-parallel stream)."""
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from mcore_cpu_shim import seed_rng_tracker

        seed_rng_tracker(seed)


def _capture_routing(ours: GPT, theirs) -> tuple[list, list]:
    """Forward hooks recording each layer's routing, in forward order: ours as dense (n, E)
    weights in megatron-core's sequence-major rows, theirs as its (probs, routing_map)."""
    mine, their = [], []

    def our_hook(router, args, noise):
        layer = next(m for m in ours.moe_layers() if m.router is router)
        with torch.no_grad():
            probs, indices = layer.routing(noise)
            dense = torch.zeros(noise.shape, dtype=probs.dtype, device=noise.device).scatter(1, indices, probs)
            real, _ = layer.routing(router.gating(args[0]))  # what the logits would have chosen
        mine.append((dense.view(BATCH, SEQ, -1).transpose(0, 1).reshape(-1, EXPERTS), noise.detach().clone(),
                     bool(torch.equal(probs, real))))

    for layer in ours.moe_layers():
        layer.router.register_forward_hook(our_hook)
    for layer in theirs.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda m, a, out: their.append(tuple(t.detach() for t in out)))
    return mine, their


def force_parity_worker(rank, world, *, name):
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from megatron_fsdp.models.mcore import build_mcore_gpt, to_mcore_state_dict
    from test_models_mcore import _mcore_on_cpu

    cfg = GPTConfig(**{**MODEL, **CASES[name]})
    device = mcore_device()
    torch.manual_seed(SEED)  # our stream: SEED + 1024, megatron-core's expert-parallel seed
    ours = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    batches = [torch.randint(0, 64, (BATCH, SEQ + 1), generator=gen).to(device) for _ in range(2)]
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, SEQ)
    out = dict(routing=[], loss=[])
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True).to(device)
        theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        out["their_flag"] = theirs.config.moe_router_force_load_balancing
        _reseed_megatron_tracker(SEED)
        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
        mine, their = _capture_routing(ours, theirs)
        ours.train(), theirs.train()
        for tokens in batches:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            loss_ours = gpt_loss(ours(inputs), targets)
            loss_theirs = theirs(inputs, positions, None, labels=targets).mean()
            loss_ours.backward(), loss_theirs.backward()
            out["loss"].append(abs(loss_ours.item() - loss_theirs.item()))
        for (dense, _, same_as_logits), (probs, routing_map) in zip(mine, their, strict=True):
            out["routing"].append((bool(torch.equal(dense != 0, routing_map)),
                                   (dense.double() - probs.double()).abs().max().item(), same_as_logits))
        our_grads = to_mcore_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)
        out["grad_diff"] = max((our_grads[n] - p.grad).abs().max().item() for n, p in theirs.named_parameters())
        out["router_grad"] = min(layer.router.weight.grad.abs().sum().item() for layer in ours.moe_layers())
        if cfg.moe_router_enable_expert_bias:
            out["counts_equal"] = all(
                torch.equal(a.router.local_tokens_per_expert, b.mlp.router.local_tokens_per_expert)
                for a, b in zip(ours.moe_layers(), theirs.decoder.layers, strict=True))
    noise = mine[0][1]  # layer 0, micro batch 0: the same draw on every rank
    gathered = [torch.zeros_like(noise) for _ in range(world)]
    dist.all_gather(gathered, noise)
    out["same_noise_on_ranks"] = all(torch.equal(g, noise) for g in gathered)
    out["forwards"] = len(mine)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_forced_routing_is_megatron_cores(pool2, name):
    for result in pool2.run(force_parity_worker, name=name):
        # 2 layers x 2 micro batches, and again in backward when recomputed (both models, in the same order)
        recomputed = 2 if CASES[name].get("recompute_granularity") else 1
        assert result["their_flag"] is True and result["forwards"] == 2 * 2 * recomputed, result
        for same_experts, prob_diff, same_as_logits in result["routing"]:
            assert same_experts and prob_diff < 1e-6, result["routing"]
            assert not same_as_logits  # the noise, not the logits, chose the experts
        assert max(result["loss"]) < 1e-5 and result["grad_diff"] < 1e-6, result
        assert result["router_grad"] > 0  # the gradient reached the gating weights through the noise
        assert result["same_noise_on_ranks"]
        if "counts_equal" in result:
            assert result["counts_equal"]


# -- in plain pytest -----------------------------------------------------------------------------
def _grads_of_two_micro_batches(cfg: GPTConfig) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(SEED)
    model = GPT(cfg)
    tokens = torch.randint(0, 64, (2, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    default_rng = torch.get_rng_state()
    for batch in tokens:
        gpt_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
    assert torch.equal(torch.get_rng_state(), default_rng)  # the noise has its own stream, as megatron-core's fork
    return {n: p.grad for n, p in model.named_parameters()}, model.blocks[1].mlp.router.local_tokens_per_expert


def test_full_recomputation_replays_the_noise():
    """Checkpointed blocks recompute their forward in backward: the same noise, hence the
    same routing and bit-identical gradients (and tokens counted once)."""
    deepseek = dict(MODEL, **CASES["deepseek"])
    plain, plain_counts = _grads_of_two_micro_batches(GPTConfig(**deepseek))
    recomputed, recomputed_counts = _grads_of_two_micro_batches(
        GPTConfig(**deepseek, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    assert all(torch.equal(plain[n], recomputed[n]) for n in plain)
    assert torch.equal(plain_counts, recomputed_counts) and plain_counts.sum() == 2 * BATCH * SEQ * 4


def test_flag_reaches_the_model_and_shares_one_stream():
    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
             "--micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 64 --num-experts 4 --moe-router-force-load-balancing")
    cfg = gpt_config_from_args(parse_args(shlex.split(flags), world_size=1))
    assert cfg.moe_router_force_load_balancing
    torch.manual_seed(7)
    model = GPT(cfg)
    streams = {id(layer.router.forced_routing) for layer in model.moe_layers()}
    assert len(streams) == 1 and model.forced_routing.seed == 7 + 1024
    assert GPT(GPTConfig(**{**MODEL, "moe_router_force_load_balancing": False})).forced_routing is None
