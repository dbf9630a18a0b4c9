"""The planner's peak (``tools/peak.py``) against the real peak of a CPU training step.

The real peak is glibc's bytes in use sampled after every aten operator
(``tools/peak_measure.py``, [Note: measuring a CPU peak]), above a baseline taken after a
warm-up step of the same shapes (the first step's one-off allocations: thread pools, the
gloo transport). It covers weights, gradients, AdamW state, the engine's buffers and the
activations, measured on the third step (steady state). The plan predicts it from the
model's structure and a fake-tensor trace of one microbatch; the two share no code but the
GPT itself. fp32 throughout (main weights and gradients in the compute dtype).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import megatron_fsdp as mf
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.tools.activation_trace import LiveBytes, run_microbatch, trace_activations
from megatron_fsdp.tools.peak import PeakOptions, estimate_peak
from megatron_fsdp.tools.peak_measure import baseline_bytes, peak_of_step
from megatron_fsdp.tools.plan import PlanRequest, make_plan

from conftest import get_pool

LONG = os.environ.get("MFSDP_PLAN_LONG") == "1"
TOL = 0.10
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TINY = dict(num_layers=3, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=2048)
SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=4096)
DEEP = dict(num_layers=8, hidden_size=192, num_attention_heads=4, seq_length=256, vocab_size=2048)


def _steps(cfg: GPTConfig, strategy: str, batch: int, rank: int, steps: int):
    """Build, run ``steps`` steps, return the last step's meter (AdamW's state exists from step 2)."""
    torch.manual_seed(0)
    model, opt = mf.fully_shard(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=g)
    meters = [peak_of_step(model, opt, tokens, measure_peak.baseline, model.finish_param_sync) for _ in range(steps)]
    measure_peak.accounting = dict(model.buffer_accounting.persistent), model.buffer_accounting.peak_temporary
    return meters[-1]


def measure_peak(rank, world, *, cfg, strategy, batch):
    """Per-phase measured bytes above the baseline, on this rank."""
    _steps(GPTConfig(**cfg), strategy, batch, rank, 1)  # warm-up: one-off allocations land before the baseline
    gc.collect()
    measure_peak.baseline = baseline_bytes()
    meter = _steps(GPTConfig(**cfg), strategy, batch, rank, 2)
    persistent, temporary = measure_peak.accounting
    return dict(meter.peaks), dict(persistent, peak_temporary=temporary)


measure_peak.baseline = 0


def predict(cfg: dict, strategy: str, world: int, batch: int):
    gpt = GPTConfig(**cfg)
    request = PlanRequest(model="test", gpt=gpt, world=world, strategy=strategy or "no_shard", dtype=torch.float32,
                          main_params_dtype=None, main_grads_dtype=None, micro_batch_size=batch)
    plan = make_plan(request)
    return estimate_peak(plan, PeakOptions(recompute=gpt.recompute))


def _check(cfg, strategy, world, batch):
    results = get_pool(world).run(measure_peak, cfg=cfg, strategy=strategy, batch=batch)
    measured = [peaks for peaks, _ in results]
    estimate = predict(cfg, strategy, world, batch)
    real = max(max(m.values()) for m in measured)
    print(f"{strategy} world={world} recompute={cfg.get('recompute', False)} b={batch} s={cfg['seq_length']}: "
          f"predicted {estimate.peak / 1e6:.2f} MB ({estimate.phase}), measured {real / 1e6:.2f} MB, "
          f"ratio {estimate.peak / real:.4f}; phases predicted "
          f"{ {k: round(v / 1e6, 2) for k, v in estimate.phases.items()} } measured "
          f"{ {k: round(v / 1e6, 2) for k, v in measured[0].items()} }; engine's accounting {results[0][1]}")
    assert abs(estimate.peak - real) <= TOL * real, (estimate.as_dict(), measured)
    return estimate, measured


def test_trace_counts_what_a_real_step_holds():
    """The fake-tensor trace equals the same counter on real tensors within 0.1% (a few
    scalars differ: 528 bytes of 760 KB here)."""
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)
    traced = trace_activations(cfg, torch.float32, 2)
    model = GPT(cfg)
    for p in model.parameters():  # as trace_activations: gradients dropped once accumulated
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    counter = LiveBytes()
    with counter:
        run_microbatch(model, torch.zeros(2, 33, dtype=torch.long), counter)
    phases = {"forward_blocks": "forward", "forward_head": "forward_head", "forward_end": "forward_end",
              "backward_head": "backward", "backward_blocks": "backward_blocks"}
    for field, phase in phases.items():
        fake, measured = getattr(traced, field), counter.peaks[phase]
        assert abs(fake - measured) <= 1e-3 * measured, (field, fake, measured)
    assert counter.live == 0  # every storage made in the step died with it


def test_recompute_keeps_less():
    plain = trace_activations(GPTConfig(**TINY), torch.float32, 2)
    recomputed = trace_activations(GPTConfig(**TINY, recompute=True), torch.float32, 2)
    assert recomputed.forward_end < plain.forward_end / 2
    assert plain.logits <= recomputed.forward_end  # the logits are kept either way


@pytest.mark.parametrize("strategy,world,recompute", [("optim_grads_params", 1, True), ("optim_grads_params", 2, False),
                                                     ("optim_grads", 2, True)])
def test_peak_within_10_percent(strategy, world, recompute):
    _check(dict(TINY, recompute=recompute), strategy, world, 2)


@pytest.mark.skipif(not LONG, reason="set MFSDP_PLAN_LONG=1 for the full grid (sizes, lengths, recompute)")
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("cfg,batch", [(SMALL, 4), (DEEP, 2), (dict(TINY, seq_length=512), 2)],
                         ids=["small", "deep", "long"])
def test_peak_grid(cfg, batch, world, strategy, recompute, request):
    if cfg is DEEP and world == 2 and strategy == "optim" and recompute:
        # Known gap: measured 86.17 MB against 72.54 predicted, all of it in the blocks' backward.
        # Under recomputation the unreduced parameter gradients that ZeRO-1 holds until a group's
        # reduction outgrow the (small) activations; the plan does not model that yet.
        request.applymarker(pytest.mark.xfail(strict=True, reason="ZeRO-1's unreduced gradients under recompute"))
    _check(dict(cfg, recompute=recompute), strategy, world, batch)


def test_offload_is_refused_until_built():
    with pytest.raises(NotImplementedError, match="offload"):
        PeakOptions(offload=True)
