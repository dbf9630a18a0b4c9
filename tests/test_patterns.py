"""Ordinary PyTorch training patterns through megatron_fsdp equal single-process
training on the global batch (fp32, 1e-5), or raise a clear error before any
weight changes (issue 14).

Every pattern runs the same user loop twice: on the wrapped model (each rank its
share of the batch) and on a plain copy (the whole batch, one process), and
compares every parameter.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import megatron_fsdp as mf
from models import Block, SkipNet, StructuredBlock, add_decay_into_grads, loss_fn, make_batches, structured_case

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5


def _optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1)


# -- the user loops -------------------------------------------------------------------
# Each takes (model, opt, step, batch, ctx): ``model`` is the wrapped model or the plain
# reference, ``batch`` this process's share (the whole batch for the reference), ``ctx``
# says which ranks' shares make up ``batch`` (the reference: all of them).
class Ctx:
    def __init__(self, rank, world, reference):
        self.rank, self.world, self.reference = rank, world, reference

    def module(self, model):
        return model if self.reference else model.module

    def ranks(self):
        return range(self.world) if self.reference else [self.rank]

    def shares(self, x, y):
        """(rank, x, y) of each rank whose share this process computes."""
        xs, ys = x.chunk(self.world), y.chunk(self.world)
        return [(r, xs[r], ys[r]) for r in self.ranks()]


def _loss(model, ctx, x, y, skip_of=None):
    """Mean over the ranks' losses (each rank's mean loss: what averaging gradients gives)."""
    total = 0.0
    for r, xr, yr in ctx.shares(x, y):
        if skip_of is not None:
            ctx.module(model).skip = skip_of(r)
        total = total + loss_fn("net", model(xr), yr)
    return total / len(ctx.ranks())


def loop_plain(model, opt, step, x, y, ctx):
    opt.zero_grad()
    _loss(model, ctx, x, y).backward()
    opt.step()


def loop_skip_some_steps(model, opt, step, x, y, ctx):
    """Block 1 skipped on odd steps (every rank): its parameters get no gradient."""
    opt.zero_grad()
    _loss(model, ctx, x, y, skip_of=lambda r: {1} if step % 2 else set()).backward()
    opt.step()


def loop_rank_skip(model, opt, step, x, y, ctx):
    """Layer drop that differs per rank and per step (rank r skips block (r + step) % 4:
    block 3 does not exist, so some ranks skip nothing)."""
    opt.zero_grad()
    _loss(model, ctx, x, y, skip_of=lambda r: {(r + step) % 4}).backward()
    opt.step()


def loop_model_zero_grad(model, opt, step, x, y, ctx):
    model.zero_grad()
    _loss(model, ctx, x, y).backward()
    opt.step()


def loop_no_sync_free_accumulation(model, opt, step, x, y, ctx):
    """Two microbatches, each a plain synced backward (no no_sync)."""
    opt.zero_grad()
    for half in (0, 1):
        parts = [(xr.chunk(2)[half], yr.chunk(2)[half]) for _, xr, yr in ctx.shares(x, y)]
        loss = sum(loss_fn("net", model(xp), yp) for xp, yp in parts) / len(parts)
        (loss / 2).backward()
    opt.step()


def loop_requires_gradient_sync(model, opt, step, x, y, ctx):
    """FSDP2's accumulation switch: two microbatches, the first with gradient sync off."""
    opt.zero_grad()
    for half in (0, 1):
        if not ctx.reference:
            model.set_requires_gradient_sync(half == 1)
        parts = [(xr.chunk(2)[half], yr.chunk(2)[half]) for _, xr, yr in ctx.shares(x, y)]
        loss = sum(loss_fn("net", model(xp), yp) for xp, yp in parts) / len(parts)
        (loss / 2).backward()
    opt.step()


def loop_retain_graph(model, opt, step, x, y, ctx):
    opt.zero_grad()
    loss = _loss(model, ctx, x, y)
    (loss * 0.25).backward(retain_graph=True)
    (loss * 0.75).backward()
    opt.step()


def loop_input_gradient_penalty(model, opt, step, x, y, ctx):
    """A gradient penalty through the inputs (WGAN-GP, R1): autograd.grad with
    create_graph=True, then one backward of loss + penalty ([Note: higher-order
    gradients]: ZeRO-3 failed in torch with "storage of size 0")."""
    opt.zero_grad()
    total = 0.0
    for _, xr, yr in ctx.shares(x, y):
        xr = xr.clone().requires_grad_(True)
        out = model(xr)
        (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        total = total + loss_fn("net", out, yr) + 0.1 * gx.pow(2).mean()
    (total / len(ctx.ranks())).backward()
    opt.step()


def loop_closure(model, opt, step, x, y, ctx):
    def closure():
        opt.zero_grad()
        loss = _loss(model, ctx, x, y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and torch.isfinite(loss)


def loop_inplace_edit(model, opt, step, x, y, ctx):
    """Weight clipping and a pull towards zero after every step, through model.parameters()."""
    loop_plain(model, opt, step, x, y, ctx)
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.25, 0.25)
            p.mul_(0.9)


def loop_freeze_toggle(model, opt, step, x, y, ctx):
    """Step 1: freeze blocks.0 through the optimizer's parameters; step 2: unfreeze it
    through the module; step 2 also unfreezes blocks.2.fc2.weight, frozen before
    wrapping, whose bias stays frozen (a group frozen at wrapping, partly unfrozen)."""
    params = dict(model.named_parameters())
    module_params = dict(ctx.module(model).named_parameters())
    if step == 1:
        for name in ("blocks.0.fc1.weight", "blocks.0.fc1.bias"):
            params[name].requires_grad_(False)
    if step == 2:
        for name in ("blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.2.fc2.weight"):
            module_params[name].requires_grad_(True)
    loop_plain(model, opt, step, x, y, ctx)


def freeze_before_wrapping(module):
    for p in module.blocks[2].fc2.parameters():
        p.requires_grad_(False)


def loop_two_forwards(model, opt, step, x, y, ctx):
    """Two forwards, one backward (a two-view loss: f(model(a)) + f(model(b)))."""
    opt.zero_grad()
    total = 0.0
    for _, xr, yr in ctx.shares(x, y):
        (xa, xb), (ya, yb) = xr.chunk(2), yr.chunk(2)
        total = total + (loss_fn("net", model(xa), ya) + loss_fn("net", model(xb), yb)) / 2
    (total / len(ctx.ranks())).backward()
    opt.step()


def loop_two_forwards_rank_skip(model, opt, step, x, y, ctx):
    """Two forwards, one backward, each forward dropping a block that depends on the
    rank, the step and the forward ([Note: several forwards, one backward] with
    [Note: one unit sequence on every rank])."""
    opt.zero_grad()
    total = 0.0
    for r, xr, yr in ctx.shares(x, y):
        (xa, xb), (ya, yb) = xr.chunk(2), yr.chunk(2)
        for view, (xv, yv) in enumerate(((xa, ya), (xb, yb))):
            ctx.module(model).skip = {(r + step + view) % 4}
            total = total + loss_fn("net", model(xv), yv) / 2
    (total / len(ctx.ranks())).backward()
    opt.step()


def loop_grad_written_before_backward(model, opt, step, x, y, ctx):
    """Zeroed gradients that stay attached (``zero_grad(set_to_none=False)``; the
    wrapped model on odd steps: Megatron's ``zero_grad_buffer()``) take a hand-written
    decay term before backward, and backward accumulates on it, as in plain PyTorch."""
    if step % 2 and not ctx.reference:
        model.zero_grad_buffer()
    else:
        opt.zero_grad(set_to_none=False)
    add_decay_into_grads(model)
    _loss(model, ctx, x, y).backward()
    opt.step()


LOOPS = {
    "plain": loop_plain,
    "skip_some_steps": loop_skip_some_steps,
    "rank_skip": loop_rank_skip,
    "model_zero_grad": loop_model_zero_grad,
    "microbatches_without_no_sync": loop_no_sync_free_accumulation,
    "requires_gradient_sync": loop_requires_gradient_sync,
    "retain_graph_twice": loop_retain_graph,
    "input_gradient_penalty": loop_input_gradient_penalty,
    "closure": loop_closure,
    "inplace_edit": loop_inplace_edit,
    "freeze_toggle": loop_freeze_toggle,
    "two_forwards": loop_two_forwards,
    "two_forwards_rank_skip": loop_two_forwards_rank_skip,
    "grad_written_before_backward": loop_grad_written_before_backward,
}


def pattern_worker(rank, world, *, strategy, loop, optimizer="adamw", steps=4, units=True, overlap=True):
    torch.manual_seed(0)
    base = SkipNet()
    if loop == "freeze_toggle":
        freeze_before_wrapping(base)
    batches = make_batches("net", steps, batch=4 * world)
    run = LOOPS[loop]

    reference = copy.deepcopy(base)
    ref_opt = _optimizer(optimizer, reference.parameters())
    for step, (x, y) in enumerate(batches):
        run(reference, ref_opt, step, x, y, Ctx(rank, world, reference=True))

    model, opt = mf.fully_shard(
        base, lambda params: _optimizer(optimizer, params), fsdp_unit_modules=[Block] if units else None,
        zero_dp_strategy=strategy, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
    )
    stray = []
    for step, (x, y) in enumerate(batches):
        run(model, opt, step, x, y, Ctx(rank, world, reference=False))
        stray += [n for n, p in model.module.named_parameters() if not p.requires_grad and p.grad is not None]
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    unused_grad = dict(model.named_parameters())["unused.weight"].grad
    return diff, unused_grad is None, stray


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unused_parameters_keep_grad_none(pool2, strategy, optimizer):
    """Item 1: a block skipped on some steps and a head never used do not move
    (weight decay, momentum), as in single-process training and DDP."""
    for diff, unused_none, _ in pool2.run(pattern_worker, strategy=strategy, loop="skip_some_steps", optimizer=optimizer):
        assert diff < TOL and unused_none


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requires_grad_toggled(pool2, strategy):
    """Item 2: freezing through model.parameters(), unfreezing through the module, and
    unfreezing a parameter frozen before wrapping behave as in single-process training."""
    for diff, _, stray in pool2.run(pattern_worker, strategy=strategy, loop="freeze_toggle"):
        assert diff < TOL and not stray, (diff, stray)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_dependent_graph(pool, strategy, overlap):
    """Item 3: ranks skipping different blocks issue the same collectives in the same
    order; the result equals the single process averaging the ranks' losses."""
    for diff, _, _ in pool.run(pattern_worker, strategy=strategy, loop="rank_skip", overlap=overlap):
        assert diff < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "loop", ["model_zero_grad", "microbatches_without_no_sync", "retain_graph_twice", "closure", "inplace_edit",
             "grad_written_before_backward", "requires_gradient_sync", "input_gradient_penalty"]
)
def test_training_patterns(pool2, strategy, loop):
    """Items 4-7: model.zero_grad(), reducing twice without zeroing, step(closure),
    in-place edits of model.parameters() after a step; gradients written into before
    backward (zero_grad(set_to_none=False))."""
    for diff, _, _ in pool2.run(pattern_worker, strategy=strategy, loop=loop):
        assert diff < TOL, diff


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_forwards_one_backward(pool2, strategy):
    """A parameter's gradient arrives once, summed over both forwards. ZeRO-3 used to
    refuse (it released each unit when the backward walk passed it, before the other
    forward's backward used it again); it now keeps units gathered until their
    gradients are complete ([Note: several forwards, one backward])."""
    for diff, _, _ in pool2.run(pattern_worker, strategy=strategy, loop="two_forwards"):
        assert diff < TOL, diff


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_two_forwards_with_rank_dependent_graphs(pool4, strategy, overlap):
    for diff, _, _ in pool4.run(pattern_worker, strategy=strategy, loop="two_forwards_rank_skip", overlap=overlap):
        assert diff < TOL, diff


class SharedBlockNet(torch.nn.Module):
    """Block 0 runs twice per forward, with block 1 between (weights shared across layers)."""

    def __init__(self, d: int = 7):
        super().__init__()
        self.inp = torch.nn.Linear(5, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(3))
        self.out = torch.nn.Linear(d, 3)

    def forward(self, x):
        h = self.blocks[0](self.inp(x))
        h = self.blocks[0](self.blocks[1](h))
        return self.out(self.blocks[2](h))


def wrapped_with_reference(base_class, strategy, optimizer="adamw"):
    """A seeded model wrapped with ``strategy`` and its plain copy: (model, opt,
    reference, reference optimizer)."""
    torch.manual_seed(0)
    base = base_class()
    reference = copy.deepcopy(base)
    model, opt = mf.fully_shard(base, lambda params: _optimizer(optimizer, params), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    return model, opt, reference, _optimizer(optimizer, reference.parameters())


def shared_block_worker(rank, world, *, strategy, discarded_forward):
    """Shared-weight layers, and optionally a training-mode forward whose output is
    discarded before each step's forward (a logging habit): equal to one process."""
    model, opt, reference, ref_opt = wrapped_with_reference(SharedBlockNet, strategy)
    for x, y in make_batches("net", 3, batch=4 * world):
        ref_opt.zero_grad()
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if discarded_forward:
            model(xs).sum()  # grad-enabled, never backpropagated
        loss_fn("net", model(xs), ys).backward()
        opt.step()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("discarded_forward", [False, True], ids=["shared", "shared+discarded"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unit_called_twice_in_one_forward(pool2, strategy, discarded_forward):
    for diff in pool2.run(shared_block_worker, strategy=strategy, discarded_forward=discarded_forward):
        assert diff < TOL, diff


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_inplace_edit_world4(pool4, strategy):
    for diff, _, _ in pool4.run(pattern_worker, strategy=strategy, loop="inplace_edit"):
        assert diff < TOL, diff


def test_weight_edit_check_compares_bits():
    """The in-place-edit check (megatron_fsdp.py) compares bits: a NaN weight left as
    it was is not an edit (a value compare would re-gather it every step), and a
    write of -0.0 over 0.0 is one."""
    from megatron_fsdp.runtime.weight_edits import bits_differ as _bits_differ

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a = torch.tensor([1.0, float("nan"), 0.0], dtype=dtype)
        assert not bool(_bits_differ(a, a.clone()))
        assert bool(_bits_differ(a, torch.tensor([1.0, float("nan"), -0.0], dtype=dtype)))
        assert bool(_bits_differ(a, torch.tensor([1.5, float("nan"), 0.0], dtype=dtype)))


def test_unit_walk_visits_skipped_units_in_order():
    """[Note: one unit sequence on every rank], as pure bookkeeping."""
    from megatron_fsdp.runtime.unit_schedule import UnitWalk, merge_order

    walk = UnitWalk(["a", "b", "c", "d"])
    assert walk.catch_up("c") == ["a", "b"]
    assert walk.catch_up("c") == []  # a unit run twice needs no catching up
    assert walk.remaining() == ["d"]
    assert merge_order([1, 2], 3) == [0, 1, 2] and merge_order([2, 1, 0], 3) == [2, 1, 0]


def first_gradient_worker(rank, world, *, strategy):
    """[Note: first gradient after zeroing] ZeRO-0/1: zeroing takes the main-gradient
    views off the compute parameters; the first gradients are stashed, never added,
    and copied in as a group completes in a no_sync backward, or at its reduction's launch; the
    views are back for the next microbatch, which autograd accumulates into."""
    torch.manual_seed(0)
    model, opt = mf.fully_shard(SkipNet(), lambda params: _optimizer("sgd", params), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    pipe = model.grad_reduce_pipeline
    compute = [p for g in model.param_and_grad_buffer.grad_groups for p in g.params if pipe.grad_view_of(p) is not None]
    events = []
    real_add, accumulate, flush, end_backward, launch = (
        torch.Tensor.add_, pipe.accumulate, pipe._flush_stash, pipe.end_backward, pipe._launch)
    where = ["backward"]

    def counting(group, index, param):
        torch.Tensor.add_ = lambda t, *a, **k: (events.append("add"), real_add(t, *a, **k))[1]
        try:
            return accumulate(group, index, param)
        finally:
            torch.Tensor.add_ = real_add

    def flushing(group, grads):
        events.extend([("flush", where[0])] * len(grads))
        return flush(group, grads)

    def inside(name, fn):
        def wrapper(*args, **kwargs):
            where[0] = name
            try:
                return fn(*args, **kwargs)
            finally:
                where[0] = "backward"
        return wrapper

    pipe.accumulate, pipe._flush_stash = counting, flushing
    pipe.end_backward, pipe._launch = inside("end_backward", end_backward), inside("launch", launch)
    (x, y), = make_batches("net", 1, batch=4 * world)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    seen = []
    for step in range(3):
        opt.zero_grad()  # the buffers are zeroed, and the views taken off, as backward starts
        with model.no_sync() if step == 1 else contextlib.nullcontext():  # step 2: one synced microbatch
            loss_fn("net", model(x), y).backward()
        first, events[:] = list(events), []
        if step == 1:
            loss_fn("net", model(x), y).backward()
        second, events[:] = list(events), []
        views = [p.grad is pipe.grad_view_of(p) for p in compute if p.grad is not None]
        seen.append((first, second, bool(views) and all(views)))
        opt.step()
    return seen[1:]  # the first backward ever meets the views installed at wrapping


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_first_gradient_after_zeroing_is_stashed_and_copied(pool2, strategy):
    for seen in pool2.run(first_gradient_worker, strategy=strategy):
        # no_sync: each group's stash is written as the group completes (the unused
        # head has none); a synced backward writes it at the group's launch.
        for (first, second, views_back), flushed_in in zip(seen, ["backward", "launch"]):
            assert first and set(first) == {("flush", flushed_in)}, first  # no add of ours
            assert second == [] and views_back


# -- optimizers: [Note: local pieces] (optimizer.py) ---------------------------------------
class NormScaledSGD(torch.optim.Optimizer):
    """A user's optimizer that looks across each parameter: p -= lr * g / ||g||."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / (p.grad.norm() + 1e-6))


class Lion(torch.optim.Optimizer):
    """A user's elementwise optimizer (sign of an interpolated momentum)."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.sub_(group["lr"] * (beta1 * m + (1 - beta1) * p.grad).sign())
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.5),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01, eps=1e-4),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01, eps=1e-4),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01, eps=1e-4),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, eps=1e-4),
    "norm_scaled_sgd": NormScaledSGD,
    "lion": Lion,
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "muon": lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02),
}


def optimizer_worker(rank, world, *, name, strategy):
    torch.manual_seed(0)
    base = SkipNet()
    batches = make_batches("net", 3, batch=4 * world)
    reference = copy.deepcopy(base)
    ref_opt = OPTIMIZERS[name](reference.parameters())
    for step, (x, y) in enumerate(batches):
        loop_plain(reference, ref_opt, step, x, y, Ctx(rank, world, reference=True))
    model, opt = mf.fully_shard(base, OPTIMIZERS[name], fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    before = mf.get_full_state_dict(model)
    try:
        for step, (x, y) in enumerate(batches):
            loop_plain(model, opt, step, x, y, Ctx(rank, world, reference=False))
    except NotImplementedError as exc:
        unchanged = all(torch.equal(before[k], v) for k, v in mf.get_full_state_dict(model).items())
        return str(exc), unchanged
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()), None


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in ("adafactor", "muon")])
def test_optimizers_equal_single_process(pool2, name, strategy):
    """torch's elementwise optimizers run on the local pieces; the user's own run on
    the DTensors, so one that looks across a parameter (a norm) is exact too (on local
    pieces it would get this rank's norm, silently)."""
    for diff, _ in pool2.run(optimizer_worker, name=name, strategy=strategy):
        assert diff < TOL, diff


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_whole_tensor_optimizers(pool2, name, strategy):
    """Adafactor and Muon need whole parameters: exact under no_shard, refused with the
    choices before any weight changes under the sharded strategies."""
    for result, unchanged in pool2.run(optimizer_worker, name=name, strategy=strategy):
        if strategy == "no_shard":
            assert result < TOL, result
        else:
            assert "needs whole parameters" in result and "no_shard" in result and unchanged


def test_which_optimizers_run_on_local_pieces():
    from megatron_fsdp.optimizer import updates_elementwise

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert updates_elementwise(torch.optim.AdamW(params)) and updates_elementwise(torch.optim.SGD(params, lr=1))
    assert not updates_elementwise(torch.optim.Adafactor(params)) and not updates_elementwise(Lion(params))

    class MyAdamW(torch.optim.AdamW):  # a subclass may change the math
        pass

    assert not updates_elementwise(MyAdamW(params))
    vouched = Lion(params)
    vouched.megatron_fsdp_elementwise = True
    assert updates_elementwise(vouched)
    FusedAdam = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": "apex.optimizers.fused_adam"})
    assert updates_elementwise(FusedAdam(params, {}))


class SparseEmbeddingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, index):
        return self.head(self.emb(index)).mean()


def sparse_embedding_worker(rank, world, *, strategy, optimizer):
    make = {"sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}[optimizer]
    torch.manual_seed(0)
    base = SparseEmbeddingNet()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 16, (4 * world, 3), generator=g) for _ in range(3)]  # rows 16.. never touched
    reference = copy.deepcopy(base)
    ref_opt = make(reference.parameters())
    for index in batches:
        ref_opt.zero_grad()
        sum(reference(part) for part in index.chunk(world)).div(world).backward()
        ref_opt.step()
    model, opt = mf.fully_shard(base, make, zero_dp_strategy=strategy)
    for index in batches:
        opt.zero_grad()
        model(index.chunk(world)[rank]).backward()
        opt.step()
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adagrad"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_embedding_gradients(pool2, strategy, optimizer):
    """nn.Embedding(sparse=True): the sparse gradients are reduced densely (untouched
    rows as zeros), which SGD and Adagrad update exactly as the sparse single process
    does (it failed inside the gradient hook: 'reshape is not implemented for sparse')."""
    for diff in pool2.run(sparse_embedding_worker, strategy=strategy, optimizer=optimizer):
        assert diff < TOL, diff


# -- what a unit returns ---------------------------------------------------------------------
def structured_output_worker(rank, world, *, strategy, kind):
    base, inputs, reference = structured_case(kind, world)
    model, opt = mf.fully_shard(base, lambda ps: torch.optim.SGD(ps, lr=0.1), fsdp_unit_modules=[StructuredBlock],
                                zero_dp_strategy=strategy)
    before = mf.get_full_state_dict(model)
    try:
        for x in inputs:
            opt.zero_grad()
            model(x.chunk(world)[rank]).backward()
            opt.step()
    except RuntimeError as exc:
        return str(exc), all(torch.equal(before[k], v) for k, v in mf.get_full_state_dict(model).items())
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()), None


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass"])
def test_unit_outputs_in_containers(pool2, strategy, kind):
    """Units returning dicts, namedtuples or dataclasses train as in one process (a
    dataclass hid its tensors from ZeRO-3's backward hook: 'setStorage ... size 0')."""
    for diff, _ in pool2.run(structured_output_worker, strategy=strategy, kind=kind):
        assert diff < TOL, diff


def test_unit_output_hiding_its_tensors_is_refused(pool2):
    for message, unchanged in pool2.run(structured_output_worker, strategy="optim_grads_params", kind="opaque"):
        assert "returned an object of type Opaque holding tensors" in message and "dataclasses" in message and unchanged, message


def gradient_sync_switch_worker(rank, world, *, strategy):
    """``set_requires_gradient_sync(False)`` really defers ZeRO-0/1's reduction (as
    ``no_sync``); ZeRO-2/3 reduce-scatter every backward (they keep no unsharded
    gradient between passes)."""
    model, _ = mf.fully_shard(SkipNet(), lambda params: _optimizer("sgd", params), fsdp_unit_modules=[Block],
                              zero_dp_strategy=strategy)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    counts = []
    for sync in (False, True):
        model.set_requires_gradient_sync(sync)
        with mf.record_collectives() as rec:
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        counts.append(rec.counts["all_reduce"] + rec.counts["reduce_scatter"])
    return counts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requires_gradient_sync_defers_like_no_sync(pool2, strategy):
    for unsynced, synced in pool2.run(gradient_sync_switch_worker, strategy=strategy):
        assert synced > 0
        assert (unsynced == 0) if strategy in ("no_shard", "optim") else (unsynced == synced)
