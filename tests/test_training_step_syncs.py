"""The launcher's iteration reads device values on the host once ([Note: one host
sync per iteration] in training_step.py): none per micro batch. On the CPU nothing
synchronises, so the test counts the host reads the training step itself makes
(``.tolist()``, ``.item()``, ``float()``/``int()``/``bool()`` of a tensor, ``.cpu()``),
which on CUDA are the syncs."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from megatron_fsdp.training.data import BatchLayout, MockDataset
from megatron_fsdp.training.optim.lr_schedule import LRDecayStyle, LRSchedule
from megatron_fsdp.training.model_setup import ModelBundle
from megatron_fsdp.training.training_step import NaNLossError, StepContext, TrainState, evaluate, train_step

STEP_FILE = sys.modules["megatron_fsdp.training.training_step"].__file__
READS = ("tolist", "item", "__float__", "__int__", "__bool__", "cpu")


@contextlib.contextmanager
def count_host_reads(files=(STEP_FILE,)):
    """Host reads of tensors made by the training step's own code, or by ``files`` (the
    data sources read host tensors of their own, which costs no sync)."""
    counts = {"n": 0, "sites": []}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def reader(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller in files:
                counts["n"] += 1
                counts["sites"].append(f"{name}@{os.path.basename(caller)}:{sys._getframe(1).f_lineno}")
            return fn(self, *args, **kwargs)

        return reader

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


class _Model(torch.nn.Sequential):
    def no_sync(self):  # what the training step asks of DDP and Megatron-FSDP models
        return contextlib.nullcontext()


def _context(num_microbatches: int, poison: dict):
    torch.manual_seed(0)
    model = _Model(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    def loss_fn(inputs, targets):
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1), reduction="sum")
        return (loss * float("nan") if poison.get("on") else loss), targets.numel()

    bundle = ModelBundle(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                         is_fsdp=False, num_parameters=0)
    schedule = LRSchedule(max_lr=1e-2, min_lr=0.0, warmup_steps=0, decay_steps=10, style=LRDecayStyle.CONSTANT)
    return StepContext(bundle=bundle, schedule=schedule, scaler=None, device=torch.device("cpu"), clip_grad=1.0,
                       layout=BatchLayout(micro_batch_size=2, num_microbatches=num_microbatches, dp_rank=0, dp_size=1),
                       per_token_loss=False, check_for_nan=True)


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_one_host_read_per_iteration(num_microbatches):
    ctx = _context(num_microbatches, {})
    source, state = MockDataset(16, 8, seed=1), TrainState()
    train_step(ctx, state, source)  # warm-up
    with count_host_reads() as reads:
        result = train_step(ctx, state, source)
    assert reads["n"] == 1, reads["sites"]
    assert result.grad_norm > 0 and result.lm_loss > 0
    with count_host_reads() as reads:
        evaluate(ctx, source, eval_iters=2)
    assert reads["n"] == 1, reads["sites"]


def test_nan_loss_raises_before_any_weight_changes():
    poison = {"on": True}
    ctx = _context(2, poison)
    before = [p.detach().clone() for p in ctx.bundle.model.parameters()]
    with pytest.raises(NaNLossError, match="2 micro batch loss"):
        train_step(ctx, TrainState(), MockDataset(16, 8, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(before, ctx.bundle.model.parameters()))


class _Tracker:
    """Stands in for models.mcore.McoreBalancingLoss: megatron-core's tracker adds
    each training forward's value; it must be cleared before every micro batch."""

    def __init__(self):
        self.values, self.events = 0.0, []

    def clear(self):
        self.values = 0.0
        self.events.append("clear")

    def set_moe_aux_loss_scale(self, scale):
        self.events.append("scale")

    def __call__(self):
        self.events.append("read")
        return torch.tensor(self.values)


def test_megatron_core_balancing_loss_is_read_per_micro_batch():
    ctx = _context(3, {})
    tracker = ctx.bundle.moe_balancing = _Tracker()
    forward = ctx.bundle.loss_fn

    def recording_loss_fn(inputs, targets):
        tracker.values += 1.5  # what megatron-core's routers record in a training forward
        return forward(inputs, targets)

    ctx.bundle.loss_fn = recording_loss_fn
    tracker.values = 100.0  # left over from an evaluation forward: must not leak in
    result = train_step(ctx, TrainState(), MockDataset(16, 8, seed=1))
    assert tracker.events == ["scale"] + ["clear", "read"] * 3  # megatron-core's aux-loss factor set first
    assert abs(result.load_balancing_loss - 1.5) < 1e-12  # mean over micro batches, one rank


class _MoEGPT:
    """The embedded MoE GPT as the training step drives it (no wrapper: no_sync is a no-op)."""

    @staticmethod
    def context(num_microbatches: int, aux_loss_coeff: float):
        from megatron_fsdp.models import GPT, GPTConfig

        class Model(GPT):
            def no_sync(self):
                return contextlib.nullcontext()

        torch.manual_seed(0)
        cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=16,
                        num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=aux_loss_coeff)
        model = Model(cfg)

        def loss_fn(inputs, targets):
            logits = model(inputs)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1),
                                                     reduction="sum"), targets.numel()

        bundle = ModelBundle(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             loss_fn=loss_fn, is_fsdp=False, num_parameters=0)
        schedule = LRSchedule(max_lr=1e-2, min_lr=0.0, warmup_steps=0, decay_steps=10, style=LRDecayStyle.CONSTANT)
        return StepContext(bundle=bundle, schedule=schedule, scaler=None, device=torch.device("cpu"), clip_grad=1.0,
                           layout=BatchLayout(micro_batch_size=2, num_microbatches=num_microbatches, dp_rank=0,
                                              dp_size=1), per_token_loss=False, check_for_nan=True, seq_length=8)


@pytest.mark.parametrize("aux_loss_coeff", [1e-2, 0.0])
def test_moe_balancing_loss_costs_no_host_read(aux_loss_coeff):
    """The embedded MoE GPT's logged balancing loss stays on the device (it used to be
    copied to the host every micro batch); with a zero coefficient nothing is recorded
    and nothing logged, as in Megatron-LM."""
    gpt_file = sys.modules["megatron_fsdp.models.gpt"].__file__
    ctx = _MoEGPT.context(3, aux_loss_coeff)
    source, state = MockDataset(16, 8, seed=1), TrainState()
    train_step(ctx, state, source)  # warm-up
    with count_host_reads(files=(STEP_FILE, gpt_file)) as reads:
        result = train_step(ctx, state, source)
    assert reads["n"] == 1, reads["sites"]
    if aux_loss_coeff:
        assert 0.9 < result.load_balancing_loss < 4
    else:
        assert result.load_balancing_loss is None
