"""The optimizer and API side of issue 14: schedulers, pickling, rebuilding an
optimizer, all-or-nothing wrapping, eager optimizer state, misuse errors, buffers."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import megatron_fsdp as mf
from models import Block, loss_fn, make_batches, make_model
from test_patterns import STRATEGIES, TOL, Ctx, SkipNet, _optimizer, loop_plain, wrapped_with_reference

torch_ddp = nn.parallel.DistributedDataParallel


def _full_diff(model, reference) -> float:
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


# -- LR schedulers, step hooks, pickling -------------------------------------------------------
def scheduler_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = SkipNet()
    batches = make_batches("net", 4, batch=4 * world)
    reference = copy.deepcopy(base)
    ref_opt = _optimizer("adamw", reference.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    model, opt = mf.fully_shard(base, lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # created after fully_shard_optimizer
    for step, (x, y) in enumerate(batches):
        loop_plain(reference, ref_opt, step, x, y, Ctx(rank, world, True))
        ref_sched.step()
        loop_plain(model, opt, step, x, y, Ctx(rank, world, False))
        sched.step()
    return _full_diff(model, reference), sched.get_last_lr(), ref_sched.get_last_lr()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lr_scheduler_created_after_fully_shard_optimizer(pool2, strategy):
    for diff, lr, ref_lr in pool2.run(scheduler_worker, strategy=strategy):
        assert diff < TOL and lr == ref_lr


def pickle_worker(rank, world, *, strategy):
    model, opt = mf.fully_shard(make_model("net"), lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    for step, (x, y) in enumerate(make_batches("net", 1, batch=4 * world)):
        loop_plain(model, opt, step, x, y, Ctx(rank, world, False))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    return len(saved.getvalue())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_save_optimizer_state_dict(pool2, strategy):
    assert all(n > 0 for n in pool2.run(pickle_worker, strategy=strategy))


# -- eager optimizer state ----------------------------------------------------------------------
def eager_state_worker(rank, world, *, strategy):
    model, opt = mf.fully_shard(make_model("net"), lambda p: _optimizer("adamw", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)
    before = mf.get_full_state_dict(model)
    states = [opt.state[p] for p in model.parameters()]
    complete = all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in states)
    zero = all(float(s["step"]) == 0 and not s["exp_avg"].to_local().any() if hasattr(s["exp_avg"], "to_local")
               else float(s["step"]) == 0 and not s["exp_avg"].any() for s in states)
    after = mf.get_full_state_dict(model)
    return complete, zero, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_optimizer_state_without_a_step(pool2, strategy):
    """Item 12: the state exists (zero moments, step 0) right after fully_shard_optimizer,
    and no weight moved; training from it equals the reference (test_patterns: every
    loop runs on an eagerly initialised AdamW)."""
    assert all(all(r) for r in pool2.run(eager_state_worker, strategy=strategy))


# -- fully_shard(module, optimizer) ------------------------------------------------------------
def rebuild_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = SkipNet()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW([{"params": list(reference.blocks.parameters()), "weight_decay": 0.0},
                                 {"params": [p for n, p in reference.named_parameters() if not n.startswith("blocks")]}],
                                lr=0.01, eps=1e-4, weight_decay=0.1)
    opt0 = torch.optim.AdamW([{"params": list(base.blocks.parameters()), "weight_decay": 0.0},
                              {"params": [p for n, p in base.named_parameters() if not n.startswith("blocks")]}],
                             lr=0.01, eps=1e-4, weight_decay=0.1)
    model, opt = mf.fully_shard(base, opt0, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    for step, (x, y) in enumerate(make_batches("net", 3, batch=4 * world)):
        loop_plain(reference, ref_opt, step, x, y, Ctx(rank, world, True))
        loop_plain(model, opt, step, x, y, Ctx(rank, world, False))
    return _full_diff(model, reference), type(opt).__name__


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fully_shard_rebuilds_an_optimizer(pool2, strategy):
    for diff, name in pool2.run(rebuild_worker, strategy=strategy):
        assert diff < TOL and name == "AdamW"


def failing_factory_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    module = make_model("net")
    before = {n: p.detach().clone() for n, p in module.named_parameters()}

    def factory(params):
        raise RuntimeError("factory failed")

    try:
        mf.fully_shard(module, factory, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    except RuntimeError as exc:
        message = str(exc)
    same = all(torch.equal(before[n], p) for n, p in module.named_parameters())
    x = torch.randn(2, 5)
    usable = torch.isfinite(module(x)).all().item()  # plain module again: no hooks left
    model, opt = mf.fully_shard(module, lambda p: _optimizer("sgd", p), fsdp_unit_modules=[Block],
                                zero_dp_strategy=strategy)  # and it can be wrapped again
    return message, same, usable


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_failing_factory_leaves_the_module_untouched(pool2, strategy):
    for message, same, usable in pool2.run(failing_factory_worker, strategy=strategy):
        assert message == "factory failed" and same and usable


# -- misuse: clear errors before any number changes -----------------------------------------------
def misuse_worker(rank, world, *, case, strategy):
    torch.manual_seed(0)
    module = make_model("net")
    originals = list(module.parameters())  # the compute parameters, once wrapped
    model = mf.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    before = mf.get_full_state_dict(model)
    try:
        if case == "wrap_twice":
            mf.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
        elif case == "wrap_submodule_again":
            mf.fully_shard_model(module.blocks[0], zero_dp_strategy=strategy)
        elif case == "optimizer_on_compute_params":
            opt = torch.optim.SGD(originals, lr=0.1)
            loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        elif case == "fully_shard_optimizer_on_compute_params":
            mf.fully_shard_optimizer(torch.optim.SGD(originals, lr=0.1))
    except (ValueError, TypeError) as exc:
        after = mf.get_full_state_dict(model)
        return str(exc), all(torch.equal(before[k], after[k]) for k in before)
    return "no error", False


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("case", ["wrap_twice", "wrap_submodule_again", "optimizer_on_compute_params",
                                  "fully_shard_optimizer_on_compute_params"])
def test_misuse_is_a_clear_error(pool2, case, strategy):
    """Items 8 and 9."""
    for message, unchanged in pool2.run(misuse_worker, case=case, strategy=strategy):
        assert unchanged, message
        expected = "already wrapped" if case.startswith("wrap") else "model.parameters()"
        assert expected in message, message


def argument_worker(rank, world, *, case):
    module = make_model("net")
    kwargs = {}
    if case == "unit_class":
        kwargs = dict(fsdp_unit_modules=Block)
    elif case == "bare_name":
        kwargs = dict(fsdp_unit_modules="Block")
    elif case == "policy_string":
        kwargs = dict(mixed_precision_policy="bf16")
    elif case == "not_a_module":
        module = lambda x: x  # noqa: E731
    elif case == "timeout":
        kwargs = dict(collective_timeout_s=30.0)
    try:
        model = mf.fully_shard_model(module, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {len(model.units)}"


@pytest.mark.parametrize(
    "case,expected",
    [
        ("unit_class", "ok 3"),
        ("bare_name", "is a bare class name"),
        ("policy_string", "mixed_precision_policy='bf16' is not a MixedPrecisionPolicy"),
        ("not_a_module", "wraps a torch.nn.Module"),
        ("timeout", "ok 1"),
    ],
)
def test_argument_messages(pool2, case, expected):
    """Item 15."""
    for message in pool2.run(argument_worker, case=case):
        assert expected in message, message


# -- buffers follow DDP -----------------------------------------------------------------------------
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def buffers_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = BNNet()
    ddp = torch_ddp(copy.deepcopy(base))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model, opt = mf.fully_shard(base, lambda p: torch.optim.SGD(p, lr=0.1), zero_dp_strategy=strategy)
    g = torch.Generator().manual_seed(rank)  # every rank its own data: different batch statistics
    for _ in range(3):
        x, y = torch.randn(8, 5, generator=g) * (rank + 1), torch.randn(8, 3, generator=g)
        for m, o in ((ddp, ddp_opt), (model, opt)):
            o.zero_grad()
            loss_fn("net", m(x), y).backward()
            o.step()
    ddp.eval()
    model.eval()
    probe = torch.randn(4, 5, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        expected, got = ddp(probe), model(probe)
    model.finish_param_sync()
    stats = (model.module.bn.running_mean - ddp.module.bn.running_mean).abs().max().item()
    return (got - expected).abs().max().item(), stats


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_buffers_broadcast_like_ddp(pool2, strategy):
    """Item 14: running statistics broadcast from rank 0 at each forward, as DDP."""
    for out_diff, stats_diff in pool2.run(buffers_worker, strategy=strategy):
        assert out_diff < TOL and stats_diff < TOL


# -- parameters added after wrapping (module_guards: [Note: parameters added after wrapping]) --------
def added_parameter_worker(rank, world, *, strategy, case):
    """A new parameter assigned, a parameter-holding module attached, or a parameter
    deleted after wrapping is refused (the new weight used to be silently replaced by
    the wrapper's own at the next forward; a new head trained on each rank alone);
    nothing changes, and training goes on equal to one process."""
    model, opt, reference, ref_opt = wrapped_with_reference(SkipNet, strategy)
    batches = make_batches("net", 3, batch=4 * world)
    before = mf.get_full_state_dict(model)
    message = "no error"
    try:
        if case == "new_parameter":
            model.module.out.weight = nn.Parameter(torch.zeros_like(reference.out.weight))
        elif case == "new_module":
            model.module.out = nn.Linear(7, 3)
        else:  # a deletion escapes torch's registration hooks: refused at the next forward
            del model.module.out.bias
            x, y = batches[0]
            model(x.chunk(world)[rank])
    except (TypeError, RuntimeError) as exc:
        message = str(exc)
    if case == "deleted":  # put it back (the wrapper's own parameter) to train on
        model.module.out.register_parameter("bias", dict(model.named_parameters())["out.bias"])
    after = mf.get_full_state_dict(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    for step, (x, y) in enumerate(batches):
        for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
            loop_plain(m, o, step, x, y, ctx)
    return message, unchanged, _full_diff(model, reference)


@pytest.mark.parametrize("case", ["new_parameter", "new_module", "deleted"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_added_after_wrapping_are_refused(pool2, strategy, case):
    for message, unchanged, diff in pool2.run(added_parameter_worker, strategy=strategy, case=case):
        expected = "no longer the parameter megatron_fsdp registered" if case == "deleted" else "Nothing was assigned"
        assert expected in message and "before wrapping" in message, message
        assert unchanged and diff < TOL, (unchanged, diff)


class _CheckpointedSkipNet(SkipNet):
    """SkipNet whose block 1 is under torch's checkpoint_wrapper from construction."""

    def __init__(self):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__()
        self.blocks[1] = checkpoint_wrapper(self.blocks[1])


def checkpoint_wrapper_worker(rank, world, *, strategy, when, path):
    """torch's checkpoint_wrapper around a block, before wrapping or after it (FSDP1's
    habit: it holds only the wrapper's parameters, so it attaches). Training equals one
    process; state dicts are keyed as torch keys them ([Note: checkpoint_wrapper keys]),
    so DSD saves and resumes through DCP and a plain model loads the export."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, reference, ref_opt = wrapped_with_reference(
        _CheckpointedSkipNet if when == "before" else SkipNet, strategy)
    if when == "after":
        reference.blocks[1] = checkpoint_wrapper(reference.blocks[1])
        model.module.blocks[1] = checkpoint_wrapper(model.module.blocks[1])
    batches = make_batches("net", 5, batch=4 * world)

    def train(steps):
        for step, (x, y) in steps:
            for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
                loop_plain(m, o, step, x, y, ctx)

    train(list(enumerate(batches))[:3])
    keys = list(reference.state_dict())
    assert not any("_checkpoint_wrapped_module" in k for k in keys)
    assert list(model.state_dict()) == ["module." + k for k in keys]
    msd, osd = get_state_dict(model, opt)  # DSD refused keys that kept the wrapper's segment
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    model2, opt2, _, _ = wrapped_with_reference(_CheckpointedSkipNet if when == "before" else SkipNet, strategy)
    if when == "after":
        model2.module.blocks[1] = checkpoint_wrapper(model2.module.blocks[1])
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model, opt = model2, opt2  # the resumed copy trains on
    train(list(enumerate(batches))[3:])
    model.finish_param_sync()
    full = mf.get_full_state_dict(model)
    plain = _CheckpointedSkipNet() if when == "before" else SkipNet()
    if when == "after":
        plain.blocks[1] = checkpoint_wrapper(plain.blocks[1])
    plain.load_state_dict(full)  # strict: the export has the plain model's keys
    reference_sd = reference.state_dict()
    return max((full[k] - reference_sd[k]).abs().max().item() for k in keys)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_wrapper(pool2, tmp_path, strategy, when):
    for diff in pool2.run(checkpoint_wrapper_worker, strategy=strategy, when=when, path=str(tmp_path / "ckpt")):
        assert diff < TOL, diff


def read_after_edit_worker(rank, world, *, strategy):
    """Weights read right after an in-place edit (the usual checkpoint before evaluation,
    an EMA copied back, a re-initialisation) hold the edit on every rank; an edit after
    that read still reaches training. ZeRO-1/2 used to hand out the other ranks'
    stale shards, different on each rank (MegatronFSDP.settle_weights_for_reading)."""
    model, opt, reference, ref_opt = wrapped_with_reference(SkipNet, strategy)
    batches = make_batches("net", 3, batch=4 * world)
    reads = []

    def edit(params, how):
        with torch.no_grad():
            for p in params:
                p.mul_(0.5) if how == "halve" else p.add_(0.01)

    for step, (x, y) in enumerate(batches):
        for m, o, ctx in ((reference, ref_opt, Ctx(rank, world, True)), (model, opt, Ctx(rank, world, False))):
            loop_plain(m, o, step, x, y, ctx)
        edit(reference.parameters(), "halve")
        edit(model.parameters(), "halve")
        full = mf.get_full_state_dict(model)
        state = {k[len("module."):]: v.full_tensor() for k, v in model.state_dict().items() if "." in k}
        reads.append(max(max((full[n] - p).abs().max().item(), (state[n] - p).abs().max().item())
                         for n, p in reference.named_parameters()))
        edit(reference.parameters(), "shift")  # after the read: the next forward must see it
        edit(model.parameters(), "shift")
    return max(reads), _full_diff(model, reference)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_read_after_an_in_place_edit(pool2, strategy):
    for read, trained in pool2.run(read_after_edit_worker, strategy=strategy):
        assert read < TOL and trained < TOL, (read, trained)


def _refused(model, action) -> tuple[str, bool]:
    """``action()``'s RuntimeError message ("no error" if none), and whether every
    weight is bit-identical afterwards."""
    before = {k: v.clone() for k, v in mf.get_full_state_dict(model).items()}
    try:
        action()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    after = mf.get_full_state_dict(model)
    return message, all(torch.equal(before[k], after[k]) for k in before)


def data_assignment_worker(rank, world, *, strategy, how, then):
    """[Note: data assignment] ``param.data = value`` and ``vector_to_parameters`` used to
    be ignored silently (training went on from the old weights); the next forward or
    step refuses them, with nothing changed."""
    model, opt, _, _ = wrapped_with_reference(SkipNet, strategy)
    x, y = make_batches("net", 1, batch=4 * world)[0]

    def assign_then_run():
        if how == "data":
            weight = model.module.out.weight
            weight.data = torch.full(weight.shape, 0.3)
        else:
            total = sum(p.numel() for p in model.parameters())
            torch.nn.utils.vector_to_parameters(torch.linspace(-0.5, 0.5, total), model.parameters())
        if then == "forward":
            model(x.chunk(world)[rank])
        else:
            opt.step()

    return _refused(model, assign_then_run)


@pytest.mark.parametrize("then", ["forward", "step"])
@pytest.mark.parametrize("how", ["data", "vector_to_parameters"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_data_assignment_is_refused(pool2, strategy, how, then):
    for message, unchanged in pool2.run(data_assignment_worker, strategy=strategy, how=how, then=then):
        assert ".data was assigned after wrapping" in message and "load_state_dict" in message, message
        assert unchanged


def autograd_inputs_worker(rank, world, *, strategy, how):
    """[Note: autograd to distributed parameters] backward(inputs=params) trained nothing,
    silently; autograd.grad(loss, params) failed in torch's words. Both are refused
    before anything changes, on every rank."""
    model, opt, _, _ = wrapped_with_reference(SkipNet, strategy)
    x, y = make_batches("net", 1, batch=4 * world)[0]
    loss = loss_fn("net", model(x.chunk(world)[rank]), y.chunk(world)[rank])
    params = list(model.module.blocks[0].parameters())
    if how == "backward_inputs":
        return _refused(model, lambda: loss.backward(inputs=params))
    return _refused(model, lambda: torch.autograd.grad(loss, params))


@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autograd_with_parameter_inputs_is_refused(pool2, strategy, how):
    for message, unchanged in pool2.run(autograd_inputs_worker, strategy=strategy, how=how):
        assert "gathered copies" in message and "loss.backward()" in message, message
        assert unchanged
