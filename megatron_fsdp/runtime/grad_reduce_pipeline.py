"""``GradReducePipeline``: from autograd's raw gradients to reduced main gradients.

Per group and per backward pass::

    param.grad --copy/add--> bucket --reduce--> main grad (+= or copy) --> optimizer

* ZeRO-0/1 accumulate raw gradients straight into the replicated main-grad buffer
  and reduce it once per optimization step (all-reduce / reduce-scatter), when the
  group is complete in a backward pass that syncs.
* ZeRO-2/3 cannot hold unsharded gradients across microbatches: every backward
  copies them into a temporary bucket, reduce-scatters it, and *adds* the reduced
  shard into the sharded main-grad buffer.

[Note: one collective order on every rank] Groups are reduced in one fixed order
(``self.groups``: the reverse of the buffer's group order, which is roughly the
order gradients arrive in). A group whose gradients are complete waits until
every group before it was launched; the end of backward launches the rest, in the
same order. Ranks whose graphs differ (layer drop, unused branches) therefore
issue the same collectives in the same sequence; readiness only decides how early.

[Note: gradient presence] Each rank records which parameters received a gradient
since the last zeroing; at each gradient sync the flags are combined with MAX over
the data-parallel ranks, and a parameter that no rank used keeps ``grad=None``
(as DDP with ``find_unused_parameters=True``), so optimizers skip it.

[Note: the reduction lifecycle] Each group carries two state machines (enums.py,
transitions checked in ``_GroupGradState.move``) and two counts:

* ``reduce`` (``GroupReduceState``), per backward pass: IDLE -> REQUESTED (``reduce``,
  or ``reduce_remaining`` at the end) -> LAUNCHED (``_drain`` in the fixed order) ->
  IDLE (``end_backward``). ``start_all`` launches straight from IDLE or REQUESTED. Its
  launch usually comes after ``end_backward`` (the end of a backward that syncs), so a
  group it launched stays LAUNCHED through the next backward: that pass skips it in
  ``_drain`` and ``start_all`` reduces it after that pass's end, on every rank alike.
* ``main_grads`` (``MainGradState``), across passes: ACCUMULATING -> REDUCED (ZeRO-0/1,
  when a reduction is finalised) -> OUTER_REDUCED (HSDP/HFSDP, outer collective issued;
  ZeRO-2/3 come from ACCUMULATING) -> ACCUMULATING (``rebase`` or ``zero``).
* ``reductions_since_zero``: launches since the last zeroing (0: the buffer is zero;
  1: the first reduction, which writes instead of adding).
* ``backwards_since_launch``: backward passes begun since the last launch (ZeRO-0/1:
  ``start_all`` must reduce a group that has any).

[Note: reducing twice without zeroing] ZeRO-0/1 reduce the persistent buffer in
place. Before more gradients are accumulated on top of a reduced value, the buffer
is *rebased*: scaled (and, for ZeRO-1, other ranks' regions cleared) so that the
next reduction reproduces the reduced value exactly once and adds the new
gradients' reduction: reduce(rebased + g2) = reduced + reduce(g2).

The reduce-scatter never writes into its own source: ZeRO-1 reduces into a
temporary shard and copies it into place (upstream once accumulated the result
back into the source shard, doubling the local gradient). When ``grad_comm_dtype``
differs from the main-grad dtype, the source is a temporary bucket of the wire dtype
that lives only for the collective.

[Note: copy-in at launch] ZeRO-2/3 keep each raw gradient as autograd made it
until the group's reduction is launched, then copy (and scale) them all into the
temporary bucket at once, rather than one by one as they arrive. On CUDA that copy
runs on the reduce-scatter stream, overlapping the backward compute of the next
group; on the CPU it is the same work at a later moment, with the same arithmetic.

[Note: the reduce-scatter stream] (streams.py: [Note: the CUDA stream design]) A
launch enters the reduce-scatter stream, which first waits for everything the
compute stream has queued (the gradients), and there does the copy-in, the scaling,
the NaN note and the collective's issue (NCCL's stream waits for this one). The
compute stream meets the result in ``_finish``: it waits for an event recorded at
the end of the launch ([Note: the issued event]) and ``Handle.wait()`` makes it wait
for the collective, and only then are the temporaries
released and the raw gradients dropped, so the caching allocator never hands their
bytes to compute work that could run before the copy (no ``record_stream``). Every
entry into the stream waits for the compute stream, so a block the stream allocated
and the compute stream used is also safe to reuse there. On CPU there is no stream.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives
from ..compat import transformer_engine as te_compat
from ..buffers.allocator import StorageResizeAllocator
from ..enums import GroupReduceState, MainGradState, ShardingStrategy
from ..mixed_precision import MixedPrecisionPolicy
from .nan_check import NonFiniteGradTracker
from ..buffers.param_and_grad_buffer import ParameterGroup
from ..comm.streams import CommStreams, StreamKind

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradReduceOptions:
    per_token_loss: bool
    """The loss is a sum over tokens: no averaging over data-parallel replicas."""
    average_in_collective: bool
    """Use ReduceOp.AVG instead of pre-scaling."""
    overlap: bool
    """Launch collectives asynchronously as groups complete."""
    max_inflight: int = 1
    """Asynchronous reductions allowed in flight at once. Each holds temporary
    buckets (ZeRO-2/3: a whole group's unsharded gradients), so an unbounded queue
    would keep every unit's gradients alive until the end of backward."""
    check_for_nan: bool


@dataclasses.dataclass(eq=False)
class _GroupGradState:
    label: str
    """The group's label, for errors."""
    used: torch.Tensor
    """Per item: received a gradient on this rank since the last zeroing (0/1)."""
    ready: set = dataclasses.field(default_factory=set)
    """Item indices whose gradient arrived in the current backward pass."""
    grads: list = dataclasses.field(default_factory=list)
    """ZeRO-2/3: this pass's raw gradients as (item index, flat gradient), in arrival
    order, until the group's reduction copies them into its bucket ([Note: copy-in at
    launch]); ZeRO-0/1: the first gradients after zeroing ([Note: first gradient after
    zeroing])."""
    stashed: set = dataclasses.field(default_factory=set)
    """ZeRO-0/1: items with a gradient in ``grads`` (their compute ``.grad`` is None)."""
    reduce: GroupReduceState = GroupReduceState.IDLE
    """This backward pass's reduction ([Note: the reduction lifecycle])."""
    main_grads: MainGradState = MainGradState.ACCUMULATING
    """What the main-grad buffer holds ([Note: reducing twice without zeroing])."""
    reductions_since_zero: int = 0
    """Reductions launched since the last zeroing of the whole group."""
    backwards_since_launch: int = 0
    """Backward passes begun since this group's last launch. Every rank runs the same
    backward passes, so (unlike which gradients arrived) this is the same on every
    rank: it decides whether ``start_all`` must reduce a ZeRO-0/1 group."""

    def move(self, new: "GroupReduceState | MainGradState") -> None:
        """Every change of ``reduce`` and ``main_grads`` goes through here, checked
        against the enum's legal transitions. Asking for the state a machine is
        already in changes nothing and is no transition."""
        if isinstance(new, GroupReduceState):
            if new is not self.reduce:
                self.reduce = self.reduce.check_transition(new, owner=f"parameter group {self.label}")
        elif new is not self.main_grads:
            self.main_grads = self.main_grads.check_transition(new, owner=f"parameter group {self.label}")


@dataclasses.dataclass(eq=False)
class _Pending:
    group: ParameterGroup
    work: Optional[collectives.Handle]
    finalize: Callable[[], None]
    holds_memory: bool
    """Temporary buckets stay allocated until this reduction is finalised."""
    inputs: list = dataclasses.field(default_factory=list)
    """The raw gradients copied in on the reduce-scatter stream: kept alive until the
    compute stream has waited for the collective, so that the caching allocator
    cannot hand their memory to compute work that might run before the copy."""
    issued: Optional[object] = None
    """CUDA event at the end of the reduce-scatter stream's work for this launch (copy-
    in, NaN note, issue); ``None`` on CPU or with the side streams off."""


class GradReducePipeline:
    def __init__(
        self,
        groups: list[ParameterGroup],
        *,
        policy: MixedPrecisionPolicy,
        options: GradReduceOptions,
        allocator: StorageResizeAllocator,
        comm_streams: Optional[CommStreams] = None,
    ) -> None:
        self.groups: list[ParameterGroup] = []
        self.comm_streams = comm_streams or CommStreams(torch.device("cpu"))
        """Where reductions are issued from ([Note: the reduce-scatter stream]); none on CPU."""
        self._outer_reduced = False
        self.policy = policy
        self.options = options
        self.allocator = allocator
        self._state: dict[ParameterGroup, _GroupGradState] = {}
        self.global_used: dict[ParameterGroup, torch.Tensor] = {}
        """Per group, after a sync: which items some rank used (see [Note: gradient presence])."""
        for g in groups:
            if g.requires_grad:
                self.add_group(g)
        self._pending: list[_Pending] = []
        self._outer_pending: dict[ParameterGroup, collectives.Handle] = {}
        """Outer (HSDP/HFSDP) collectives in flight, per group: see reduce_outer."""
        self._views: dict[nn.Parameter, torch.Tensor] = {}
        self.nonfinite = NonFiniteGradTracker()
        """check_for_nan: flags noted on the device per reduction, read once per step."""
        self.timeout = None
        """The owning model's collective timeout (collectives: [Note: collective timeouts])."""

    def add_group(self, group: ParameterGroup) -> None:
        """Start reducing ``group`` (at construction, or once a frozen group is unfrozen)."""
        self._state[group] = _GroupGradState(label=group.label, used=torch.zeros(len(group.params), dtype=torch.int32))
        self.groups = sorted(self._state, key=lambda g: -g.index)  # [Note: one collective order on every rank]

    # -- gradients arrive ----------------------------------------------------------
    def install_grad_views(self, views: dict[nn.Parameter, torch.Tensor]) -> None:
        """Let autograd accumulate straight into the replicated main-grad buffer
        (``param.grad`` is a view of it), saving an allocation and a copy per
        parameter per backward. Not for TE's fused-wgrad weights: autograd would add
        TE's dummy gradient into the view."""
        views = {p: v for p, v in views.items() if not hasattr(p, "grad_added_to_main_grad")}
        self._views.update(views)
        for param, view in views.items():
            if param.requires_grad:
                param.grad = view

    def grad_view_of(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        return self._views.get(param)

    @torch.no_grad()
    def accumulate(self, group: ParameterGroup, index: int, param: nn.Parameter) -> bool:
        """Take ``param.grad`` into the group's buffer; True once the group is complete."""
        grad = te_compat.take_grad(param, param.grad)  # TE's fused main_grad, if it wrote one
        if grad is not None and grad.layout is not torch.strided:
            # nn.Embedding(sparse=True): the flat buffers hold dense gradients, so the
            # rows it did not touch become zeros, which SGD and Adagrad (torch's
            # optimizers that take sparse gradients) update exactly as they would skip them.
            grad = grad.to_dense()
        state = self._state[group]
        if group.strategy.shards_grads:
            param.grad = None
            if grad is not None:
                state.grads.append((index, grad.reshape(-1)))
        else:
            view = self._views.get(param)
            if grad is not None and grad is not view:
                # autograd made a fresh tensor (the view was taken off at zeroing, none
                # is installed, or someone reset .grad)
                if index in state.stashed or self._holds_zero(group, state, index):
                    state.grads.append((index, grad.reshape(-1)))  # [Note: first gradient after zeroing]
                    state.stashed.add(index)
                    param.grad = None  # a second gradient in this pass comes fresh, to the stash too
                    return self._arrived(state, index, grad)
                group.main_grads.item_in_bucket(index).add_(grad.reshape(-1))
            param.grad = view
        return self._arrived(state, index, grad)

    def _arrived(self, state: _GroupGradState, index: int, grad: Optional[torch.Tensor]) -> bool:
        if grad is not None:
            state.used[index] = 1
        state.ready.add(index)
        return len(state.ready) == len(state.used)

    def _flush_group(self, group: ParameterGroup) -> None:
        state = self._state[group]
        if state.stashed:
            grads, state.grads = state.grads, []
            self._flush_stash(group, grads)

    def _flush_stash(self, group: ParameterGroup, grads: list) -> None:
        """[Note: first gradient after zeroing] ZeRO-0/1: write the stashed first
        gradients into their (zero) items, the first of an item copied, any later
        one of the same pass added, and give the compute parameters their views back."""
        state = self._state[group]
        written: set[int] = set()
        for index, flat in grads:
            target = group.main_grads.item_in_bucket(index)
            if index in written:  # a second gradient in the same pass
                target.add_(flat)
            else:
                target.copy_(flat)
            written.add(index)
        for index in state.stashed:
            param = group.params[index]
            param.grad = self._views.get(param)
        state.stashed.clear()

    @staticmethod
    def _holds_zero(group: ParameterGroup, state: _GroupGradState, index: int) -> bool:
        """[Note: first gradient after zeroing] ZeRO-0/1: the item's main gradient is
        still the zero that ``zero`` wrote, so copying the gradient in equals adding it
        (0 + g == g in every dtype), at one read less, and without the in-place add
        autograd does into an installed view. ``zero`` takes the views off the compute
        parameters so that the first backward after it hands us a fresh tensor. Such
        gradients are stashed like ZeRO-2/3's and copied in when the group's reduction
        is launched (on CUDA on the reduce-scatter stream, overlapping backward), or,
        in a backward that does not reduce (``no_sync``), as soon as the group is
        complete (at the end of backward for a group some of whose parameters got no
        gradient), so the stash never holds more than a group's gradients beyond what
        ZeRO-2/3 hold; the views go back then, and later microbatches accumulate into
        them. Holds when no gradient arrived and no reduction ran since the zeroing; a
        ``.grad`` still attached to the distributed parameter
        (``zero_grad(set_to_none=False)``) may have been written into since, so it
        takes the add."""
        if state.reductions_since_zero != 0 or state.used[index]:
            return False
        with torch._C.DisableTorchFunctionSubclass():  # a read of .grad: no op to route
            return group.dist_params[index].grad is None

    def _copy_in(self, group: ParameterGroup, grads: list, bucket: torch.Tensor, *, accumulate: bool = False) -> None:
        """ZeRO-2/3: write this pass's scaled gradients into the (uninitialised) bucket
        and zero the gaps (absent gradients, padding): one pass over each gradient.
        ``accumulate``: the bucket holds earlier gradients to add to (it is the main-
        grad buffer itself: [Note: one-rank reductions])."""
        scaling = self._scaling(group)
        written: set[int] = set()
        for index, flat in grads:
            target = bucket[slice(*group.layout.item_range(index))]
            if accumulate or index in written:  # earlier gradients, or a second one in this pass
                target.add_(flat, alpha=scaling)
            elif scaling != 1.0:
                torch.mul(flat, scaling, out=target)
            else:
                target.copy_(flat)
            written.add(index)
        if accumulate:
            return
        for index in range(len(group.params)):
            if index not in written:
                bucket[slice(*group.layout.item_range(index))].zero_()
        bucket[group.layout.numel :].zero_()

    # -- reduction -------------------------------------------------------------
    def _comm_dtype(self, group: ParameterGroup) -> torch.dtype:
        return self.policy.comm_dtype_for(group.dtype)

    def reduce(self, group: ParameterGroup, *, sync: bool) -> None:
        """Allow the group's collective for the current backward pass (at most once);
        it is issued as soon as every group before it in the fixed order was.
        ``sync``: ZeRO-0/1 groups reduce in this pass (the same on every rank)."""
        self._request(self._state[group])
        if not self._takes_part(group, sync):
            self._flush_group(group)  # not reduced in this pass: bound the stash to a group
        self._drain(sync)

    @staticmethod
    def _request(state: _GroupGradState) -> None:
        """Asking again (or once launched) changes nothing."""
        if state.reduce is GroupReduceState.IDLE:
            state.move(GroupReduceState.REQUESTED)

    def _takes_part(self, group: ParameterGroup, sync: bool) -> bool:
        return group.strategy.shards_grads or sync

    def _drain(self, sync: bool) -> None:
        for group in self.groups:
            state = self._state[group]
            if state.reduce is GroupReduceState.LAUNCHED or not self._takes_part(group, sync):
                continue
            if state.reduce is not GroupReduceState.REQUESTED:
                return  # a group earlier in the order is not ready: keep the order
            self._launch(group, outer=sync)

    def reduce_remaining(self, *, sync: bool) -> None:
        """End of backward: every group taking part that was not reduced yet, in order
        (a group no gradient reached still joins: the other ranks reduce it)."""
        for group in self.groups:
            if self._takes_part(group, sync):
                self._request(self._state[group])
        self._drain(sync)

    def start_all(self) -> None:
        """Reduce whatever has not been reduced: ZeRO-0/1 groups not reduced since the
        last zeroing, ZeRO-2/3 groups still holding unreduced gradients."""
        for group in self.groups:
            state = self._state[group]
            if group.strategy.shards_grads:
                if state.grads:
                    self._launch(group, outer=True)
            elif state.backwards_since_launch or state.reductions_since_zero == 0:
                # Not ``reductions_since_zero == 0`` alone: zeroing only some items
                # (a parameter that had no gradient stays None) keeps the count, and
                # a backward under set_model_auto_sync(False) was then never reduced.
                self._launch(group, outer=True)

    def _launch(self, group: ParameterGroup, async_op: Optional[bool] = None, *, outer: bool) -> None:
        """``outer``: a syncing reduction, followed by the group's outer one (if any)."""
        state = self._state[group]
        state.move(GroupReduceState.LAUNCHED)
        state.reductions_since_zero += 1
        state.backwards_since_launch = 0
        self._outer_reduced = False  # new shard-level gradients need an outer reduction
        self.rebase(group)  # [Note: reducing twice without zeroing]
        async_op = self.options.overlap if async_op is None else async_op
        strategy, main = group.strategy, group.main_grads
        comm_dtype = self._comm_dtype(group)
        grads, state.grads = state.grads, []

        first = state.reductions_since_zero == 1
        one_rank = strategy.shards_grads and group.layout.world_size == 1 and comm_dtype == main.dtype
        source, output, temps = self._collective_buffers(group, comm_dtype, first=first, one_rank=one_rank)

        op, scaling = self._op(), self._scaling(group)
        with self.comm_streams.on(StreamKind.REDUCE_SCATTER):
            if strategy.shards_grads:
                self._copy_in(group, grads, source, accumulate=one_rank and not first)  # scaled on the way in
            else:
                self._flush_stash(group, grads)
                if source is not main.data:
                    source.copy_(main.data)
            if self.options.check_for_nan:
                self.nonfinite.note(group, source)
            if scaling != 1.0 and not strategy.shards_grads:
                source.mul_(scaling)
            # Always asynchronous here: a synchronous launch waits below, on the
            # compute stream, which is the stream that must see the result.
            if strategy is ShardingStrategy.NO_SHARD:
                work = collectives.all_reduce(
                    source, group.dp.shard_group, op=op, async_op=True, label=group.label, timeout=self.timeout
                )
            else:
                work = collectives.reduce_scatter(
                    output, source, group.dp.shard_group, op=op, async_op=True, label=group.label, timeout=self.timeout
                )
            issued = self.comm_streams.record(StreamKind.REDUCE_SCATTER)
        finalize = self._finalizer(group, output, temps, outer=outer and group.dp.outer_group is not None, first=first)
        pending = _Pending(group, work, finalize, holds_memory=bool(temps), inputs=grads, issued=issued)
        if async_op:
            self._pending.append(pending)
            self._retire(keep=self.options.max_inflight)
        else:
            self._finish(pending)

    def _collective_buffers(
        self, group: ParameterGroup, comm_dtype: torch.dtype, *, first: bool, one_rank: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The collective's input and output for one launch, and the temporaries among
        them. Temporaries are allocated here, on the compute stream, and released once
        it has waited for the collective ([Note: the reduce-scatter stream])."""
        strategy, main = group.strategy, group.main_grads
        if one_rank:
            # [Note: one-rank reductions] A reduce-scatter over one rank is the
            # identity: the gradients go straight into the main-grad buffer (added
            # when it holds earlier ones) and the collective runs in place.
            return main.data, main.data, []
        temps: list[torch.Tensor] = []
        if strategy.shards_grads or comm_dtype != main.dtype:
            # ZeRO-2/3: this pass's gradients; ZeRO-0/1 with a wire dtype: a copy that
            # lives only for the collective (no second persistent buffer).
            source = self.allocator.new(group.layout.padded_numel, comm_dtype, main.device)
            temps.append(source)
        else:
            source = main.data
        if strategy is ShardingStrategy.NO_SHARD:
            output = source
        elif source is main.data:
            # ZeRO-1 without a wire dtype: reduce-scatter in place into this rank's
            # own region of the source (NCCL and gloo both allow exactly this alias).
            output = main.shard
        elif strategy.shards_grads and first and comm_dtype == main.dtype:
            # First reduction since zeroing: the main-grad shard counts as zero
            # ([Note: zeroing by the first reduction]), so the result can land
            # there directly: no output bucket, no add.
            output = main.data
        else:
            output = self.allocator.new(group.layout.shard_numel, comm_dtype, main.device)
            temps.append(output)
        return source, output, temps

    def _finish(self, pending: _Pending) -> None:
        """Wait for one reduction (on CUDA: the compute stream waits, the host does
        not), then accumulate its result and release its temporaries and inputs."""
        # [Note: the issued event] The collective's wait already orders the compute
        # stream after the whole launch (NCCL's stream waited for this one), but only
        # through NCCL's internal stream; waiting for our own event as well makes the
        # ordering explicit in the streams we own, which is what the CUDA sanitizer
        # (and any non-NCCL backend) can follow. A GPU event wait costs no host sync.
        self.comm_streams.wait(pending.issued)
        if pending.work is not None:
            pending.work.wait()
        pending.finalize()
        pending.inputs.clear()

    @torch.no_grad()
    def rebase(self, group: ParameterGroup) -> None:
        """[Note: reducing twice without zeroing] Turn a reduced main-grad buffer into
        a local contribution X whose reduction is the reduced value itself. A
        reduction computes c * (sum over every data-parallel rank); a value held by
        ``holders`` ranks therefore needs X = reduced / (c * holders)."""
        state = self._state[group]
        main = group.main_grads
        avg = self._op() == dist.ReduceOp.AVG
        dp = group.dp
        if group.strategy.shards_grads:
            if state.main_grads is not MainGradState.OUTER_REDUCED:
                return
            self._wait_group(group)
            state.move(MainGradState.ACCUMULATING)
            if group.hfsdp and group.strategy.shards_optimizer:
                piece = main.data.numel() // dp.outer_size
                own = main.data[dp.outer_rank * piece : (dp.outer_rank + 1) * piece].clone()
                main.data.zero_()
                main.data[dp.outer_rank * piece : (dp.outer_rank + 1) * piece].copy_(own * (dp.outer_size if avg else 1))
            elif not avg:
                main.data.div_(dp.outer_size)
            return
        if state.main_grads is MainGradState.ACCUMULATING:
            return
        self._wait_group(group)
        state.move(MainGradState.ACCUMULATING)
        c = 1.0 / dp.scaling_size if avg else self._scaling(group)
        if group.strategy is ShardingStrategy.NO_SHARD:
            main.data.mul_(1.0 / (c * dp.scaling_size))
            return
        own = main.shard.clone()
        main.data.zero_()
        main.shard.copy_(own.mul_(1.0 / (c * dp.outer_size)))

    def _wait_group(self, group: ParameterGroup) -> None:
        if any(p.group is group for p in self._pending):
            self.wait_all()
        self._wait_outer(group)

    def _retire(self, *, keep: int) -> None:
        """Finalise finished reductions in order; block on the oldest while more than
        ``keep`` reductions holding temporary buckets are in flight (in-place ones,
        e.g. an all-reduce of the main-grad buffer, cost no memory and never block)."""
        while self._pending:
            head = self._pending[0]
            done = head.work is None or head.work.is_completed()
            if not done and sum(p.holds_memory for p in self._pending) <= keep:
                return
            self._pending.pop(0)
            self._finish(head)

    def _finalizer(
        self, group: ParameterGroup, output: torch.Tensor, temps: list[torch.Tensor], *, outer: bool, first: bool
    ) -> Callable[[], None]:
        """``first``: the first reduction since zeroing ([Note: zeroing by the first
        reduction]): a ZeRO-2/3 result is written, not added."""
        main = group.main_grads
        strategy = group.strategy

        @torch.no_grad()
        def finalize() -> None:
            if strategy.shards_grads:
                if output is main.data:
                    pass
                elif first:
                    main.data.copy_(output)  # promoting to the main dtype
                else:
                    main.data.add_(output)  # accumulate across microbatches, promoting to the main dtype
            else:
                self._mark_reduced(self._state[group])
                if strategy is ShardingStrategy.NO_SHARD:
                    if output is not main.data:
                        main.data.copy_(output)
                elif output is not main.shard:
                    main.shard.copy_(output)  # copy, never +=: the source already held this gradient
            for temp in temps:
                self.allocator.release(temp)
            if outer:
                self._launch_outer(group)

        return finalize

    @staticmethod
    def _mark_reduced(state: _GroupGradState) -> None:
        """ZeRO-0/1: the buffer holds a reduced value (an outer-reduced one stays so)."""
        if state.main_grads is MainGradState.ACCUMULATING:
            state.move(MainGradState.REDUCED)

    def _op(self) -> dist.ReduceOp.RedOpType:
        return dist.ReduceOp.AVG if self.options.average_in_collective and not self.options.per_token_loss else dist.ReduceOp.SUM

    def _scaling(self, group: ParameterGroup) -> float:
        """Pre-multiplier before the collective: with SUM, 1/dp averages over all
        replicas. With AVG the collective divides by the ranks it spans, which for
        expert parameters under expert parallelism are fewer than the data-parallel
        ranks (each expert rank already summed its experts' gradients over the tokens
        of the whole expert-parallel group): the pre-multiplier span/dp makes it 1/dp
        there too, as Megatron-core's ``expert_gradient_scaling_factor``."""
        if self.options.per_token_loss:
            return 1.0
        dp = group.dp
        if self.options.average_in_collective:
            return dp.shard_size * dp.outer_size / dp.scaling_size
        return 1.0 / dp.scaling_size

    @torch.no_grad()
    def reduce_outer(self) -> None:
        """HSDP/HFSDP: combine the dp-shard-reduced gradients across the outer group,
        once per optimization step (after the last microbatch): all-reduce of the
        shard (HSDP) or reduce-scatter of it into this rank's optimizer piece (HFSDP).
        [Note: overlapped outer reduction] Most groups' outer collectives were already
        launched during backward; this launches the rest and waits for all."""
        if self._outer_reduced:
            return
        self._outer_reduced = True
        for group in self.groups:
            if group.dp.outer_group is not None and self._state[group].main_grads is not MainGradState.OUTER_REDUCED:
                self._launch_outer(group)
        self._wait_outer()

    def _launch_outer(self, group: ParameterGroup) -> None:
        """[Note: overlapped outer reduction] The outer collective of one group, issued
        as soon as its shard-level reduction of a syncing backward is finalised, so it
        runs on the outer process group while backward goes on (FSDP2 and upstream do
        the same). Groups finalise in the fixed reduction order, so every rank issues
        the outer collectives in one order too."""
        # Every inner reduction rebased the group first, so no outer-reduced value is
        # left in it (``main_grads`` is not OUTER_REDUCED here).
        self._state[group].move(MainGradState.OUTER_REDUCED)
        main, outer = group.main_grads, group.dp.outer_group
        label = f"outer:{group.label}"
        if group.hfsdp and group.strategy.shards_optimizer:
            piece = main.data.numel() // group.dp.outer_size
            output = main.data[group.dp.outer_rank * piece : (group.dp.outer_rank + 1) * piece]
            work = collectives.reduce_scatter(
                output, main.data, outer, op=self._op(), async_op=True, label=label, timeout=self.timeout
            )
        else:
            target = main.data if group.strategy is ShardingStrategy.NO_SHARD else main.shard
            work = collectives.all_reduce(target, outer, op=self._op(), async_op=True, label=label, timeout=self.timeout)
        self._outer_pending[group] = work

    def _wait_outer(self, group: Optional[ParameterGroup] = None) -> None:
        for g in [group] if group is not None else list(self._outer_pending):
            work = self._outer_pending.pop(g, None)
            if work is not None:
                work.wait()

    # -- step boundaries ---------------------------------------------------------
    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            self._finish(item)
        self._wait_outer()

    def zeroed_with_grads_attached(self, group: ParameterGroup) -> None:
        """[Note: zeroed gradients that stay attached] After ``zero_grad_buffer()`` (or
        ``zero_grad(set_to_none=False)``) the distributed parameters' ``.grad`` still
        show the buffer, now zero, and a user may write into them before backward
        (a hand-made decay term). PyTorch accumulates backward on top of such a
        value, so the zero is treated as a reduced value, exactly as after a sync:
        the next backward rebases it ([Note: reducing twice without zeroing]) and
        adds its reduction, instead of landing the reduction on the zero (ZeRO-2/3)
        or reducing the edit once per rank (ZeRO-0/1)."""
        state = self._state[group]
        state.reductions_since_zero = max(state.reductions_since_zero, 1)
        if not group.strategy.shards_grads:
            self._mark_reduced(state)
        elif group.dp.outer_group is not None:
            state.move(MainGradState.OUTER_REDUCED)
        elif state.main_grads is MainGradState.OUTER_REDUCED:
            state.move(MainGradState.ACCUMULATING)

    def raise_if_nonfinite(self) -> None:
        """check_for_nan: once per step, after every reduction (see nan_check)."""
        self.nonfinite.raise_if_nonfinite(self.groups)

    def begin_backward(self) -> None:
        """Before gradients accumulate: rebase buffers that hold a reduced value."""
        for group in self.groups:
            self.rebase(group)
            self._state[group].backwards_since_launch += 1

    def end_backward(self) -> None:
        """Write the stashes of groups not reduced in this pass; forget which gradients
        arrived: the next backward pass starts afresh."""
        for group in self._state:
            self._flush_group(group)
        for state in self._state.values():
            state.ready.clear()
            state.move(GroupReduceState.IDLE)

    @torch.no_grad()
    def sync_usage(self) -> None:
        """[Note: gradient presence] Combine the per-item usage flags over every
        data-parallel rank (MAX), one all-reduce per process group."""
        by_dp: dict[tuple, list[ParameterGroup]] = {}
        for group in self.groups:
            by_dp.setdefault((id(group.dp.shard_group), id(group.dp.outer_group)), []).append(group)
        for groups in by_dp.values():
            local = torch.cat([self._state[g].used for g in groups])  # host flags: reading them costs nothing
            device = groups[0].main_grads.device
            # A rank that used every item knows the MAX already (all used): it still
            # joins the all-reduce for the ranks that need it, but never reads the
            # result back, so the common step has no host sync on CUDA.
            used_all = bool(local.all())
            flags = torch.ones(local.numel(), dtype=local.dtype, device=device) if used_all else local.to(device)
            dp = groups[0].dp
            for pg in (dp.shard_group, dp.outer_group):
                if pg is not None and dist.get_world_size(pg) > 1:
                    collectives.control_all_reduce(flags, pg, op=dist.ReduceOp.MAX, label="grad_presence", timeout=self.timeout)
            result = local if used_all else flags.cpu()
            for g, piece in zip(groups, result.split([len(g.params) for g in groups])):
                self.global_used[g] = piece.bool()

    @torch.no_grad()
    def zero(
        self, group: Optional[ParameterGroup] = None, items: Optional[list[int]] = None, *, reducing: bool = False
    ) -> None:
        """Zero the main gradients (of one group's ``items``, or of everything).
        ``reducing``: a backward pass that reduces every ZeRO-2/3 group follows at
        once, so their whole-group zeroing is left to the first reduction."""
        self.wait_all()
        self._outer_reduced = False
        for g in self.groups if group is None else [group]:
            state = self._state[g]
            self._flush_group(g)  # a zeroing inside backward: what arrived so far is zeroed too
            if items is None or len(items) == len(g.params):
                if not (reducing and g.strategy.shards_grads):
                    # [Note: zeroing by the first reduction] A ZeRO-2/3 group reduces in
                    # every backward pass, and its first reduction after a zeroing
                    # writes its whole shard (gaps and padding as zeros) instead of
                    # adding to it, so the memset is skipped when such a pass follows.
                    g.main_grads.data.zero_()
                for param in g.params:  # [Note: first gradient after zeroing]
                    if param.grad is not None and param.grad is self._views.get(param):
                        param.grad = None
                state.used.zero_()
                state.reductions_since_zero = 0
                state.move(MainGradState.ACCUMULATING)
                self.global_used.pop(g, None)
                state.grads.clear()
                continue
            main = g.main_grads
            for index in items:
                (main.item_in_shard(index) if main.is_distributed else main.item_in_bucket(index)).zero_()
                state.used[index] = 0
