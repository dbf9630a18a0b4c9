"""More PyTorch DDP/FSDP2 habits through megatron_fsdp, against DDP on the same
ranks (fp32, 1e-5 per parameter), or refused before any weight changes:

* ``torch.compile`` of units before wrapping, in place (``block.compile()``) or as an
  ``OptimizedModule``, under ZeRO-3 (the wrapper compiled whole: test_upstream_compile.py;
  ``aot_eager``, on units or the wrapper, matched DDP exactly in every strategy when
  probed, but warming AOT autograd up costs seconds).
* ``torch.nn.utils.parametrize``: ``parametrizations.weight_norm`` and
  ``spectral_norm`` (``parametrizations.weight.original0/1`` parameters, the
  power-iteration buffers), the legacy ``torch.nn.utils.weight_norm`` and a custom
  parametrization, all registered before wrapping.
* Activation checkpointing: ``checkpoint_wrapper`` with ``CheckpointImpl.REENTRANT``,
  ``apply_activation_checkpointing``, ``checkpoint(use_reentrant=True)`` around a
  unit, and one non-reentrant checkpoint around the whole forward (every unit
  boundary inside it).
* Module hooks users register before wrapping: full backward hooks and backward
  pre-hooks scaling gradients, forward (pre-)hooks editing activations, and
  ``register_post_accumulate_grad_hook``, which sees the local gradient as under DDP.
* Freezing a submodule mid-training (``module.requires_grad_(False)``) and back,
  against ``DDP(find_unused_parameters=True)``.
* ``torch.func.functional_call(model, dict(model.named_parameters()), x)`` trains as
  DDP; ``functional_call`` with other tensors and direct calls of the wrapped module
  or of a unit (``model.module(x)``, ``model.module.blocks[1](h)``: under DDP a
  replica) are refused, naming the fix, with the weights unchanged and training
  going on exactly (param_swap.py [Note: direct calls of the wrapped module]).

Not here: ``SyncBatchNorm`` needs a GPU (DDP refuses it on CPU at construction, its
forward raises on CPU under megatron_fsdp too); ``nn.Embedding(sparse=True)`` is in
test_patterns.py, tensor hooks in test_patterns_hooks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.func import functional_call
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint

import megatron_fsdp as mf
from models import IN, OUT, Block, make_batches

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5
STEPS = 4


def _plain_key(key: str) -> str:
    """State-dict keys as torch writes them for the plain module (a unit compiled to an
    ``OptimizedModule`` adds ``_orig_mod.``, as it does without megatron_fsdp)."""
    return key.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class Net(nn.Module):
    """Three residual blocks; ``recompute``: how block i's call is checkpointed."""

    def __init__(self, d: int = 7, recompute: dict[int, bool] | None = None, outer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.out = nn.Linear(d, OUT)
        self.recompute = recompute or {}  # block index -> use_reentrant
        self.outer = outer

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=self.recompute[i]) if i in self.recompute else block(h)
        return self.out(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False) if self.outer else self._forward(x)


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


# -- the models, built the same on DDP and megatron_fsdp (seeded per build) ------------------
class SquareNet(Net):
    """Net with a square layer after the input (room for a symmetric parametrization)."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(7, 7)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._blocks_and_out(self.square(self.inp(x)))

    def _blocks_and_out(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _parametrized() -> Net:
    net = SquareNet()
    parametrizations.weight_norm(net.blocks[0].fc1)
    parametrizations.weight_norm(net.out)
    parametrizations.spectral_norm(net.blocks[1].fc1)
    parametrizations.spectral_norm(net.inp)
    torch.nn.utils.weight_norm(net.blocks[2].fc1)  # legacy: weight_g/weight_v and a pre-hook
    parametrize.register_parametrization(net.square, "weight", Symmetric())
    parametrize.register_parametrization(net.blocks[0].fc2, "bias", nn.Tanh())
    return net


def _compiled_units() -> Net:
    net = Net()
    net.blocks[0].compile(backend="eager")  # in place: still a Block
    net.blocks[1] = torch.compile(net.blocks[1], backend="eager")  # an OptimizedModule around a Block
    return net


def _recompute_variants() -> Net:
    net = Net(recompute={1: True})  # checkpoint(use_reentrant=True) around a unit's call
    net.blocks[0] = checkpoint_wrapper(net.blocks[0], checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(net, check_fn=lambda m: m is net.blocks[2])
    return net


def _hooked() -> Net:
    net = Net()
    net.blocks[0].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
    net.blocks[1].register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 2.0,))
    net.blocks[2].register_forward_pre_hook(lambda m, args: (args[0] * 0.9,))
    net.blocks[2].register_forward_hook(lambda m, args, out: out * 1.1)
    return net


BUILDS = {
    "compiled": _compiled_units, "parametrized": _parametrized, "recompute_variants": _recompute_variants,
    "outer_checkpoint": lambda: Net(outer=True), "module_hooks": _hooked, "freeze_submodule": Net,
}


def _build(habit: str | None) -> Net:
    """The habit's model (``None``: the plain Net), the same on every call."""
    torch.manual_seed(0)
    return BUILDS[habit]() if habit else Net()


def _step(habit: str, model: nn.Module, opt, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the user's loop on ``model``, DDP or the wrapper."""
    if habit == "freeze_submodule" and step in (1, 3):
        model.module.blocks[0].requires_grad_(step == 3)  # frozen for steps 1-2
    opt.zero_grad()
    if habit == "functional_call":
        out = functional_call(model, dict(model.named_parameters()), (x,))
    else:
        out = model(x)
    F.mse_loss(out, y).backward()
    opt.step()


def _optimizer(params):
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def _post_accumulate_recorder(module: nn.Module) -> list:
    """Every parameter's gradient sum as a post-accumulate-grad hook sees it."""
    seen: list = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append((name, p.grad.double().sum().item())))
    return seen


def parity_worker(rank, world, *, habit):
    """{strategy: max parameter (and float buffer) difference from DDP}, plus, for
    module_hooks, whether the post-accumulate-grad hooks saw what DDP's saw."""
    torch._dynamo.reset()
    batches = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in make_batches("net", STEPS, batch=4 * world)]
    # The eager backend computes what eager mode does: the compiled habit's reference is eager DDP.
    module = _build(None if habit == "compiled" else habit)
    ddp_seen = _post_accumulate_recorder(module) if habit == "module_hooks" else None
    ddp = nn.parallel.DistributedDataParallel(module, find_unused_parameters=habit == "freeze_submodule")
    ddp_opt = _optimizer(ddp.parameters())
    for step, (x, y) in enumerate(batches):
        _step(habit, ddp, ddp_opt, step, x, y)
    reference = {_plain_key(k): v for k, v in ddp.module.state_dict().items() if v.is_floating_point()}
    results = {}
    # Tracing costs about a second per model: the compiled habit runs ZeRO-3 only, whose
    # hooks gather and release storage (all four strategies matched DDP when probed).
    for strategy in ["optim_grads_params"] if habit == "compiled" else STRATEGIES:
        module = _build(habit)
        seen = _post_accumulate_recorder(module) if habit == "module_hooks" else None
        model, opt = mf.fully_shard(module, _optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        for step, (x, y) in enumerate(batches):
            _step(habit, model, opt, step, x, y)
        model.finish_param_sync()
        full = {_plain_key(k): v for k, v in mf.get_full_state_dict(model).items()}
        assert set(reference) <= set(full), sorted(set(reference) - set(full))
        results[strategy] = max((full[k] - v).abs().max().item() for k, v in reference.items())
        if seen is not None:
            same = [n for n, _ in seen] == [n for n, _ in ddp_seen]
            results[strategy + ":post_accumulate"] = max(abs(a[1] - b[1]) for a, b in zip(seen, ddp_seen)) if same else 1.0
    return results


@pytest.mark.parametrize("habit", list(BUILDS))
def test_habit_trains_like_ddp(pool2, habit):
    for results in pool2.run(parity_worker, habit=habit):
        assert max(results.values()) < TOL, results


# -- refusals ------------------------------------------------------------------------------
def refusal_worker(rank, world, *, strategy):
    """functional_call with other tensors, model.module(x), a unit called directly: each
    refused with its remedy and no weight changed; then DDP-equal training goes on."""
    batches = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in make_batches("net", 2, batch=4 * world)]
    ddp = nn.parallel.DistributedDataParallel(_build(None))
    model, opt = mf.fully_shard(_build(None), _optimizer, fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    x = batches[0][0]
    ema = {n: torch.full_like(p, 0.01) for n, p in ddp.named_parameters()}
    with torch.no_grad():  # DDP runs its replica on the given tensors, and the module is a replica
        assert functional_call(ddp, ema, (x,)).abs().sum() > 0 and torch.allclose(ddp.module(x), ddp(x))
    before = mf.get_full_state_dict(model)
    messages = []
    h = torch.randn(2, 7)
    for call in (lambda: functional_call(model, ema, (x,)), lambda: model.module(x), lambda: model.module.blocks[1](h)):
        try:
            call()
        except RuntimeError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    after = mf.get_full_state_dict(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    ddp_opt = _optimizer(ddp.parameters())
    for step, (x, y) in enumerate(batches):
        _step("functional_call", ddp, ddp_opt, step, x, y)
        _step("functional_call", model, opt, step, x, y)
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ddp.module.named_parameters())
    return messages, unchanged, diff


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_functional_call_on_other_tensors_and_direct_module_calls_are_refused(pool2, strategy):
    for (swapped, direct, unit), unchanged, diff in pool2.run(refusal_worker, strategy=strategy):
        assert "Linear.weight holds a tensor other than the parameter" in swapped, swapped
        assert "functional_call" in swapped and "unwrapped copy" in swapped, swapped
        assert "Net(...), the wrapped module, was called directly" in direct and "Call the wrapper" in direct, direct
        if strategy == "no_shard":  # its units have no hooks (test_units.py): DTensor refuses the call
            assert unit != "no error"
        else:
            assert "Block(...) in the unit blocks.1 was called directly" in unit, unit
        assert unchanged and diff < TOL, (unchanged, diff)
