"""Module and autograd hooks: when to gather, release and reduce.

Per FSDP unit::

    pre-forward    gather the unit's weights (wait for a prefetch), prefetch the next unit
    post-forward   ZeRO-3: release the weights; register a pre-backward hook on outputs
    pre-backward   gather the weights again, prefetch the unit that runs backward next
    grads ready    per parameter group: reduce, and (ZeRO-3) release its weights

and for the root: pre-forward gathers the parameters outside any unit, the first
pre-backward queues an end-of-backward callback that reduces what is left,
releases what is still gathered and finishes the gradient sync.

[Note: activation recomputation] A checkpointed unit re-runs its forward inside
its backward. The pre-backward hook fires first (it hangs off the unit's outputs)
and marks the unit PRE_BACKWARD; the forward hooks see that mark (or POST_BACKWARD,
once the walk passed the unit) and neither gather nor release, so the unit is
gathered once for the whole recompute+backward.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function

from .all_gather_pipeline import AllGatherPipeline
from ..buffers.allocator import BufferPool
from ..enums import BackwardMode, BucketStatus, ShardingStrategy, TrainingState
from .grad_reduce_pipeline import GradReducePipeline
from .backward_outputs import grad_tensors, refuse_hidden_grad_tensors
from ..buffers.param_and_grad_buffer import ParamAndGradBuffer, ParameterGroup
from .registered_params import direct_call_message
from .unit_schedule import UnitSchedule, finish_order

logger = logging.getLogger(__name__)

# [Note: hooks under torch.compile] Hook bodies resize storages, issue collectives
# and flip unit states: nothing a compiler should trace. Each is a graph break
# that runs eagerly, so torch.compile(model) compiles only the model's own code.
_eager = torch.compiler.disable


@functools.cache  # once per process: see the note
def guard_hooks_under_compile() -> None:
    """[Note: compiled graphs and unit hooks] By default torch.compile does not guard on
    module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a graph traced
    for one model of a class served another whose units hook other modules (no_shard
    has none; ZeRO-3 must gather each unit in its hook), which then read released
    storage: a segfault, or a wrong number where storage stays allocated. So the hook
    guards are turned on; they only add checks, and recompile a graph whose modules'
    hooks changed.

    * Process-wide, because dynamo's settings are: there is no per-model or per-graph
      switch, and the graphs at risk are cached for the process.
    * When: at the first wrap in the process (``MegatronFSDP`` starting its runtime,
      ``experimental.fully_shard``), never at import; ``functools.cache`` makes later
      wraps return at once, so a process that sets it back afterwards keeps its choice.
    * Logged at INFO when it changes the setting (nothing to say if it was already off)."""
    import torch._dynamo.config as config  # already imported by torch.compiler.disable above

    if getattr(config, "skip_nnmodule_hook_guards", False):
        logger.info("megatron_fsdp: torch._dynamo.config.skip_nnmodule_hook_guards set to False "
                    "for this process (compiled graphs must see the unit hooks; see hooks.py)")
        config.skip_nnmodule_hook_guards = False


def _revisit_message(unit: "FSDPUnit") -> str:
    """[Note: one backward per unit] Under ZeRO-3 a unit's weights are released, and its
    gradients reduced, once the backward walk has passed it. Reaching its backward again
    in the same pass would run on released storage; re-gathering it would issue
    collectives the other ranks may not issue (the walk keeps them in step), so refuse.
    Forwards that ran a unit more than once switch to [Note: several forwards, one
    backward] beforehand, so what is left here is a backward that ran its units in
    another order than its forward."""
    return (
        f"megatron_fsdp: the backward reached FSDP unit '{unit.name}' again after its weights were "
        "released (ZeRO-3, optim_grads_params): this rank's backward ran its units in another order "
        "than the forward (a unit's output used again by a unit that ran long after it). Each unit's "
        "backward may run once per backward pass here. Fix: make the unit's last use its last module, "
        "merge the units involved (fsdp_unit_modules), or zero_dp_strategy='optim_grads' (ZeRO-2 keeps "
        "the weights gathered). No weight has changed."
    )


@dataclasses.dataclass(eq=False)
class FSDPUnit:
    index: int
    name: str
    modules: tuple[nn.Module, ...]
    """One module, or neighbours merged into one communication unit (units.py)."""
    groups: list[ParameterGroup]
    state: TrainingState = TrainingState.IDLE

    @property
    def gathers(self) -> bool:
        """no_shard groups are never gathered: such a unit needs no module hooks."""
        return any(g.strategy is not ShardingStrategy.NO_SHARD for g in self.groups)


def _contains(outer: FSDPUnit, inner: FSDPUnit) -> bool:
    """``inner``'s modules live inside ``outer``'s (nested units)."""
    inside = {id(m) for module in outer.modules for m in module.modules()}
    return outer is not inner and id(inner.modules[0]) in inside


class HookRuntime:
    """Owns the unit states and drives the two pipelines from module/autograd hooks."""

    def __init__(
        self,
        *,
        buffer: ParamAndGradBuffer,
        units: list[FSDPUnit],
        all_gather: AllGatherPipeline,
        grad_reduce: GradReducePipeline,
        overlap_param_gather: bool,
        prefetch_depth: int,
        sync_enabled: Callable[[], bool],
        on_backward_start: Callable[[], None],
        on_backward_end: Callable[[], None],
        root_dp_group: Any = None,
        params_registered: Callable[[], bool] = lambda: True,
    ) -> None:
        """``params_registered``: whether the module's compute parameters are registered
        (inside the wrapper's forward or a backward): a unit's forward outside that is
        a direct call (registered_params.py [Note: direct calls of the wrapped module])."""
        self.params_registered = params_registered
        self.buffer = buffer
        self.units = units
        self.all_gather = all_gather
        self.grad_reduce = grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.prefetch_depth = prefetch_depth if overlap_param_gather else 0
        self.sync_enabled = sync_enabled
        self.on_backward_start = on_backward_start
        self.on_backward_end = on_backward_end
        self.root_dp_group = root_dp_group
        self.root_groups = buffer.groups_of_unit(None)
        gathering = [u for u in units if u.gathers]
        self._ancestors = {u: {a for a in gathering if _contains(a, u)} for u in gathering}
        self.schedule: UnitSchedule[FSDPUnit] = UnitSchedule(gathering, finish_order(gathering, _contains))
        self._forward_walk = self.schedule.forward_walk()
        self._backward_walk = self.schedule.backward_walk()
        self._unrequested: list[FSDPUnit] = []
        """Units the backward walk passed whose gradients are not yet requested."""
        self._open: list[FSDPUnit] = []
        """Units whose forward started and whose last module has not run yet."""
        # [Note: one unit sequence on every rank] With gathers in backward (ZeRO-3),
        # reductions wait for the walk to move past their unit.
        self.reduce_at_boundaries = any(g.strategy.shards_params and g.model_weights.is_distributed for g in buffer.groups)
        self._mode = BackwardMode.IDLE
        """How the current (or, between passes, the next) backward is run; changed only by
        ``_enter`` ([Note: several forwards, one backward], [Note: higher-order gradients])."""
        self._released_in_backward: set[FSDPUnit] = set()
        """Units whose gathered weights this backward pass released (walk passed them)."""
        self._training_forwards = 0
        """Training forwards since the last backward began ([Note: several forwards, one backward])."""
        self._unit_reran = False
        """A unit's forward ran again within one forward (weights shared across layers).
        With ``_training_forwards``, what the forwards saw: the next backward's mode is
        decided from them, and they start afresh when it begins."""
        self._finished: set[FSDPUnit] = set()
        """Units whose forward finished in the current forward."""
        self._held_skipped: list[FSDPUnit] = []
        """Units visited as skipped and kept gathered until the forward ends
        (unit_schedule.py [Note: the first forward in an unknown order])."""
        self._hold_skipped = not isinstance(buffer.allocator, BufferPool)
        """fsdp_double_buffer's slots alternate units in module order: a held unit would
        keep the slot the next one needs, on the ranks that skipped it only."""
        self._logged_several = False
        self._handles: list[Any] = []
        self._hooked: set[torch.Tensor] = set()
        """Compute parameters whose gradient hook is registered."""

    # -- registration -------------------------------------------------------------
    def register(self) -> None:
        for unit in self.units:
            if not unit.gathers:
                continue
            for module in unit.modules:
                self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(unit)))
                last = module is unit.modules[-1]
                self._handles.append(module.register_forward_hook(self._make_post_forward(unit, last)))
        for group in self.buffer.grad_groups:
            self.register_grad_hooks(group)

    def register_grad_hooks(self, group: ParameterGroup) -> None:
        """Each parameter of ``group`` that requires gradients gets its hook, once. A
        group frozen at wrapping and partly unfrozen later gets the rest when they are
        (torch refuses hooks on tensors that need no gradient)."""
        for index, param in enumerate(group.params):
            if param.requires_grad and param not in self._hooked:
                self._hooked.add(param)
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(group, index)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def _make_pre_forward(self, unit: FSDPUnit):
        def hook(module, args):
            self.pre_forward(unit, module)

        return hook

    def refuse_direct_call(self, unit: FSDPUnit, module: nn.Module) -> None:
        if not self.params_registered():
            raise RuntimeError(direct_call_message(f"{type(module).__name__}(...) in the unit {unit.name}"))

    def _make_post_forward(self, unit: FSDPUnit, last: bool):
        def hook(module, args, output):
            return self.post_forward(unit, output, last=last)

        return hook

    def _make_grad_hook(self, group: ParameterGroup, index: int):
        # Weak references: the hook lives on the parameter, and the cycle collector does
        # not follow a parameter's hooks, so a hook holding the runtime (which holds the
        # module and its parameters) would keep the whole model alive after ``del``.
        runtime, group_ref = weakref.ref(self), weakref.ref(group)

        def hook(param: torch.Tensor) -> None:
            alive = runtime()
            if alive is not None:
                alive.on_grad(group_ref(), index, param)

        return hook

    # -- root ---------------------------------------------------------------------
    @_eager
    def root_pre_forward(self) -> None:
        with record_function("megatron_fsdp::root_pre_forward"):
            # One round trip for the root's groups and the first unit: each blocking
            # gather would otherwise wait out the ranks' skew and latency in turn.
            self._forward_walk = self.schedule.forward_walk()
            self._open = []
            self._finished = set()
            self.all_gather.unshard(self.root_groups, async_op=True)
            if self.prefetch_depth and self.schedule.order:
                self.all_gather.unshard(self.schedule.order[0].groups, async_op=True)
            self.all_gather.wait(self.root_groups)

    @_eager
    def root_post_forward(self, output: Any) -> Any:
        self._close_open_units(None)
        for unit in self._forward_walk.remaining():
            self._visit_skipped_forward(unit)
        held, self._held_skipped = self._held_skipped, []
        self.all_gather.reshard([g for u in held for g in u.groups if g.model_weights.status is not BucketStatus.EMPTY])
        # The first training forward fixes the unit order used by every rank.
        if self.schedule.order and torch.is_grad_enabled() and not self.schedule.final:
            self.schedule.agree(self.root_dp_group)
        tensors = grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            self._training_forwards += 1
            register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        else:
            if torch.is_grad_enabled():
                refuse_hidden_grad_tensors(output, "the model")
            # Evaluation: nothing will come back for these weights.
            self.all_gather.reshard(self.root_groups)
        return output

    def _enter(self, mode: BackwardMode) -> None:
        """The one place the backward mode changes: checked against its legal transitions."""
        self._mode = self._mode.check_transition(mode, owner="the hook runtime's backward mode")

    @_eager
    def _root_pre_backward(self, grad: Any) -> None:
        if not self._mode.in_backward:
            several = self._begin_several_forwards()
            self._enter(self._backward_mode(several))
            Variable._execution_engine.queue_callback(self._post_backward_final)
            # A second backward through a retained graph finds the root's weights
            # released at the end of the first one.
            self.all_gather.unshard_and_wait(self.root_groups)
            self._backward_walk = self.schedule.backward_walk()
            self._unrequested = []
            self._released_in_backward = set()
            self.on_backward_start()

    def _begin_several_forwards(self) -> bool:
        """[Note: several forwards, one backward] ``loss = f(model(a)) + f(model(b))``, or
        a unit called twice in one forward (weights shared across layers), gives a unit
        several backwards in one pass, and autograd hands its parameters' gradients over
        once, after the last of them. Under ZeRO-3 such a backward therefore releases a
        unit only when all its gradients arrived (``_group_complete``), never when the
        walk passes it, and reduces every group at the end of the backward, in the fixed
        order (no overlap with the backward): as FSDP2 computes it, at up to every unit's
        weights gathered at once. Every rank runs the same forwards (their all-gathers
        pair up only then), so every rank takes the same mode. A training forward whose
        output is never used for a backward counts too: evaluate under torch.no_grad()
        to keep the overlap."""
        several = self.reduce_at_boundaries and (self._training_forwards > 1 or self._unit_reran)
        self._training_forwards, self._unit_reran = 0, False
        if several and not self._logged_several:
            self._logged_several = True
            logger.info("megatron_fsdp: a backward serves several forwards of an FSDP unit (ZeRO-3): units stay "
                        "gathered until their gradients are complete and reductions run after the backward. "
                        "Wrap forwards that are not backpropagated in torch.no_grad() to keep the overlap.")
        return several

    def _backward_mode(self, several: bool) -> BackwardMode:
        """[Note: higher-order gradients] A backward with ``create_graph=True`` (a
        gradient penalty: ``torch.autograd.grad(out, x, create_graph=True)``, then
        ``backward()`` of a loss built from it) records a graph whose nodes read the
        compute weights, and the later backward runs them in an order no unit hook
        sees. Under ZeRO-3 those weights would be released under them (torch's
        "setStorage ... out of bounds for storage of size 0"). So that backward, and
        the next one, keep every unit gathered, as several forwards do, and reduce at
        the end; the weights go at the end of the next backward without
        create_graph (or at the step). Autograd runs hooks in the graph's grad mode,
        which is how ``create_graph`` is seen here; weights that are never released
        (no ``reduce_at_boundaries``) need none of it. ``several``: [Note: several
        forwards, one backward]."""
        if self.reduce_at_boundaries and torch.is_grad_enabled():
            return BackwardMode.CREATE_GRAPH
        if self._mode is BackwardMode.GRAPH_RETAINED:
            return BackwardMode.AFTER_CREATE_GRAPH
        return BackwardMode.SEVERAL_FORWARDS if several else BackwardMode.OVERLAPPED

    # -- units --------------------------------------------------------------------
    @_eager
    def pre_forward(self, unit: FSDPUnit, module: nn.Module) -> None:
        if unit.state.in_backward:
            return  # recompute inside backward: already gathered
        self.refuse_direct_call(unit, module)  # before any gather: the schedule stays as it was
        self._close_open_units(unit)
        revisit = unit in self._forward_walk.visited
        for skipped in self._forward_walk.catch_up(unit):
            self._visit_skipped_forward(skipped)
        if torch.is_grad_enabled():
            # [Note: several forwards, one backward]; a recompute inside backward is not a rerun.
            self._unit_reran |= unit in self._finished and not self._mode.in_backward
            self.schedule.observe(unit)
        unit.state = TrainingState.FORWARD
        if unit not in self._open:
            self._open.append(unit)
        with record_function(f"megatron_fsdp::unshard:{unit.name}"):
            self.all_gather.unshard_and_wait(unit.groups)  # nothing to do for a held unit
            if not revisit:  # the walk prefetched past it already
                self._prefetch(unit, step=1)

    def _keep_gathered(self, unit: FSDPUnit) -> bool:
        """The last unit of a training forward is the first of the backward: releasing
        it only to gather it again at once costs a blocking all-gather and saves no
        memory. It is released when its gradients are done (or at the end)."""
        return torch.is_grad_enabled() and self.schedule.final and unit is self.schedule.finish_order[-1]

    def _visit_skipped_forward(self, unit: FSDPUnit) -> None:
        """[Note: one unit sequence on every rank] A unit this rank's forward did not
        run: take part in its gathers as a real visit would, then release it."""
        with record_function(f"megatron_fsdp::unshard_skipped:{unit.name}"):
            self.all_gather.unshard_and_wait(unit.groups)
            self._prefetch(unit, step=1)
            if not self.schedule.final and self._hold_skipped:  # [Note: the first forward in an unknown order]
                self._held_skipped.append(unit)
            elif not self._keep_gathered(unit):
                self.all_gather.reshard(unit.groups)

    @_eager
    def post_forward(self, unit: FSDPUnit, output: Any, *, last: bool = True) -> Any:
        """``last``: the output of the unit's last module (a merged unit releases
        its weights only after all its modules ran)."""
        if unit.state.in_backward:
            return output
        training = torch.is_grad_enabled()
        # A held unit stays gathered until the forward ends whether or not it ran: the
        # same buckets on every rank, released at one point.
        keep = not last or self._keep_gathered(unit) or unit in self._held_skipped
        if last:
            self._finish_forward(unit, training)
        if not keep:
            with record_function(f"megatron_fsdp::reshard:{unit.name}"):
                self.all_gather.reshard(unit.groups)
        tensors = grad_tensors(output) if training else []
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self.pre_backward(unit), mode="any")
        elif training:
            refuse_hidden_grad_tensors(output, f"FSDP unit {unit.name}")
        return output

    def _finish_forward(self, unit: FSDPUnit, training: bool) -> None:
        unit.state = TrainingState.IDLE
        if unit in self._open:
            self._open.remove(unit)
        if training:
            self._finished.add(unit)
            self.schedule.observe(unit, finished=True)

    def _close_open_units(self, current: Optional[FSDPUnit]) -> None:
        """[Note: one unit sequence on every rank] A merged unit whose last module
        this rank skipped never saw its closing post-forward: it would stay gathered,
        and its backward would issue no all-gather where the other ranks issue one.
        When the forward moves on to a unit that is not inside it (or ends), close it
        as its last module would have."""
        training = torch.is_grad_enabled()
        for unit in list(self._open):
            if unit is current or (current is not None and _contains(unit, current)):
                continue
            self._finish_forward(unit, training)
            if not self._keep_gathered(unit):
                self.all_gather.reshard(unit.groups)

    @_eager
    def pre_backward(self, unit: FSDPUnit) -> None:
        self._root_pre_backward(None)
        if unit.state.in_backward:
            if unit in self._released_in_backward:
                raise RuntimeError(_revisit_message(unit))
            return  # another output of a unit in backward, or a merged unit's next module
        enclosing = self._ancestors.get(unit, set())
        for skipped in self._backward_walk.catch_up(unit):
            self._visit_backward(skipped)
            # A unit enclosing this one (a module with parameters of its own around units,
            # its output also theirs: its hook may fire after theirs) is not skipped: its
            # gradients come after its children's.
            if skipped not in enclosing and not self._mode.reduces_at_end:  # else another forward's backward may still use it
                self.all_gather.reshard([g for g in skipped.groups if g.requires_grad])  # no gradient will come
        self._visit_backward(unit)

    def _visit_backward(self, unit: FSDPUnit) -> None:
        self._request_passed_units(unit)
        self._unrequested.append(unit)
        unit.state = TrainingState.PRE_BACKWARD
        with record_function(f"megatron_fsdp::unshard_backward:{unit.name}"):
            self.all_gather.unshard_and_wait(unit.groups)
            self._prefetch(unit, step=-1)

    def _request_passed_units(self, current: Optional[FSDPUnit] = None) -> None:
        """Units the backward walk has left (all but ``current``'s enclosing units,
        whose own parameters' gradients come after their children's): no gradient
        is still to come for them, so their weights go (even with parameters that
        got none) and, with ``reduce_at_boundaries``, their reductions may start (in
        order)."""
        if self._mode.reduces_at_end and current is not None:
            return  # [Note: several forwards, one backward]: all of it at the end
        sync = self.sync_enabled()
        enclosing = self._ancestors.get(current, set()) if current is not None else set()
        still_open = []
        for passed in self._unrequested:
            if passed in enclosing:
                still_open.append(passed)
                continue
            passed.state = TrainingState.POST_BACKWARD
            trainable = [g for g in passed.groups if g.requires_grad]
            if self.reduce_at_boundaries:
                for group in trainable:
                    self.grad_reduce.reduce(group, sync=sync)
            if self._mode is BackwardMode.CREATE_GRAPH:
                continue  # [Note: higher-order gradients]: the next backward reads them
            self.all_gather.reshard(trainable)
            if any(g.model_weights.is_distributed for g in trainable):
                self._released_in_backward.add(passed)
        self._unrequested = still_open

    def _prefetch(self, unit: FSDPUnit, *, step: int) -> None:
        if not self.prefetch_depth:
            return
        for target in self.schedule.neighbours(unit, step, self.prefetch_depth):
            self.all_gather.unshard(target.groups, async_op=True)

    # -- gradients --------------------------------------------------------------------
    @_eager
    def on_grad(self, group: ParameterGroup, index: int, param: torch.Tensor) -> None:
        if self.grad_reduce.accumulate(group, index, param):
            self._group_complete(group)

    def _group_complete(self, group: ParameterGroup) -> None:
        if not (self.reduce_at_boundaries and group.unit is not None):
            self.grad_reduce.reduce(group, sync=self.sync_enabled())
        # Every use of these weights has produced its gradient: they are free to go
        # (the root's stay inside no_sync: [Note: root groups across micro batches];
        # a higher-order graph may still read them: [Note: higher-order gradients]).
        if (group.unit is not None or self.sync_enabled()) and not self._mode.graph_reads_weights:
            self.all_gather.reshard([group])

    @_eager
    def _post_backward_final(self) -> None:
        with record_function("megatron_fsdp::post_backward_final"):
            for unit in self._backward_walk.remaining():
                self._visit_backward(unit)
            self._request_passed_units()
            # Unused parameters: every rank must still take part, in the same order.
            sync = self.sync_enabled()
            self.grad_reduce.reduce_remaining(sync=sync)
            # [Note: root groups across micro batches] Inside no_sync more micro
            # batches follow, whose forwards need the root's weights (embeddings, the
            # output layer) first: keep them gathered instead of gathering them again
            # per micro batch, as upstream does. Only the step changes weights, and it
            # releases every gathered sharded group (install_optimized_model_weights).
            keep = set() if sync else set(self.root_groups)
            retained = self._mode is BackwardMode.CREATE_GRAPH
            if retained:  # [Note: higher-order gradients]: the next backward reads them
                keep = set(self.buffer.groups)
            self.all_gather.reshard([g for g in self.buffer.groups if g not in keep])
            for unit in self.units:
                unit.state = TrainingState.IDLE
            self.grad_reduce.end_backward()
            self._enter(BackwardMode.GRAPH_RETAINED if retained else BackwardMode.IDLE)
            self.on_backward_end()
