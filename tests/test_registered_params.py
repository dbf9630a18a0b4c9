"""Between steps the wrapped module's registered parameters are the distributed
parameters (registered_params.py [Note: registered parameters]): whatever walks
``model.module`` trains, clips and reads exactly as single-process training on the
global batch (issues 13 and 14)."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
import megatron_fsdp.uneven_dtensor
from models import Block, Net, SkipNet, loss_fn, make_batches
from test_patterns import STRATEGIES, TOL, Ctx, _loss, _optimizer, loop_plain

MAX_NORM = 0.05  # well below the gradients' norm: every step clips


def _scalar(t: torch.Tensor) -> float:
    """A reduction of a DTensor parameter is a DTensor (Partial until asked): its full value."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).item()


def _same_objects(a, b) -> bool:
    return [id(p) for p in a] == [id(p) for p in b]


# -- item 1: optimizer and clip_grad_norm_ on model.module.parameters() ---------------------------
def loop_clip(model, opt, step, x, y, ctx, norms, norm_type=2.0, foreach=None):
    opt.zero_grad()
    _loss(model, ctx, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ctx.module(model).parameters(), MAX_NORM, norm_type=norm_type,
                                          foreach=foreach)
    # An inf norm's total stays Partial(max) over sharded pieces: .item() refuses it
    # (this rank's part), full_tensor() reduces it; the 2-norm's total is Replicate.
    norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
    opt.step()


def module_optimizer_worker(rank, world, *, strategy, clip, steps=3, norm_type=2.0, foreach=None):
    torch.manual_seed(0)
    base = SkipNet()
    batches = make_batches("net", steps, batch=4 * world)
    reference = copy.deepcopy(base)
    ref_opt, ref_norms = _optimizer("adamw", reference.parameters()), []
    model = mf.fully_shard_model(base, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    same_before = _same_objects(model.module.parameters(), model.parameters())
    names_match = [n for n, _ in model.module.named_parameters()] == [n for n, _ in model.named_parameters()]
    opt, norms = mf.fully_shard_optimizer(_optimizer("adamw", model.module.parameters())), []
    for step, (x, y) in enumerate(batches):
        for m, o, ns, ctx in ((reference, ref_opt, ref_norms, Ctx(rank, world, True)),
                              (model, opt, norms, Ctx(rank, world, False))):
            if clip:
                loop_clip(m, o, step, x, y, ctx, ns, norm_type=norm_type, foreach=foreach)
            else:
                loop_plain(m, o, step, x, y, ctx)
    same_after = _same_objects(model.module.parameters(), model.parameters())
    full = mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    norm_diff = max([abs(a - b) for a, b in zip(norms, ref_norms)], default=0.0)
    return diff, norm_diff, same_before and same_after and names_match


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_and_clip_on_module_parameters(pool2, strategy, clip):
    """Issue 14 item 9: an optimizer and clip_grad_norm_ built on model.module.parameters()
    train (and clip) as single-process training; those are model.parameters()."""
    for diff, norm_diff, same in pool2.run(module_optimizer_worker, strategy=strategy, clip=clip):
        assert diff < TOL and norm_diff < TOL and same, (diff, norm_diff, same)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_with_the_inf_norm(pool2, strategy, foreach):
    """An inf norm over pieces, some of them empty (a rank holding no element of a
    bias): torch raised "cannot compute the inf norm on an empty tensor"
    (piece_dtensor.py _stand_in_for_empty_pieces)."""
    for diff, norm_diff, _ in pool2.run(module_optimizer_worker, strategy=strategy, clip=True,
                                        norm_type=float("inf"), foreach=foreach):
        assert diff < TOL and norm_diff < TOL, (diff, norm_diff)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_clip_on_module_parameters_world4(pool4, strategy):
    for diff, norm_diff, same in pool4.run(module_optimizer_worker, strategy=strategy, clip=True):
        assert diff < TOL and norm_diff < TOL and same, (diff, norm_diff, same)


# -- item 2: reading the module's parameters between steps -----------------------------------------
def read_between_steps_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    model, opt = mf.fully_shard(Net(), lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    ema = {n: p.detach().clone() for n, p in model.module.named_parameters()}  # before any step
    for x, y in make_batches("net", 2, batch=4 * world):
        opt.zero_grad()
        loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        with torch.no_grad():
            for n, p in model.module.named_parameters():
                ema[n].mul_(0.5).add_(p, alpha=0.5)
    full = mf.get_full_state_dict(model)
    norms = max(abs(_scalar(model.module.get_parameter(n).norm()) - full[n].norm().item()) for n in full)
    sums = max(abs(_scalar(p.detach().clone().sum()) - full[n].sum().item()) for n, p in model.module.named_parameters())
    ema_ok = all(isinstance(v, DTensor) == isinstance(model.module.get_parameter(n), DTensor) for n, v in ema.items())
    try:
        model.module.inp.weight.numpy()
        numpy = "values"
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
        numpy = f"error: {exc}"
    return norms, sums, ema_ok, numpy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_parameters_readable_between_steps(pool2, strategy):
    """Issue 14: p.norm(), p.clone() and an EMA over model.module's parameters between
    steps read the main weights (ZeRO-3 used to crash on released storage); .numpy()
    gives the values or an error, never a crash."""
    for norms, sums, ema_ok, numpy in pool2.run(read_between_steps_worker, strategy=strategy):
        assert norms < TOL and sums < TOL and ema_ok and numpy, (norms, sums, ema_ok, numpy)


# -- registration round trips --------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 5, bias=False)
        self.block = Block(5)
        self.head = nn.Linear(5, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def registration_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = Tied()
    reference = copy.deepcopy(base)
    model = mf.fully_shard_model(base, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    tied = model.module.head.weight is model.module.emb.weight
    x = torch.randn(4, 5)
    with torch.no_grad():
        eval_out = model(x)  # an eval forward: no backward will come
    eval_diff = (eval_out - reference(x)).abs().max().item()
    after_eval = _same_objects(model.module.parameters(), model.parameters())
    model(x).sum()  # forward with grad, never backward
    after_no_backward = _same_objects(model.module.parameters(), model.parameters())
    state = model.module.state_dict()
    state_keys = list(state) == list(reference.state_dict())
    full = mf.get_full_state_dict(model)
    state_norms = max(abs(_scalar(state[n].norm()) - full[n].norm().item()) for n in full)
    module = model.unshard_module()
    plain = all(type(p) is nn.Parameter and not isinstance(p.data, DTensor) for p in module.parameters())
    values = max((module.get_parameter(n) - p).abs().max().item() for n, p in reference.named_parameters())
    return dict(tied=tied and module.head.weight is module.emb.weight, eval_diff=eval_diff, after_eval=after_eval,
                after_no_backward=after_no_backward, state_keys=state_keys, state_norms=state_norms,
                plain=plain, values=values)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_registration_round_trips(pool2, strategy):
    """Tied weights stay tied; an eval forward and a forward without backward leave
    the distributed parameters registered; model.module.state_dict() holds them;
    unshard_module() gives back plain full parameters."""
    for r in pool2.run(registration_worker, strategy=strategy):
        assert r["tied"] and r["after_eval"] and r["after_no_backward"] and r["state_keys"] and r["plain"], r
        assert r["eval_diff"] < TOL and r["state_norms"] < TOL and r["values"] < TOL, r


# -- training variants through the module's parameters ----------------------------------------------
def loop_no_sync(model, opt, step, x, y, ctx):
    """Two microbatches, the first inside no_sync() (the reference: plain accumulation)."""
    opt.zero_grad()
    for half in (0, 1):
        parts = [(xr.chunk(2)[half], yr.chunk(2)[half]) for _, xr, yr in ctx.shares(x, y)]
        deferred = model.no_sync() if half == 0 and not ctx.reference else contextlib.nullcontext()
        with deferred:
            loss = sum(loss_fn("net", model(xp), yp) for xp, yp in parts) / len(parts)
            (loss / 2).backward()
    opt.step()


def variant_worker(rank, world, *, strategy, variant, steps=3):
    torch.manual_seed(0)
    if variant == "meta":
        reference = Net()
        torch.manual_seed(0)
        with torch.device("meta"):
            base = Net()
    else:
        base = Net(recompute=variant.startswith("recompute"))
        reference = copy.deepcopy(base)
    units = None if variant == "recompute_one_unit" else [Block]
    model = mf.fully_shard_model(base, fsdp_unit_modules=units, zero_dp_strategy=strategy,
                                 init_model_with_meta_device=variant == "meta")
    opt = mf.fully_shard_optimizer(_optimizer("adamw", model.module.parameters()))
    ref_opt = _optimizer("adamw", reference.parameters())
    run = loop_no_sync if variant == "no_sync" else loop_plain
    for step, (x, y) in enumerate(make_batches("net", steps, batch=4 * world)):
        run(reference, ref_opt, step, x, y, Ctx(rank, world, True))
        run(model, opt, step, x, y, Ctx(rank, world, False))
    full = mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return diff, _same_objects(model.module.parameters(), model.parameters())


@pytest.mark.parametrize("variant", ["no_sync", "recompute", "recompute_one_unit", "meta"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_optimizer_variants(pool2, strategy, variant):
    """An optimizer on model.module.parameters() under no_sync() accumulation, activation
    recomputation (the recomputed forward reads compute weights inside backward) and
    meta-device initialisation trains as single-process training."""
    for diff, same in pool2.run(variant_worker, strategy=strategy, variant=variant):
        assert diff < TOL and same, (diff, same)


# -- item 4: gradients read while their sync is deferred ---------------------------------------------
def auto_sync_worker(rank, world, *, strategy, steps=2):
    torch.manual_seed(0)
    # SkipNet: a never-used parameter keeps grad None, so zero_grad zeroes only some
    # items of its group (that once left no_shard's deferred backward unreduced).
    base = SkipNet()
    reference = copy.deepcopy(base)
    model, opt = mf.fully_shard(base, lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    model.set_model_auto_sync(False)
    ref_opt = _optimizer("adamw", reference.parameters())
    errors, norms = [], []
    for step, (x, y) in enumerate(make_batches("net", steps, batch=4 * world)):
        for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
            o.zero_grad()
            for half in (0, 1):  # two microbatches, both deferred
                parts = [(xr.chunk(2)[half], yr.chunk(2)[half]) for _, xr, yr in ctx.shares(x, y)]
                (sum(loss_fn("net", m(xp), yp) for xp, yp in parts) / len(parts) / 2).backward()
            if m is model:
                try:
                    torch.nn.utils.clip_grad_norm_(model.module.parameters(), MAX_NORM)
                    errors.append("no error")
                except RuntimeError as exc:
                    errors.append(str(exc))
                model.finish_grad_sync()
            norms.append(torch.nn.utils.clip_grad_norm_(ctx.module(m).parameters(), MAX_NORM).item())
            o.step()
    full = mf.get_full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    norm_diff = max(abs(a - b) for a, b in zip(norms[0::2], norms[1::2]))
    return diff, norm_diff, errors


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deferred_grads_raise_until_synced(pool2, strategy):
    """Issue 14 item 10: with set_model_auto_sync(False), clip_grad_norm_ before the sync
    raises (what, why, fix) instead of seeing a norm of 0; after model.finish_grad_sync()
    it clips as single-process training, and training matches."""
    for diff, norm_diff, errors in pool2.run(auto_sync_worker, strategy=strategy):
        assert diff < TOL and norm_diff < TOL, (diff, norm_diff)
        assert all("finish_grad_sync()" in e and "deferred" in e for e in errors), errors


def plain_optimizer_worker(rank, world, *, strategy, sync, optimizer):
    """DDP's habit on MegatronFSDP (upstream's defaults: no gradient sync until
    finish_grad_sync(); or auto-sync on): a plain torch optimizer on
    model.parameters(), no fully_shard_optimizer ([Note: plain optimizers])."""
    torch.manual_seed(0)
    base = Net()
    reference = copy.deepcopy(base)
    cfg = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    model = mf.MegatronFSDP(base, ddp_config=cfg, fsdp_unit_modules=[Block], sync_model_each_microbatch=sync)
    opt, ref_opt = _optimizer(optimizer, model.parameters()), _optimizer(optimizer, reference.parameters())
    for x, y in make_batches("net", 3, batch=4 * world):
        for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
            o.zero_grad()
            _loss(m, ctx, x, y).backward()
            o.step()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plain_optimizer_trains_exactly(pool2, strategy, sync, optimizer):
    """Unbound, ZeRO-1/2 trained on stale compute weights and ZeRO-3 with deferred
    sync on stale root groups (0.007-0.06 off); now bound at the first step."""
    assert max(pool2.run(plain_optimizer_worker, strategy=strategy, sync=sync, optimizer=optimizer)) < TOL


def plain_resume_worker(rank, world, *, strategy):
    """DDP's resume: torch.save the state dicts, load them into a fresh model and a
    plain optimizer before its first step, train on: as uninterrupted training."""
    torch.manual_seed(0)
    base = Net()
    reference, fresh = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = _optimizer("adamw", reference.parameters())
    batches = make_batches("net", 4, batch=4 * world)
    for x, y in batches:
        ref_opt.zero_grad()
        _loss(reference, Ctx(rank, world, True), x, y).backward()
        ref_opt.step()
    model, opt = mf.fully_shard(base, lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    model2 = mf.fully_shard_model(fresh, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    opt2 = _optimizer("adamw", model2.parameters())
    for i, (x, y) in enumerate(batches):
        m, o = (model, opt) if i < 2 else (model2, opt2)
        if i == 2:  # the checkpoint, through bytes as torch.save writes it
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            buffer.seek(0)
            ckpt = torch.load(buffer, weights_only=False)
            model2.load_state_dict(ckpt["model"])
            opt2.load_state_dict(ckpt["optimizer"])
        o.zero_grad()
        _loss(m, Ctx(rank, world, False), x, y).backward()
        o.step()
    full = mf.get_full_state_dict(model2)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plain_optimizer_resumes_from_saved_state(pool2, strategy):
    """The state loaded before the first step (in the state dict's layout) was paired
    with the flat pieces: a shape error, or on unlucky sizes wrong rows."""
    assert max(pool2.run(plain_resume_worker, strategy=strategy)) < TOL


def mixed_optimizer_worker(rank, world):
    model = mf.MegatronFSDP(Net(), fsdp_unit_modules=[Block])
    extra = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    _loss(model, Ctx(rank, world, False), x, y).backward()
    before = mf.get_full_state_dict(model)
    try:
        opt.step()
        return "stepped"
    except ValueError as exc:
        after = mf.get_full_state_dict(model)
        return str(exc) + ("" if all(torch.equal(before[k], after[k]) for k in before) else " CHANGED")


def test_one_optimizer_over_ours_and_other_parameters_is_refused(pool2):
    for message in pool2.run(mixed_optimizer_worker):
        assert "belongs to no MegatronFSDP model" in message and "another for the rest" in message, message
        assert not message.endswith("CHANGED")


# -- item 5: zero_grad(set_to_none=False) ------------------------------------------------------------
def zero_in_place_worker(rank, world, *, strategy, grads, how, steps=3):
    results, zeroed = [], True
    for set_to_none in (True, False):
        torch.manual_seed(0)
        base = Net()
        reference = copy.deepcopy(base)
        policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=getattr(torch, grads),
                                         grad_comm_dtype=getattr(torch, grads))
        model, opt = mf.fully_shard(base, lambda p: _optimizer("sgd_momentum", p), fsdp_unit_modules=[Block],
                                    zero_dp_strategy=strategy, mixed_precision_policy=policy)
        ref_opt = _optimizer("sgd_momentum", reference.parameters())
        for step, (x, y) in enumerate(make_batches("net", steps, batch=4 * world)):
            for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
                (m if how == "model" and m is model else o).zero_grad(set_to_none=set_to_none)
                if m is model and step and not set_to_none:
                    grads_now = [p.grad for p in model.parameters() if p.requires_grad]
                    zeroed &= all(g is not None and _scalar(g.abs().sum()) == 0 for g in grads_now)
                _loss(m, ctx, x, y).backward()
                o.step()
        full = mf.get_full_state_dict(model)
        results.append((full, max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())))
    (a, ref_a), (b, ref_b) = results
    return max((a[k] - b[k]).abs().max().item() for k in a), ref_b, zeroed


@pytest.mark.parametrize("how", ["optimizer", "model"])
@pytest.mark.parametrize("grads", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_grad_in_place(pool2, strategy, grads, how):
    """zero_grad(set_to_none=False) zeroes the gradients in place (present, all zero, as
    DDP) and trains exactly as set_to_none=True, also with main gradients narrower than
    the main weights (their .grad is a cast copy, not a view of the buffer)."""
    for between, ref_diff, zeroed in pool2.run(zero_in_place_worker, strategy=strategy, grads=grads, how=how):
        assert between == 0 and zeroed, (between, zeroed)
        if grads == "float32":
            assert ref_diff < TOL, ref_diff


# -- DTensor APIs on the main engine's parameters (piece_dtensor.py [Note: flat pieces]) --------
def dtensor_api_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = SkipNet()
    reference = {n: p.detach().clone() for n, p in base.named_parameters()}
    model, opt = mf.fully_shard(base, lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    weight, expected = model.module.blocks[0].fc1.weight, reference["blocks.0.fc1.weight"]
    exact = {
        "mean": abs(weight.mean().full_tensor().item() - expected.mean().item()),
        "sum": abs(weight.sum().full_tensor().item() - expected.sum().item()),
        "norm": abs(weight.norm().full_tensor().item() - expected.norm().item()),
        "clone_mean": abs((weight.clone() * 2).mean().full_tensor().item() - 2 * expected.mean().item()),
    }
    refused = {}
    for name, call in {"full_tensor": lambda: weight.full_tensor(), "t": lambda: weight.t(),
                       "sum_dim": lambda: weight.sum(dim=0), "view": lambda: weight.view(-1),
                       # property reads make new DTensors (torch 2.10/2.11's fast path made them
                       # plain, unguarded ones: .data.view() reinterpreted the piece)
                       "data_view": lambda: weight.data.view(-1), "T": lambda: weight.T,
                       "data_full_tensor": lambda: weight.data.full_tensor(),
                       "state_full_tensor": lambda: opt.state[weight]["exp_avg"].full_tensor(),
                       # upstream's helper, which Megatron-LM calls on parameters: it raised
                       # torch's "expanded size" error here
                       "uneven_full_tensor": lambda: megatron_fsdp.uneven_dtensor.uneven_dtensor_to_full_tensor(
                           weight)}.items():
        try:
            call()
            refused[name] = "no error"
        except NotImplementedError as exc:
            refused[name] = str(exc)
    try:  # a partial value read on the host would be this rank's part alone
        partial_read = f"no error: {weight.norm().item()}"
    except NotImplementedError as exc:
        partial_read = str(exc)
    return exact, refused, partial_read


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_dtensor_apis_on_parameters_are_exact_or_refused(pool2, strategy):
    """Sharded parameters hold flat pieces: what DTensor computes exactly on any split
    (mean as sum/count, sums, norms, elementwise math) matches the full weight; what
    it would get wrong (full_tensor gave a (15,) tensor for a (7, 15) weight, mean
    -0.0319 for -0.00105) raises on every rank, naming the remedy."""
    for exact, refused, partial_read in pool2.run(dtensor_api_worker, strategy=strategy):
        assert all(v < TOL for v in exact.values()), exact
        assert all("get_full_state_dict" in message for message in refused.values()), refused
        assert "full_tensor()" in partial_read, partial_read
