"""Runtime of experimental fully_shard: the ``FsdpModule`` mixin (hooks that gather,
release and reduce one module's parameter groups) and the ``FsdpContext`` the
modules of one model share (prefetch orders, microbatch state, pending reductions).

[Note: schedule] Forward: a module's ``pre_forward`` waits for its own all-gather
(launched by the module before it, as a prefetch, or now), launches the next
module's all-gather asynchronously, and computes while it is in flight;
``post_forward`` puts the sharded parameters back and frees the full weights.
Backward: ``pre_backward`` (a hook on the module's outputs' gradients) does the same in backward
order; once every owned parameter has accumulated its gradient,
``post_backward`` frees the full weights, completes the previous module's
reduce-scatter (which overlapped this module's backward) and launches its own
asynchronously; the root's end-of-backward callback completes the last one. So per step each module all-gathers twice and reduce-scatters once.

[Note: phase ranges] Each module's forward (pre_forward to post_forward) and
backward (pre_backward to post_backward) is a profiler range named
``megatron_fsdp::forward:<module>`` / ``megatron_fsdp::backward:<module>``, nested
as the modules are; the collectives' ranges sit inside them. A frozen module's
backward range closes at the end of backward; a module whose outputs need no
gradient has none; recomputation opens none.

[Note: recomputation] Activation checkpointing reruns a module's forward inside
backward. Such a rerun keeps its full weights (its backward needs them next) and
does not prefetch the next module in forward order, whose backward may be over.
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Optional, cast

import torch
from torch import nn
from torch.distributed import DeviceMesh
from torch.distributed.tensor.placement_types import Placement
from torch.profiler import record_function

from ..buffers.allocator import BufferAccounting, StorageResizeAllocator
from ..comm.broadcast_tensors import broadcast_from_first
from ..runtime.wrapped_model_guards import RefusesCopies, refuse_move
from ..mixed_precision import MixedPrecisionPolicy
from ..runtime.backward_outputs import grad_tensors, refuse_hidden_grad_tensors
from .parameter_group import FsdpParameterGroup, PendingReduction, get_containing_parameter_group, owns_parameter
from .placement import specialize_placements
from .tensor_parallel import find_tensor_parallel, local_tensor

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    """Whether this thread runs inside an autograd graph task (recomputation)."""
    return torch._C._current_graph_task_id() != -1


class FsdpContext:
    """State shared by the FsdpModules built in one ``fully_shard_context``."""

    def __init__(self, device: torch.device, *, unify_communication_stream: bool = False,
                 implicit: bool = False) -> None:
        self.device = device
        self.implicit = implicit
        """Opened by a ``fully_shard`` called outside any ``fully_shard_context`` (upstream 0.6.1's
        usage): it finalizes itself when the model first runs (``ensure_finalized``)."""
        self.unify_communication_stream = unify_communication_stream
        """Accepted for upstream compatibility; collectives here run asynchronously on
        the backend's own queue, not on side streams, so there is nothing to unify."""
        self.is_last_microbatch = True
        """False inside ``microbatch(context, is_last=False)``: HSDP/ZeRO-1/2 gradients
        then stay unreduced across the outer axis until the last microbatch."""
        self.accounting = BufferAccounting()
        """Bytes of persistent buffers and of full weights / gradient buckets alive."""
        self.allocator = StorageResizeAllocator(self.accounting)
        self.forward_order: list[FsdpModule] = []
        self.backward_order: list[FsdpModule] = []
        self._registered: list[FsdpModule] = []
        self._finalized = False
        self._pending_reductions: list[tuple[FsdpModule, PendingReduction]] = []

    def register_module(self, module: "FsdpModule") -> None:
        if self._finalized:
            raise RuntimeError("fully_shard was called after its fully_shard_context exited; call it inside")
        self._registered.append(module)

    def finalize(self) -> None:
        """Find the roots, name every module, and fix the prefetch orders."""
        if self._finalized:
            raise RuntimeError("this fully_shard_context is already finalized")
        children: set[int] = set()
        for module in self._registered:
            _nearest_fsdp_children(cast(nn.Module, module), children)
        roots = [m for m in self._registered if id(m) not in children]
        for root in roots:
            root._is_root = True
            for name, sub in cast(nn.Module, root).named_modules():
                if isinstance(sub, FsdpModule):
                    sub._name = name
                    self.forward_order.append(sub)
        for root in reversed(roots):
            _backward_order(cast(nn.Module, root), self.backward_order)
        for module in self.forward_order:
            for group in module.parameter_groups:
                group.rename(f"{module.name}:{group.name.partition(':')[2]}")
        self._registered.clear()
        self._finalized = True

    @property
    def finalized(self) -> bool:
        """Whether the roots, names and prefetch orders are fixed (the model may run)."""
        return self._finalized

    def ensure_finalized(self) -> None:
        if not self._finalized and self.implicit:
            self.finalize()
        elif not self._finalized:
            raise RuntimeError("run the model after leaving `with fully_shard_context():`, not inside it")

    def next_in(self, order: list["FsdpModule"], module: "FsdpModule") -> Optional["FsdpModule"]:
        index = next(i for i, m in enumerate(order) if m is module)
        return order[index + 1] if index + 1 < len(order) else None

    def queue_end_of_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def finish_reductions(self) -> None:
        """Complete the gradient reductions in flight, in launch order."""
        pending, self._pending_reductions = self._pending_reductions, []
        for module, reduction in pending:
            with record_function(f"megatron_fsdp::reduce_scatter_wait:{module.name}"):
                reduction.group.finish_reduction(reduction, self.is_last_microbatch)

    def end_of_backward(self) -> None:
        """Complete every gradient reduction in launch order and reset stragglers."""
        # Modules without trainable parameters have no gradient to wait for: they
        # give their (frozen) full weights back here.
        for module in self.forward_order:
            if module.phase is FsdpModule.Phase.BACKWARD and module._num_trainable == 0:
                module.post_backward()
        stuck = [m.name for m in self.forward_order if m.phase is FsdpModule.Phase.BACKWARD]
        self.finish_reductions()
        for module in self.forward_order:
            module._reshard_if_unsharded()
        if stuck and torch.is_grad_enabled():  # autograd runs this callback in the graph's grad mode
            raise NotImplementedError(
                f"a backward with create_graph=True (a gradient penalty: torch.autograd.grad(out, x, "
                f"create_graph=True)) through {stuck}: higher-order gradients are not implemented by "
                "megatron_fsdp.experimental; the main engine (megatron_fsdp.fully_shard) trains them"
            )
        if stuck:
            raise RuntimeError(
                f"modules {stuck} ran backward but not all their parameters received gradients; "
                "unused parameters inside a sharded module are not supported (freeze them or shard them separately)"
            )


class FsdpModule(RefusesCopies):
    """Mixed into a module's class by ``fully_shard``; the module keeps its identity.
    Copying or pickling it raises with the remedy (wrapped_model_guards.py)."""

    _FULL_WEIGHTS = "megatron_fsdp.experimental.full_state_dict(model)"

    class Phase(enum.Enum):
        RESTING = enum.auto()
        """Sharded DTensor parameters installed; no full weights held."""
        FORWARD = enum.auto()
        """Between pre_forward and post_forward."""
        BACKWARD = enum.auto()
        """Between pre_backward and post_backward (recomputation happens inside)."""

    def _fsdp_init(
        self,
        context: FsdpContext,
        mesh: DeviceMesh,
        *,
        model_weight_placements: tuple[Placement, ...],
        main_grad_placements: tuple[Placement, ...],
        main_weight_placements: tuple[Placement, ...],
        mixed_precision_policy: MixedPrecisionPolicy,
        grad_divisor: int,
    ) -> None:
        if grad_divisor < 1:
            raise ValueError(f"grad_divisor={grad_divisor} must be a positive integer (the expert-parallel size)")
        self._context = context
        self._is_root = False
        self._name: Optional[str] = None
        self._phase = FsdpModule.Phase.RESTING
        self._unsharded = False
        self._in_flight: list[FsdpParameterGroup] = []
        self._held: list[FsdpParameterGroup] = []
        """Frozen groups kept whole past post_backward ([Note: frozen groups in trained modules])."""
        self._pending_inputs = 0
        """Input-gradient hooks registered and not yet fired."""
        self._num_ready = 0
        self._open_range: Optional[object] = None
        """The profiler range of the phase in progress (see [Note: phase ranges])."""
        owned = _owned_parameters(cast(nn.Module, self))
        # tensor_parallel.py [Note: tensor-parallel modules]; refuses before anything changes.
        tensor_parallel = find_tensor_parallel(owned.items(), mesh)
        _sync_owned_state(cast(nn.Module, self), mesh)
        groups = []
        for key, params in _group_parameters(owned).items():
            groups.append(
                FsdpParameterGroup(
                    cast(nn.Module, self),
                    params,
                    mesh,
                    model_weight_placements=specialize_placements(model_weight_placements),
                    main_grad_placements=specialize_placements(main_grad_placements),
                    main_weight_placements=specialize_placements(main_weight_placements),
                    mixed_precision_policy=mixed_precision_policy,
                    grad_divisor=grad_divisor,
                    device=context.device,
                    allocator=context.allocator,
                    name=f"?:{key[0]}",
                    tensor_parallel=tensor_parallel,
                )
            )
        self._parameter_groups = tuple(groups)
        self._num_trainable = sum(len(g.fsdp_parameters) for g in groups if g.requires_grad)
        self._mixed = self._num_trainable > 0 and any(not g.requires_grad for g in groups)
        self._register_hooks()
        context.register_module(self)

    def _apply(self, fn, recurse: bool = True):
        """``model.to()`` / ``.cuda()`` / ``.half()``: a conversion that keeps the sharded
        parameters' device and dtype (``model.to(the mesh device)`` after sharding a child)
        leaves them alone and converts the rest; any other is refused before anything in this
        module moves. A plain parent converts its children in order, so siblings visited
        before this module may already be converted when it refuses: cast before sharding."""
        # The sharded parameters are views of DBuffers on the mesh device, and the
        # ownership table refers to them weakly, so torch's swap of a converted DTensor
        # into place is impossible (swap_tensors refuses weakly referenced tensors) and
        # would detach them from the buffers anyway: hide them from the base _apply.
        hidden = []
        for module_name, module in self.named_modules() if recurse else [("", self)]:
            for key, param in module._parameters.items():
                if param is not None and owns_parameter(param):
                    refuse_move(f"{module_name}.{key}".lstrip("."), param, fn)
                    hidden.append((module, key, param))
        for module, key, _ in hidden:
            module._parameters[key] = None  # keeps the key, so the parameter order stays
        try:
            return super()._apply(fn, recurse)
        finally:
            for module, key, param in hidden:
                module._parameters[key] = param

    # -- properties -------------------------------------------------------------------------
    @property
    def context(self) -> FsdpContext:
        return self._context

    @property
    def parameter_groups(self) -> tuple[FsdpParameterGroup, ...]:
        return self._parameter_groups

    @property
    def name(self) -> str:
        if self._name is None and self._context.implicit:
            self._context.ensure_finalized()
        if self._name is None:
            raise RuntimeError("module names are set when fully_shard_context exits")
        return self._name or "<root>"

    def is_root(self) -> bool:
        return self._is_root

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """PyTorch FSDP2's accumulation switch: ``False`` keeps the following
        backwards' gradients unreduced where they can rest (Partial: HSDP, ZeRO-1/2)
        until it is set back to ``True``; the same switch as ``microbatch``, left on.
        The switch belongs to the whole model here (one ``FsdpContext``), so it is set
        on the root with ``recurse=True``."""
        self.context.ensure_finalized()
        if not (self._is_root and recurse):
            raise NotImplementedError(
                f"set_requires_gradient_sync on {self.name} (recurse={recurse}): megatron_fsdp.experimental switches "
                "gradient synchronisation for the whole model, not per module. Call it on the root module with "
                "recurse=True, or wrap each microbatch in megatron_fsdp.experimental.microbatch(context, is_last)"
            )
        self.context.is_last_microbatch = bool(requires_gradient_sync)

    @property
    def phase(self) -> "FsdpModule.Phase":
        return self._phase

    @phase.setter
    def phase(self, phase: "FsdpModule.Phase") -> None:
        resting = FsdpModule.Phase.RESTING
        if phase is not resting and self._phase is not resting and phase is not self._phase:
            raise RuntimeError(f"{self.name}: phase {self._phase.name} -> {phase.name} is not a valid transition")
        self._phase = phase

    # -- hooks ------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        module = cast(nn.Module, self)
        # Hooks receive the module as an argument instead of closing over self, so
        # they do not keep a deleted module alive.
        module.register_forward_pre_hook(lambda m, args, kwargs: m.pre_forward(args, kwargs), with_kwargs=True)
        module.register_forward_hook(lambda m, _args, out: m.post_forward(out))
        module.register_load_state_dict_pre_hook(_refuse_assign_load)
        ref = weakref.ref(self)
        for group in self._parameter_groups:
            if group.requires_grad:
                for p in group.fsdp_parameters:
                    p.unsharded.register_post_accumulate_grad_hook(lambda _p: _on_grad_ready(ref))

    def pre_forward(self, args: tuple = (), kwargs: Optional[dict] = None) -> None:
        self.context.ensure_finalized()
        recomputing = self.phase is FsdpModule.Phase.BACKWARD or _in_backward()
        if self._mixed and torch.is_grad_enabled() and not (recomputing and self._pending_inputs):
            self._watch_inputs(args, kwargs or {})
        if self.phase is not FsdpModule.Phase.BACKWARD:
            self.phase = FsdpModule.Phase.FORWARD
        if not recomputing:
            self._num_ready = 0
            self._begin_range("forward")
        self._launch_unshard()
        if not recomputing:
            following = self.context.next_in(self.context.forward_order, self)
            if following is not None:
                following._launch_unshard()
        self._wait_unshard()

    def post_forward(self, output: object = None) -> None:
        recomputing = self.phase is FsdpModule.Phase.BACKWARD or _in_backward()
        if not recomputing:
            self._reshard()
            self._end_range()
        # Backward reaches this module when the first gradient of its outputs is
        # computed. (A reentrant checkpoint's rerun is where its outputs get a graph.)
        needing_grad = grad_tensors(output)  # dataclass fields too, as the main engine
        if needing_grad:
            ref = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(needing_grad, lambda _grads: _on_pre_backward(ref), mode="any")
        elif torch.is_grad_enabled() and not recomputing:
            refuse_hidden_grad_tensors(output, type(self).__name__)
        if self.phase is FsdpModule.Phase.FORWARD:
            self.phase = FsdpModule.Phase.RESTING

    def pre_backward(self) -> None:
        if self.phase is FsdpModule.Phase.BACKWARD:
            return  # a second output of the same module
        self.phase = FsdpModule.Phase.BACKWARD
        self._begin_range("backward")
        if self.is_root():
            self.context.queue_end_of_backward()
        self._launch_unshard()
        following = self.context.next_in(self.context.backward_order, self)
        if following is not None:
            following._launch_unshard()
        self._wait_unshard()

    def _watch_inputs(self, args: tuple, kwargs: dict) -> None:
        """[Note: frozen groups in trained modules] A module's trainable weights can
        all have their gradients while a frozen weight it used earlier in its forward
        (a frozen LayerNorm before a trained linear) is still needed to carry the
        gradient back to the module's inputs. Such a module keeps its frozen groups
        whole past post_backward until the gradients of its inputs exist (FSDP2 hooks
        its post-backward on the inputs the same way), or until the end of backward.
        Modules whose groups all train, or all are frozen, need no such hook."""
        needing_grad = grad_tensors((args, kwargs))
        if not needing_grad:
            return
        self._pending_inputs += 1
        ref = weakref.ref(self)
        torch.autograd.graph.register_multi_grad_hook(needing_grad, lambda _grads: _on_inputs_done(ref), mode="all")

    def inputs_done(self) -> None:
        self._pending_inputs = max(0, self._pending_inputs - 1)
        if not self._pending_inputs and self._held:
            self._release(self._held)

    def post_backward(self) -> None:
        if self.phase is not FsdpModule.Phase.BACKWARD:
            return  # a module whose forward ran without grad tracking
        self._reshard(keep_frozen=self._pending_inputs > 0)
        # The previous module's reduce-scatter overlapped this module's backward;
        # finishing it now frees its gradient bucket (at most one module's in flight).
        self.context.finish_reductions()
        for group in self._parameter_groups:
            if not group.requires_grad:
                continue
            partial = group.pack_gradients()
            if partial is None:
                continue
            with record_function(f"megatron_fsdp::reduce_scatter:{self.name}"):
                self.context._pending_reductions.append((self, group.reduce_gradients(partial)))
        self.phase = FsdpModule.Phase.RESTING
        self._end_range()

    # -- gather / release --------------------------------------------------------------------
    def _launch_unshard(self) -> None:
        if self._unsharded or self._in_flight:
            return
        with record_function(f"megatron_fsdp::all_gather:{self._name or '<root>'}"):
            for group in self._parameter_groups:
                if group not in self._held:  # still whole
                    group.unshard_parameters(async_op=True)
                    self._in_flight.append(group)
        self._held = []
        if not self._parameter_groups:
            self._unsharded = True

    def _wait_unshard(self) -> None:
        if self._unsharded:
            return
        with record_function(f"megatron_fsdp::all_gather_wait:{self.name}"):
            for group in self._in_flight:
                group.install_unsharded()
        self._in_flight = []
        self._unsharded = True

    def _reshard(self, keep_frozen: bool = False) -> None:
        self._wait_unshard()  # a gather still in flight must land before its buffer is freed
        self._held = [g for g in self._parameter_groups if keep_frozen and not g.requires_grad]
        self._release([g for g in self._parameter_groups if g not in self._held])
        self._unsharded = False

    def _release(self, groups) -> None:
        for group in groups:
            group.reshard_parameters()
            group.release_unsharded_storage()
        self._held = [g for g in self._held if g not in groups]

    def _reshard_if_unsharded(self) -> None:
        self._pending_inputs = 0  # hooks of forwards whose backward never ran
        if self._unsharded or self._in_flight or self._held:
            self._reshard()
        self._phase = FsdpModule.Phase.RESTING
        self._end_range()

    # -- profiler ranges -----------------------------------------------------------------------
    def _begin_range(self, phase: str) -> None:
        self._end_range()
        self._open_range = _range_push(f"megatron_fsdp::{phase}:{self.name}")

    def _end_range(self) -> None:
        if self._open_range is not None:
            handle, self._open_range = self._open_range, None
            _range_pop(handle)


def _range_push(label: str) -> object:
    """Open a profiler range (``torch.profiler`` shows it on the CPU timeline)."""
    handle = record_function(label)
    handle.__enter__()
    return handle


def _range_pop(handle: object) -> None:
    cast(record_function, handle).__exit__(None, None, None)


def _on_pre_backward(ref: "weakref.ReferenceType[FsdpModule]") -> None:
    module = ref()
    if module is not None:
        module.pre_backward()


def _on_inputs_done(ref: "weakref.ReferenceType[FsdpModule]") -> None:
    module = ref()
    if module is not None:
        module.inputs_done()


def _on_grad_ready(ref: "weakref.ReferenceType[FsdpModule]") -> None:
    module = ref()
    if module is None:
        return
    module._num_ready += 1
    if module._num_ready == module._num_trainable:
        module.post_backward()


def _refuse_assign_load(_module, _state_dict, _prefix, local_metadata, *_rest) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            "load_state_dict(assign=True) would replace parameters that fully_shard manages; "
            "load before fully_shard, use assign=False, or use experimental.load_checkpoint"
        )


def _nearest_fsdp_children(module: nn.Module, out: set[int]) -> None:
    for child in module.children():
        if isinstance(child, FsdpModule):
            out.add(id(child))
        else:
            _nearest_fsdp_children(child, out)


def _backward_order(module: nn.Module, order: list[FsdpModule]) -> None:
    if isinstance(module, FsdpModule):
        order.append(module)
    for child in reversed(list(module.children())):
        _backward_order(child, order)


def _owned_parameters(root: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters under ``root`` not owned by an FsdpModule nested inside it (by name;
    a tied weight appears under each of its names)."""
    owned: dict[str, nn.Parameter] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{prefix}{name}"
            if get_containing_parameter_group(p) is not None:
                raise ValueError(
                    f"parameter {fqn!r} already belongs to another fully_shard module; "
                    "a weight tied across modules must be owned by their common ancestor"
                )
            owned[fqn] = p
        for child_name, child in module.named_children():
            if not isinstance(child, FsdpModule):
                visit(child, f"{prefix}{child_name}.")

    visit(root, "")
    return owned


def _owned_buffers(root: nn.Module) -> list[torch.Tensor]:
    """Buffers under ``root`` outside the FsdpModules nested inside it."""
    found = list(root.buffers(recurse=False))
    for child in root.children():
        if not isinstance(child, FsdpModule):
            found.extend(_owned_buffers(child))
    return found


def _sync_owned_state(root: nn.Module, mesh: DeviceMesh) -> None:
    """[Note: initial state from data-parallel rank 0] (runtime/init_sync.py): the
    parameters and buffers this call shards start from the mesh's first rank, along
    every axis (all of them are data-parallel axes; a tensor-parallel parameter's local
    piece is the same piece there). Meta tensors are initialised after sharding, on their shards."""
    params = [local_tensor(p) for p in dict.fromkeys(_owned_parameters(root).values())]
    tensors = params + _owned_buffers(root)
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim)]
    broadcast_from_first([t for t in tensors if not t.is_meta], groups, label="initial_state")


def _group_parameters(params: dict[str, nn.Parameter]) -> dict[tuple, dict[str, nn.Parameter]]:
    groups: dict[tuple, dict[str, nn.Parameter]] = {}
    for fqn, p in params.items():
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise NotImplementedError(f"parameter {fqn!r} has dtype {p.dtype}; fp32, bf16 and fp16 are supported")
        key = (str(p.dtype).removeprefix("torch."), p.requires_grad)
        groups.setdefault(key, {})[fqn] = p
    return groups
