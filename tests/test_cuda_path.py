"""CPU tests of the CUDA/NCCL correctness items: per-model collective timeouts and
no timed waits on devices, the release-after-wait invariant, initialised buffers
under meta-device init, the host-side full state dict, TransformerEngine
detection and fused weight-gradient accumulation, the streams layer's CPU path."""

from __future__ import annotations

import contextlib
import copy
import datetime
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import megatron_fsdp as mf
from megatron_fsdp.comm import collectives, release_after_wait as inflight, streams
from megatron_fsdp.compat import transformer_engine as te_compat
from megatron_fsdp.buffers.allocator import BufferAccounting, StorageResizeAllocator
from models import Block, loss_fn, make_batches, make_model, make_optimizer, train_steps


# -- timeouts ------------------------------------------------------------------------
class _Work:
    def __init__(self, completes: bool = True) -> None:
        self.calls: list = []
        self.completes = completes

    def wait(self, **kwargs):
        self.calls.append(kwargs)
        return self.completes


def test_device_waits_never_take_a_timeout():
    """On NCCL a timed wait would block the host until completion: never pass one."""
    work = _Work()
    collectives.wait_work(work, datetime.timedelta(seconds=3), on_device=True)
    assert work.calls == [{}]


def test_cpu_waits_take_the_timeout_and_fail_when_it_passes():
    work = _Work(completes=False)
    with pytest.raises(TimeoutError, match="3s"):
        collectives.wait_work(work, datetime.timedelta(seconds=3), on_device=False)
    assert work.calls == [{"timeout": datetime.timedelta(seconds=3)}]


def timeout_worker(rank, world):
    a = mf.MegatronFSDP(make_model("net"), ddp_config=mf.DistributedDataParallelConfig(collective_timeout_s=7.0))
    b = mf.MegatronFSDP(make_model("net"))
    x, y = make_batches("net", 1, batch=2 * world)[0]
    handles = []
    real_wait = collectives.wait_work

    def spy(work, timeout, *, on_device):
        handles.append(timeout)
        return real_wait(work, timeout, on_device=on_device)

    collectives.wait_work = spy
    try:
        # MegatronFSDP's default (upstream's) leaves the reduction to finish_grad_sync().
        loss_fn("net", a(x), y).backward()
        a.finish_grad_sync()
        seen_a, handles[:] = list(handles), []
        loss_fn("net", b(x), y).backward()
        b.finish_grad_sync()
        seen_b = list(handles)
    finally:
        collectives.wait_work = real_wait
    return (
        a.all_gather_pipeline.timeout, b.grad_reduce_pipeline.timeout, getattr(collectives, "set_collective_timeout", None),
        set(seen_a), set(seen_b),
    )


def test_collective_timeout_is_per_model(pool2):
    seven = datetime.timedelta(seconds=7)
    for a_timeout, b_timeout, default, seen_a, seen_b in pool2.run(timeout_worker):
        assert (a_timeout, b_timeout, default) == (seven, None, None)
        assert seen_a == {seven} and seen_b == {None}


# -- release after wait ----------------------------------------------------------------
class _Handle:
    pass


def test_releasing_a_bucket_under_an_inflight_collective_raises():
    allocator = StorageResizeAllocator(BufferAccounting())
    bucket = allocator.new(64, torch.float32, torch.device("cpu"))
    other = allocator.new(64, torch.float32, torch.device("cpu"))
    handle = _Handle()
    inflight.register(handle, "reduce_scatter:unit0", [bucket[16:32]])
    with pytest.raises(inflight.BucketInFlightError, match="reduce_scatter:unit0"):
        allocator.release(bucket)
    allocator.release(other)  # unrelated bytes: fine
    inflight.forget(handle)
    allocator.release(bucket)
    assert allocator.accounting.temporary == 0


def test_a_dropped_handle_never_blocks_releases():
    allocator = StorageResizeAllocator(BufferAccounting())
    bucket = allocator.new(8, torch.float32, torch.device("cpu"))
    handle = _Handle()
    inflight.register(handle, "all_gather:x", [bucket])
    del handle
    allocator.release(bucket)


def inflight_worker(rank, world):
    allocator = StorageResizeAllocator(BufferAccounting())
    out = allocator.new(4 * world, torch.float32, torch.device("cpu"))
    shard = torch.full((4,), float(rank))
    group = torch.distributed.group.WORLD
    handle = collectives.all_gather(out, shard, group, async_op=True, label="probe")
    try:
        allocator.release(out)
        raised = False
    except inflight.BucketInFlightError:
        raised = True
    handle.wait()
    gathered = out.tolist()
    allocator.release(out)
    return raised, gathered


def test_real_collective_blocks_release_until_waited(pool2):
    for raised, gathered in pool2.run(inflight_worker):
        assert raised
        assert gathered == [0.0] * 4 + [1.0] * 4


# -- meta-device init and buffers -----------------------------------------------------
class WithTable(nn.Module):
    """A buffer computed in __init__ (like rotary frequencies): lost on the meta device."""

    def __init__(self, reset_buffers: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))
        if reset_buffers:
            self.reset_buffers = lambda: self.table.copy_(torch.arange(4.0))

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()

    def forward(self, x):
        return self.fc(x) + self.table


def meta_buffer_worker(rank, world, *, reset_buffers):
    with torch.device("meta"):
        module = WithTable(reset_buffers)
    try:
        model = mf.fully_shard_model(module, init_model_with_meta_device=True, zero_dp_strategy=3)
    except ValueError as exc:
        return "raised", str(exc)
    return "built", model.module.table.tolist()


def test_meta_init_refuses_an_uninitialised_buffer(pool2):
    for kind, message in pool2.run(meta_buffer_worker, reset_buffers=False):
        assert kind == "raised"
        assert "'table'" in message and "reset_buffers()" in message


def test_meta_init_runs_reset_buffers(pool2):
    for kind, table in pool2.run(meta_buffer_worker, reset_buffers=True):
        assert (kind, table) == ("built", [0.0, 1.0, 2.0, 3.0])


# -- full state dict -------------------------------------------------------------------
def full_state_worker(rank, world):
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=3)
    everywhere = mf.get_full_state_dict(model)
    rank0 = mf.get_full_state_dict(model, rank0_only=True)
    ptrs = {t.untyped_storage().data_ptr() for t in everywhere.values()}
    live = {g.main_weight_source.data.untyped_storage().data_ptr() for g in model.param_and_grad_buffer.groups}
    reference = make_model("net").state_dict()
    return (
        sorted(rank0) == sorted(reference) if rank == 0 else rank0 == {},
        {t.device.type for t in everywhere.values()},
        not (ptrs & live),
        max((everywhere[k] - v).abs().max().item() for k, v in reference.items()),
    )


def test_full_state_dict_is_host_side_and_rank0_only_when_asked(pool2):
    for rank0_ok, devices, private, diff in pool2.run(full_state_worker):
        assert rank0_ok and devices == {"cpu"} and private
        assert diff == 0.0


# -- TransformerEngine ---------------------------------------------------------------------
class _FusedLinearFn(torch.autograd.Function):
    """What TE's Linear does with fuse_wgrad_accumulation: accumulate the weight
    gradient into ``weight.main_grad`` and hand autograd a dummy."""

    @staticmethod
    def forward(ctx, x, weight, fuse):
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        wgrad = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if not ctx.fuse:
            return grad_out @ weight, wgrad, None
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.main_grad.add_(wgrad)
            weight.grad_added_to_main_grad = True
            dummy = torch.full(weight.shape, float("nan"))  # garbage, as TE's torch.empty may be
            return grad_out @ weight, dummy, None
        return grad_out @ weight, None, None


class FakeTELinear(nn.Module):
    def __init__(self, d_in, d_out, fuse=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.fuse_wgrad_accumulation = fuse

    def forward(self, x):
        return _FusedLinearFn.apply(x, self.weight, self.fuse_wgrad_accumulation)


FakeTELinear.__module__ = "transformer_engine.pytorch.module.linear"


class FakeTENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([FakeTELinear(6, 6), FakeTELinear(6, 6)])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def _reference_step(model, x, y, opt):
    """Plain autograd: what the fused TE path must reproduce."""
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def te_worker(rank, world, *, strategy):
    torch.manual_seed(0)
    base = FakeTENet()
    reference = copy.deepcopy(base)
    for b in reference.blocks:
        b.fuse_wgrad_accumulation = False  # plain autograd
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    model, opt = mf.fully_shard(
        base, lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-4), fsdp_unit_modules=[FakeTELinear],
        zero_dp_strategy=strategy,
    )
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 3, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        _reference_step(reference, x, y, ref_opt)
    full = mf.get_full_state_dict(model)
    with model.compute_params_registered() as module:
        fused = [p for p in module.parameters() if hasattr(p, "grad_added_to_main_grad")]
    return max((full[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters()), len(fused)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_te_fused_wgrad_accumulation_matches_plain_training(pool2, strategy):
    for diff, fused in pool2.run(te_worker, strategy=strategy):
        assert fused == 2
        assert diff < 1e-5


def test_te_modules_are_recognised_without_importing_te():
    assert te_compat.is_te_module(FakeTELinear(2, 2)) and not te_compat.is_te_module(nn.Linear(2, 2))
    assert list(te_compat.fused_wgrad_params(FakeTENet())) and not te_compat.fused_wgrad_params(nn.Linear(2, 2))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 dtype in this torch")
def test_fp8_parameters_are_refused_naming_the_module():
    net = FakeTENet()
    net.blocks[1].weight = nn.Parameter(net.blocks[1].weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(NotImplementedError, match=r"blocks\.1\.weight.*FakeTELinear"):
        te_compat.check_supported(net)
    quantized = FakeTENet()
    quantized.blocks[0].primary_weights_in_fp8 = True
    with pytest.raises(NotImplementedError, match=r"blocks\.0\.weight"):
        te_compat.check_supported(quantized)


# -- streams -----------------------------------------------------------------------------------
def test_streams_are_a_no_op_layer_on_cpu():
    comm = streams.CommStreams(torch.device("cpu"))
    assert not comm.active
    with comm.on(streams.StreamKind.ALL_GATHER):
        value = torch.ones(2) * 2
    assert comm.record(streams.StreamKind.REDUCE_SCATTER) is None
    comm.wait(None)
    assert value.tolist() == [2.0, 2.0]


class RecordingStreams(streams.CommStreams):
    """Stands in for the CUDA streams on the CPU: records each entry into a stream and
    whether work is being issued inside one."""

    def __init__(self, trace: list) -> None:
        super().__init__(torch.device("cpu"), enabled=False)
        self.trace, self.inside = trace, False

    @contextlib.contextmanager
    def on(self, kind, ready=None):
        # ready=None: the stream first waits for everything the compute stream queued.
        self.trace.append(("enter", kind, ready is None))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def record(self, kind=None):
        self.trace.append(("record", kind, self.inside))
        return ("event", kind)

    def wait(self, event):
        self.trace.append(("event_wait", event, self.inside))


def stream_protocol_worker(rank, world, *, strategy, comm_dtype):
    """Train with gradient accumulation while recording the reduce-scatter stream's
    protocol (grad_reduce_pipeline: [Note: the reduce-scatter stream])."""
    policy = mf.MixedPrecisionPolicy(grad_comm_dtype=comm_dtype)
    model = mf.fully_shard_model(make_model("net"), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                 mixed_precision_policy=policy, check_for_nan_in_grad=True)
    opt = mf.fully_shard_optimizer(make_optimizer("sgd")(model.parameters()))
    pipe, trace = model.grad_reduce_pipeline, []
    recorder = pipe.comm_streams = RecordingStreams(trace)
    originals = collectives.reduce_scatter, collectives.all_reduce, collectives.Handle.wait
    release, accumulate = pipe.allocator.release, pipe.accumulate

    def issuing(fn):
        def wrapper(*args, **kwargs):
            trace.append(("issue", kwargs["label"], recorder.inside))
            return fn(*args, **kwargs)
        return wrapper

    def waiting(handle):
        trace.append(("wait", handle.label, recorder.inside))
        return originals[2](handle)

    def releasing(tensor):
        trace.append(("release", recorder.inside))
        release(tensor)

    def stashing(group, index, param):
        if param.grad is not None and group.strategy.shards_grads:  # a raw gradient the pipeline keeps
            weakref.finalize(param.grad, trace.append, ("grad_freed", group.label))
        return accumulate(group, index, param)

    def copying_in(group, grads, bucket, **kwargs):
        trace.append(("copy_in", group.label, recorder.inside))
        return copy_in(group, grads, bucket, **kwargs)

    copy_in, pipe._copy_in = pipe._copy_in, copying_in
    collectives.reduce_scatter, collectives.all_reduce = issuing(originals[0]), issuing(originals[1])
    collectives.Handle.wait = waiting
    pipe.allocator.release, pipe.accumulate = releasing, stashing
    try:
        train_steps(model, opt, make_batches("net", 3, batch=4 * world), rank, world, microbatches=2)
    finally:
        collectives.reduce_scatter, collectives.all_reduce, collectives.Handle.wait = originals
    reference = make_model("net")
    ref_opt = make_optimizer("sgd")(reference.parameters())
    for x, y in make_batches("net", 3, batch=4 * world):
        ref_opt.zero_grad()
        loss_fn("net", reference(x), y).backward()
        ref_opt.step()
    full = mf.get_full_state_dict(model)
    return trace, max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("strategy,comm_dtype", [
    ("optim_grads_params", None), ("optim_grads", None), ("optim", None), ("optim", torch.float64), ("no_shard", None),
])
def test_reductions_follow_the_stream_protocol(pool2, strategy, comm_dtype):
    """Every reduction is issued inside the reduce-scatter stream, entered only after
    the compute stream's work; waits, releases and the dropping of raw gradients all
    happen outside it, and a raw gradient is dropped only after its reduction's wait."""
    for trace, diff in pool2.run(stream_protocol_worker, strategy=strategy, comm_dtype=comm_dtype):
        assert diff < (1e-5 if comm_dtype is None else 1e-4)
        issues = [e for e in trace if e[0] == "issue"]
        assert issues and all(inside for _, _, inside in issues)
        copies = [e for e in trace if e[0] == "copy_in"]
        assert all(inside for _, _, inside in copies) and (bool(copies) == strategy.startswith("optim_grads"))
        enters = [e for e in trace if e[0] == "enter"]
        assert len(enters) == len(issues) and all(kind is streams.StreamKind.REDUCE_SCATTER and waits
                                                  for _, kind, waits in enters)
        assert not any(e[2] for e in trace if e[0] == "wait") and not any(e[1] for e in trace if e[0] == "release")
        # [Note: the issued event]: each launch ends with an event on the reduce-scatter
        # stream, and the compute stream waits for it just before the collective's wait.
        records = [e for e in trace if e[0] == "record"]
        assert len(records) == len(issues) and all(kind is streams.StreamKind.REDUCE_SCATTER for _, kind, _ in records)
        event_waits = [i for i, e in enumerate(trace) if e[0] == "event_wait"]
        assert len(event_waits) == len(issues)
        for i in event_waits:
            assert trace[i][1] == ("event", streams.StreamKind.REDUCE_SCATTER) and not trace[i][2]
            assert trace[i + 1][0] == "wait"
        last: dict = {}
        freed = 0
        for event in trace:
            if event[0] in ("issue", "wait"):
                last.setdefault(event[1], []).append(event[0])
            elif event[0] == "grad_freed":
                freed += 1
                assert last[event[1]][-1] == "wait", (event, last[event[1]][-3:])
        assert freed > 0 if strategy.startswith("optim_grads") else freed == 0


def test_the_side_streams_are_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(streams.STREAMS_ENV, raising=False)
    assert streams.side_streams_enabled()
    monkeypatch.setenv(streams.STREAMS_ENV, "off")
    assert not streams.side_streams_enabled()
    monkeypatch.setenv(streams.STREAMS_ENV, "on")
    assert streams.side_streams_enabled()
    assert not streams.CommStreams(torch.device("cpu")).active  # never on the CPU
    monkeypatch.setenv(streams.STREAMS_ENV, "maybe")
    with pytest.raises(ValueError, match="MFSDP_COMM_STREAMS='maybe'"):
        streams.side_streams_enabled()


def test_cuda_needs_a_torch_whose_nccl_work_holds_its_tensors():
    with pytest.raises(RuntimeError, match=r"torch >= 2\.8"):
        streams.check_torch_for_device(torch.device("cuda", 0), version=(2, 7))
    streams.check_torch_for_device(torch.device("cuda", 0), version=(2, 8))
    streams.check_torch_for_device(torch.device("cpu"), version=(2, 1))


def test_only_the_device_and_streams_modules_call_torch_cuda():
    """STYLE 11: one small device module (device.py, with streams.py) talks to
    torch.cuda, so CPU/gloo and CUDA/NCCL share every other code path."""
    import ast
    import pathlib

    package = pathlib.Path(mf.__file__).parent
    allowed = {package / "comm" / "device.py", package / "comm" / "streams.py"}
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                    and node.value.id == "torch"):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders, offenders


def test_in_place_all_gather_input_is_exactly_the_own_slice():
    """NCCL gathers in place (no clone of the ZeRO-1/2 shard) only when the input is
    this rank's slice of the output; any other alias is cloned first."""
    out = torch.arange(12.0)
    assert collectives.is_own_slice(out[8:12], out, rank=2, world=3)
    assert collectives.is_own_slice(out, out, rank=0, world=1)  # world 1: input is output
    assert not collectives.is_own_slice(out[4:8], out, rank=2, world=3)  # another rank's slice
    assert not collectives.is_own_slice(out[8:11], out, rank=2, world=3)  # not an equal split
    assert not collectives.is_own_slice(out.view(4, 3)[:, 0], out, rank=0, world=3)  # strided
    assert not collectives.is_own_slice(out[8:12].to(torch.float64), out, rank=2, world=3)
