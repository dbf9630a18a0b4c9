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
  replica) are refused, naming the fix (registered_params.py [Note: direct calls of the
  wrapped module]); the direct calls before any collective, with the weights, the
  optimizer state, the unit states and the buffers bit for bit unchanged, and training
  (an in-place edit included) going on exactly in every strategy. A unit called
  directly under no_shard, which hooks no unit, fails in DTensor instead. The
  functional_call refusal comes first in the wrapper's forward, before its first
  collective: an edit made after it reaches training (it was lost under ZeRO-1/2/3
  before the check moved there).

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
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint

import megatron_fsdp as mf
from megatron_fsdp.runtime.registered_params import direct_call_message
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
def _engine_state(model: nn.Module, opt) -> dict:
    """Everything a refused call must leave as it was, read without a collective or a
    side effect (a state-dict read would bring in edits): this rank's weights, the
    optimizer state, each unit's training state, and every parameter group's buffers
    (the compute weights' bucket status and local data, the main weights, the main
    gradients)."""
    weights = dict(model.named_parameters())
    buffers = [(g.index, g.model_weights.status, g.model_weights.data,
                g.main_weights.data if g.main_weights is not None else None,
                g.main_grads.data if g.main_grads is not None else None)
               for g in model.param_and_grad_buffer.groups]
    # opt.state_dict() would gather the full optimizer state: this rank's state instead.
    optimizer = [({k: v for k, v in g.items() if k != "params"}, [dict(opt.state[p]) for p in g["params"]])
                 for g in opt.param_groups]
    return _cloned({"weights": weights, "optimizer": optimizer,
                    "units": [(u.name, u.state) for u in model.units], "buffers": buffers})


def _cloned(obj):
    """Local copies (of a DTensor, this rank's part: no collective)."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _same(a, b) -> bool:
    """Bit for bit, through nested containers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _halve_weights(model: nn.Module) -> None:
    """An in-place edit between steps (as DDP users clip or re-initialise weights)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def refusal_worker(rank, world, *, strategy, order):
    """One training step on DDP and on the wrapper, then ``order``'s actions on the
    wrapper: "functional_call" (on other tensors), "module" (``model.module(x)``),
    "unit" (``model.module.blocks[1](h)``), each expected to be refused, or "edit" (on
    both models); then a second step. Per refused call: the exception (type name,
    message), the collectives it ran, which parts of the engine state (``_engine_state``)
    changed bit for bit; and the wrapper's largest difference from DDP at the end."""
    batches = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in make_batches("net", 2, batch=4 * world)]
    ddp = nn.parallel.DistributedDataParallel(_build(None))
    ddp_opt = _optimizer(ddp.parameters())
    model, opt = mf.fully_shard(_build(None), _optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    x, y = batches[0]
    ema = {n: torch.full_like(p, 0.01) for n, p in ddp.named_parameters()}
    with torch.no_grad():  # DDP runs its replica on the given tensors, and the module is a replica
        assert functional_call(ddp, ema, (x,)).abs().sum() > 0 and torch.allclose(ddp.module(x), ddp(x))
    _step("functional_call", ddp, ddp_opt, 0, x, y)
    _step("functional_call", model, opt, 0, x, y)
    # ZeRO-1/2 refresh the replicas after the step asynchronously: the states compared
    # below are only deterministic once that all-gather has landed.
    model.synchronize_param_gather()
    initial = _engine_state(model, opt)  # not vacuous: every parameter has AdamW state to compare
    assert all(state.keys() == {"step", "exp_avg", "exp_avg_sq"} for _, group in initial["optimizer"] for state in group)
    h = torch.randn(2, 7)
    calls = {"functional_call": lambda: functional_call(model, ema, (x,)), "module": lambda: model.module(x),
             "unit": lambda: model.module.blocks[1](h)}
    records = {}
    for action in order:
        if action == "edit":
            _halve_weights(ddp.module)
            _halve_weights(model)
            continue
        before = _engine_state(model, opt)
        with mf.record_collectives() as rec:
            try:
                calls[action]()
            except Exception as exc:  # the test asserts the type
                raised = (type(exc).__name__, str(exc))
            else:
                raised = ("no error", "")
        records[action] = {"raised": raised, "collectives": dict(rec.counts), "control": dict(rec.control),
                           "changed": [k for k, v in _engine_state(model, opt).items() if not _same(before[k], v)]}
    x, y = batches[1]
    _step("functional_call", ddp, ddp_opt, 1, x, y)
    _step("functional_call", model, opt, 1, x, y)
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ddp.module.named_parameters())
    return records, diff


def _check_direct_calls(strategy: str, records: dict) -> None:
    """model.module(x) and a unit called directly: refused (a unit under no_shard: see
    below) before any collective, with nothing changed."""
    module = records["module"]
    # The wrapped module's own pre-hook (registered_params.py), installed in every strategy.
    assert module["raised"] == ("RuntimeError", direct_call_message("Net(...), the wrapped module,")), module
    unit = records["unit"]
    if strategy == "no_shard":
        # no_shard units gather nothing, so the engine installs no hooks on them
        # (FSDPUnit.gathers; test_units.py) and nothing refuses the call: the block runs
        # on its replicated DTensor parameters until its first op (the LayerNorm) meets
        # the plain activation, where DTensor refuses the mix, still before any collective.
        assert unit["raised"][0] == "RuntimeError", unit
        assert unit["raised"][1].startswith("aten.native_layer_norm.default got mixed torch.Tensor and DTensor"), unit
    else:
        assert unit["raised"] == ("RuntimeError", direct_call_message("Block(...) in the unit blocks.1")), unit
    for record in (module, unit):
        # "before any gather": not even a bookkeeping (control) all-reduce, and no
        # weight, optimizer state, unit state or buffer (status, data) changed.
        assert record["collectives"] == {} and record["control"] == {}, record
        assert record["changed"] == [], record


def _check_functional_call(records: dict) -> None:
    raised = records["functional_call"]["raised"]
    assert raised[0] == "RuntimeError", raised
    assert raised[1].startswith("Linear.weight holds a tensor other than the parameter"), raised
    assert "functional_call" in raised[1] and "unwrapped copy" in raised[1], raised
    assert raised[1].endswith("No weight has changed"), raised


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_functional_call_on_other_tensors_and_direct_module_calls_are_refused(pool2, strategy):
    # The direct calls come between a step and an in-place edit: had they gathered or
    # disarmed the edit detection (weight_edits.py), the edit would be lost and the
    # second step would differ from DDP. functional_call comes after the edit here; the
    # test below puts the edit after it.
    order = ["module", "unit", "edit", "functional_call"]
    for records, diff in pool2.run(refusal_worker, strategy=strategy, order=order):
        _check_direct_calls(strategy, records)
        _check_functional_call(records)
        record = records["functional_call"]
        assert record["collectives"] == {} and record["control"] == {} and record["changed"] == [], record
        assert diff < TOL, diff


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])  # no_shard: the test above
def test_functional_call_on_other_tensors_is_refused_before_any_collective(pool2, strategy):
    """The refusal runs first in the wrapper's forward (param_swap.check_swappable): before
    it ran after the weight-edit refresh (ZeRO-1/2: a control all-reduce that disarmed the
    edit detection) and the root pre-forward (ZeRO-3: gathers left ready), and an in-place
    edit made after the refused call never reached training (1.6e-2 from DDP)."""
    for records, diff in pool2.run(refusal_worker, strategy=strategy, order=["functional_call", "edit"]):
        _check_functional_call(records)
        record = records["functional_call"]
        assert record["collectives"] == {} and record["control"] == {}, record
        assert record["changed"] == [], record
        assert diff < TOL, diff  # the edit after the refused call reaches training, as under DDP
