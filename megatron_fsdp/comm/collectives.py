"""Stateless collective wrappers. Each takes its group and tensors explicitly and
returns a ``Work`` handle (or ``None`` when synchronous); the pipelines own the
handles. Every call is reported to the active ``CollectiveRecorder``s, which is how
tests assert collective counts and the benchmark counts bytes moved."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import time
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import release_after_wait as inflight, p2p_transport


@dataclasses.dataclass
class CollectiveRecorder:
    """Counts calls and payload bytes per collective kind.

    Payload is the unsharded size: the gathered output of an all-gather, the input
    of a reduce-scatter, the tensor of an all-reduce or broadcast.
    """

    counts: Counter = dataclasses.field(default_factory=Counter)
    bytes: Counter = dataclasses.field(default_factory=Counter)
    labels: list = dataclasses.field(default_factory=list)
    control: Counter = dataclasses.field(default_factory=Counter)
    """Small bookkeeping collectives (``control_all_reduce``: gradient-presence and
    weight-edit flags) by label, in calls; their bytes are in ``control_bytes``."""
    control_bytes: int = 0

    def record(self, kind: str, tensor: torch.Tensor, label: str) -> None:
        if kind == "control":
            self.control[label] += 1
            self.control_bytes += tensor.numel() * tensor.element_size()
            return
        self.counts[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.labels.append((kind, label))

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.labels.clear()
        self.control.clear()
        self.control_bytes = 0


_recorders: list[CollectiveRecorder] = []

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def record_collectives(recorder: Optional[CollectiveRecorder] = None) -> Iterator[CollectiveRecorder]:
    """``with record_collectives() as rec: ...`` counts the package's collectives."""
    recorder = recorder or CollectiveRecorder()
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


def _record(kind: str, tensor: torch.Tensor, label: str) -> None:
    for recorder in _recorders:
        recorder.record(kind, tensor, label)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: usually a peer rank died or stalled."""


# [Note: collective timeouts]
# A timeout belongs to the model that issues the collective
# (``DistributedDataParallelConfig.collective_timeout_s``): its pipelines pass it to
# every call, and two models in one process keep their own. How it is enforced
# depends on where the tensors live:
# * CPU tensors (gloo): ``Work.wait(timeout=...)`` blocks the host for at most that
#   long; a stalled peer surfaces as ``CollectiveError`` naming the collective.
# * Device tensors (NCCL): ``Work.wait()`` only makes the current stream wait for the
#   collective and returns at once; ``wait(timeout=...)`` would instead block the
#   host until the collective completes (a host sync on every prefetch and gradient
#   wait), its "timed out" branch could never fire, and a timed-out NCCL
#   communicator cannot be recovered anyway. So on devices the wait never takes a
#   timeout: the process group's own timeout applies, enforced by its watchdog
#   (``init_process_group(timeout=...)`` or ``new_group(timeout=...)``; set
#   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, the default, to abort on it).

def as_timeout(seconds: Optional[float]) -> Optional[datetime.timedelta]:
    if seconds is None:
        return None
    if seconds <= 0:
        raise ValueError(f"collective_timeout_s={seconds} must be positive (or None for the process group's timeout)")
    return datetime.timedelta(seconds=seconds)


def wait_work(work, timeout: Optional[datetime.timedelta], *, on_device: bool) -> None:
    """Wait for one transport operation (see [Note: collective timeouts])."""
    if on_device or timeout is None:
        work.wait()
    elif not work.wait(timeout=timeout):
        raise TimeoutError(f"no completion within {timeout.total_seconds():g}s")


@dataclasses.dataclass
class Handle:
    """An in-flight collective: ``wait()`` raises ``CollectiveError`` naming it.

    A collective may be several transport operations (point-to-point sends and
    receives) plus a local ``finish`` step (summing received pieces) that runs once,
    on the first ``wait()`` after they all completed."""

    works: list
    kind: str
    label: str
    group: dist.ProcessGroup
    finish: Optional[Callable[[], None]] = None
    timeout: Optional[datetime.timedelta] = None
    """The issuing model's limit (``None``: the process group's); CPU tensors only."""
    on_device: bool = False
    """The tensors live on an accelerator: never a host-blocking timed wait."""
    sentinel: Optional[_WorkSentinel] = None
    """Dies with the works (see [Note: gloo works are freed before exit])."""

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        try:
            for work in self.works:
                wait_work(work, self.timeout, on_device=self.on_device)
        except Exception as exc:  # a dead peer surfaces as a gloo/NCCL RuntimeError
            raise _error(self.kind, self.label, self.group, exc, self.timeout) from exc
        finally:
            inflight.forget(self)
        self.works = []
        if self.sentinel is not None:
            _released.add(self.sentinel)
            self.sentinel = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def _error(
    kind: str, label: str, group: dist.ProcessGroup, exc: BaseException, timeout: Optional[datetime.timedelta]
) -> CollectiveError:
    limit = f"{timeout.total_seconds():g}s" if timeout is not None else "the process group's timeout"
    return CollectiveError(
        f"megatron_fsdp: {kind} '{label}' over {dist.get_world_size(group)} ranks failed on rank "
        f"{dist.get_rank()}: {exc}. A peer rank probably died or stalled; check its log. "
        f"(Blocking limit: {limit}; set DistributedDataParallelConfig.collective_timeout_s.)"
    )


# [Note: gloo works are freed before exit]
# A gloo collective's work holds Python objects: its tensors (torch 2.13 keeps a
# tensor's Python wrapper alive while C++ holds it) and the launching thread's
# thread-local state (in backward, autograd's ``contextvars.Context``). Freeing the
# work takes the GIL. gloo's worker thread keeps its own reference until just after it
# wakes the waiter, so it frees the work whenever ``Handle.wait()`` drops ours first
# (a quarter of the works, measured on 2 ranks). If that thread reaches the GIL while
# the interpreter finalizes, CPython ends it inside a noexcept C++ destructor:
# std::terminate, "terminate called without an active exception" (up to half the runs
# of a two-model script that calls ``destroy_process_group()`` with the models alive
# and exits; tests/test_exit.py). DDP's
# reducer keeps a bucket's work until the next iteration, so there the main thread
# frees it.
# So each launch puts a sentinel object in thread-local state, which the work copies;
# the sentinel dies with the work. ``Handle.wait()`` hands the sentinel to
# ``_released``, and an atexit hook (atexit runs before finalization) sleeps, letting
# go of the GIL, until every released work is freed: usually none is left, and one
# costs the time its worker thread needs to be scheduled (about 1 ms). The hook is
# registered the first time a collective over CPU tensors is launched here (the first
# sentinel), not at import: a process that never issues one has nothing to wait for,
# and importing the package leaves its exit alone. Works never
# waited (a handle dropped in flight) are not awaited: finish_param_sync() first.
# CPU tensors (gloo) only: NCCL's works are held and freed by its watchdog on its own
# schedule, and the CUDA path is kept as it was measured on a GPU.
class _WorkSentinel:
    __slots__ = ("__weakref__",)


_SENTINEL_KEY = "megatron_fsdp.work_sentinel"
_tls_api = hasattr(torch._C, "_stash_obj_in_tls") and hasattr(torch._C, "_remove_obj_from_tls")
_released: "weakref.WeakSet[_WorkSentinel]" = weakref.WeakSet()
_EXIT_WAIT_S = 2.0  # a bound, should a released work never be freed


def _launch_with_sentinel(launch: Callable[[], Any]) -> tuple[Any, Optional[_WorkSentinel]]:
    if not _tls_api:
        return launch(), None
    _wait_for_released_works_at_exit()
    sentinel = _WorkSentinel()
    torch._C._stash_obj_in_tls(_SENTINEL_KEY, sentinel)
    try:
        return launch(), sentinel
    finally:
        torch._C._remove_obj_from_tls(_SENTINEL_KEY)


def _await_released_works() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    while len(_released) and time.monotonic() < deadline:
        time.sleep(0.001)


_exit_wait_registered = False


def _wait_for_released_works_at_exit() -> None:
    """Register ``_await_released_works`` with atexit, once per process."""
    global _exit_wait_registered
    if not _exit_wait_registered:
        _exit_wait_registered = True
        atexit.register(_await_released_works)


def _issue(
    kind: str,
    label: str,
    group: dist.ProcessGroup,
    launch,
    async_op: bool,
    tensors: tuple[torch.Tensor, ...],
    timeout: Optional[datetime.timedelta],
) -> Optional[Handle]:
    """Launch asynchronously always, so that a synchronous call also waits with the
    timeout and fails with a named error instead of hanging. ``launch`` returns a
    ``Work`` or a (works, finish) pair from a point-to-point transport."""
    try:
        on_device = tensors[0].device.type != "cpu"
        launched, sentinel = _launch_with_sentinel(launch) if not on_device else (launch(), None)
        works, finish = launched if isinstance(launched, tuple) else ([launched], None)
        handle = Handle(works, kind, label, group, finish, timeout=timeout, on_device=on_device, sentinel=sentinel)
    except Exception as exc:
        raise _error(kind, label, group, exc, timeout) from exc
    inflight.register(handle, f"{kind}:{label}", tensors)
    if async_op:
        return handle
    handle.wait()
    return None


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool,
    label: str = "",
    timeout: Optional[datetime.timedelta] = None,
) -> Optional[Handle]:
    """Gather equal shards into ``output`` (flat, ``group.size() * shard.numel()``).
    ``shard`` may be this rank's own slice of ``output`` (an in-place gather)."""
    _record("all_gather", output, label)
    with record_function(f"megatron_fsdp::all_gather:{label}"):
        if p2p_transport.applies(group, output):
            launch = lambda: p2p_transport.all_gather(output, shard, group)  # noqa: E731
        else:
            if _aliases(shard, output) and not (
                output.is_cuda and is_own_slice(shard, output, dist.get_rank(group), dist.get_world_size(group))
            ):
                # gloo needs a distinct input; NCCL gathers in place when the input is
                # exactly this rank's slice of the output (sendbuff == recvbuff + rank *
                # count, as FSDP2's copy-in relies on), which saves the copy there.
                shard = shard.clone()
            launch = lambda: _all_gather_flat(output, shard, group=group, async_op=True)  # noqa: E731
        return _issue("all_gather", label, group, launch, async_op, (output, shard), timeout)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType,
    async_op: bool,
    label: str = "",
    timeout: Optional[datetime.timedelta] = None,
) -> Optional[Handle]:
    """Reduce ``full`` across the group; this rank's shard lands in ``output``
    (which may be this rank's own slice of ``full``)."""
    _record("reduce_scatter", full, label)
    with record_function(f"megatron_fsdp::reduce_scatter:{label}"):
        if _is_identity(output, full, group, op):
            launch = lambda: ([], None)  # noqa: E731
        elif p2p_transport.applies(group, full):
            launch = lambda: p2p_transport.reduce_scatter(output, full, group, op)  # noqa: E731
        else:
            launch = lambda: _reduce_scatter_flat(output, full, op=op, group=group, async_op=True)  # noqa: E731
        return _issue("reduce_scatter", label, group, launch, async_op, (full, output), timeout)


def is_own_slice(shard: torch.Tensor, output: torch.Tensor, rank: int, world: int) -> bool:
    """``shard`` is exactly the ``rank``-th of ``world`` equal slices of flat ``output``."""
    n = shard.numel()
    return (
        shard.dtype == output.dtype
        and shard.is_contiguous()
        and output.is_contiguous()
        and output.numel() == n * world
        and shard.data_ptr() == output.data_ptr() + rank * n * output.element_size()
    )


_IDENTITY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def _is_identity(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, op) -> bool:
    """[Note: one-rank reductions] A reduction over one rank into its own input
    (the sum, mean or extreme of one value) leaves it as it is: nothing to send or
    copy, so no transport call is made."""
    return (
        any(op == known for known in _IDENTITY_OPS)
        and dist.get_world_size(group) == 1
        and output.dtype == full.dtype
        and output.numel() == full.numel()
        and output.data_ptr() == full.data_ptr()
    )


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType,
    async_op: bool,
    label: str = "",
    timeout: Optional[datetime.timedelta] = None,
) -> Optional[Handle]:
    _record("all_reduce", tensor, label)
    with record_function(f"megatron_fsdp::all_reduce:{label}"):
        if _is_identity(tensor, tensor, group, op):
            launch = lambda: ([], None)  # noqa: E731
        else:
            launch = lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True)  # noqa: E731
        return _issue("all_reduce", label, group, launch, async_op, (tensor,), timeout)


def broadcast(
    tensor: torch.Tensor,
    src_group_rank: int,
    group: dist.ProcessGroup,
    *,
    label: str = "",
    timeout: Optional[datetime.timedelta] = None,
) -> None:
    _record("broadcast", tensor, label)
    with record_function(f"megatron_fsdp::broadcast:{label}"):
        launch = lambda: dist.broadcast(tensor, group=group, group_src=src_group_rank, async_op=True)  # noqa: E731
        _issue("broadcast", label, group, launch, False, (tensor,), timeout)


def control_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType,
    label: str,
    timeout: Optional[datetime.timedelta] = None,
) -> None:
    """A blocking all-reduce of a few flags that decides what the data collectives do;
    recorded apart from them (``CollectiveRecorder.control``)."""
    _record("control", tensor, label)
    with record_function(f"megatron_fsdp::control:{label}"):
        launch = lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True)  # noqa: E731
        _issue("all_reduce", label, group, launch, False, (tensor,), timeout)
