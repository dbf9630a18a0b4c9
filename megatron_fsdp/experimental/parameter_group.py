"""One dtype- and requires_grad-homogeneous group of the parameters a module owns,
and the four DBuffers behind it:

=======================  ====================  ======================================
buffer                   placements            role
=======================  ====================  ======================================
``main_weight``          ``Placements.optimizer``  what the optimizer steps (the sharded
                                                   DTensor parameters are views of it)
``model_weight``         ``Placements.parameter``  compute dtype; the same object as
                                                   ``main_weight`` when dtypes match
``_unsharded_model_weight``  all ``Replicate``    full weights for compute; storage
                                                   released between uses
``main_grad``            ``Placements.gradient``   reduced gradients (the sharded
                                                   parameters' ``.grad`` are views)
=======================  ====================  ======================================
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from torch.distributed import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.utils.weak import WeakIdKeyDictionary

from ..buffers.allocator import StorageResizeAllocator
from ..mixed_precision import MixedPrecisionPolicy
from ..runtime.registered_params import data_assignment_message, share_grad_hooks, wrapper_address
from .dbuffer import DBuffer
from .placement import changed_mesh_axis
from .tensor_parallel import TPParam, bind_local, local_tensor

# Parameter (sharded or unsharded) -> the group owning it. Weak on both sides, so
# neither a parameter nor a group is kept alive by this table; keyed by identity
# (a plain WeakKeyDictionary would compare tensors with ==).
_OWNER: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def get_containing_parameter_group(parameter: torch.Tensor) -> Optional["FsdpParameterGroup"]:
    """The group that owns ``parameter`` (``None``: not managed by experimental fully_shard)."""
    ref = _OWNER.get(parameter)
    return ref() if ref is not None else None


def owns_parameter(parameter: torch.Tensor) -> bool:
    """A sharded or unsharded parameter of some experimental group."""
    return get_containing_parameter_group(parameter) is not None


def sync_model_weights_from_main_weights(parameters: Iterable[torch.Tensor]) -> None:
    """Refresh the compute weights of every group among ``parameters``, once per group."""
    seen: set[int] = set()
    for parameter in parameters:
        group = get_containing_parameter_group(parameter)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            group.sync_model_weight_from_main_weight()


@dataclasses.dataclass(frozen=True, eq=False)
class FsdpParameter:
    """One physical parameter: its names, its sharded (optimizer) and unsharded (compute) forms."""

    fqns: tuple[str, ...]
    """Every name under the owning module (tied weights have several)."""
    sharded: nn.Parameter
    unsharded: nn.Parameter
    sharded_address: Optional[int] = None
    """``wrapper_address(sharded)`` at sharding: a ``.data =`` assignment moves it
    (registered_params.py [Note: data assignment])."""
    tp: Optional[TPParam] = None
    """Set in a tensor-parallel module (tensor_parallel.py [Note: tensor-parallel
    modules]): the buffers hold the TP-local tensor, and this says what it is a piece of."""


def _dtensor(tp: Optional[TPParam], buffer: DBuffer, index: int) -> torch.Tensor:
    """Tensor ``index`` of ``buffer`` as the DTensor users see (over the data-parallel
    axes, and tp in a tensor-parallel module)."""
    return buffer.get_dtensor(index) if tp is None else tp.sharded_dtensor(buffer, index)


class FsdpParameterGroup:
    """Buffers and parameter swapping for one group (see the module docstring)."""

    def __init__(
        self,
        owning_module: nn.Module,
        parameters: dict[str, nn.Parameter],
        mesh: DeviceMesh,
        *,
        model_weight_placements: tuple[Placement, ...],
        main_grad_placements: tuple[Placement, ...],
        main_weight_placements: tuple[Placement, ...],
        mixed_precision_policy: MixedPrecisionPolicy,
        grad_divisor: int,
        device: torch.device,
        allocator: StorageResizeAllocator,
        name: str,
        tensor_parallel: Optional[dict[nn.Parameter, TPParam]] = None,
    ) -> None:
        """``tensor_parallel``: the ``TPParam`` of each parameter in a tensor-parallel module."""
        if not parameters:
            raise ValueError("FsdpParameterGroup needs at least one parameter")
        fqns_of: dict[nn.Parameter, list[str]] = {}
        for fqn, parameter in parameters.items():
            fqns_of.setdefault(parameter, []).append(fqn)
        first = next(iter(fqns_of))
        self._owning_module = weakref.ref(owning_module)
        self.mesh, self.grad_divisor, self.name = mesh, grad_divisor, name
        self.dtype, self.requires_grad = first.dtype, first.requires_grad
        self._model_weight_placements = model_weight_placements
        self._main_grad_placements = main_grad_placements
        self._allocator = allocator
        accounting = allocator.accounting
        locals_ = [local_tensor(p).detach() for p in fqns_of]
        shapes = [t.shape for t in locals_]

        main_dtype = mixed_precision_policy.main_params_dtype or self.dtype
        self.main_weight = DBuffer.distribute_tensors(
            [t.to(main_dtype) for t in locals_], mesh, main_weight_placements, device=device, name=name
        )
        # model_weight rests in the optimizer's placements and is redistributed to the
        # parameter placements at the first unshard after each refresh (ZeRO-1/2 gather once).
        self.model_weight = self.main_weight.cast(self.dtype)
        # As in the main engine: one buffer is "model weights"; a separate main-weight
        # buffer exists only for a narrower compute dtype.
        accounting.add_persistent("model_weights", _nbytes(self.model_weight))
        if self.model_weight is not self.main_weight:
            accounting.add_persistent("main_weights", _nbytes(self.main_weight))
        replicated = (Replicate(),) * mesh.ndim
        self._unsharded_model_weight = DBuffer(mesh, replicated, shapes, self.dtype, device, name=name)
        self.main_grad: Optional[DBuffer] = None
        if self.requires_grad:
            grad_dtype = mixed_precision_policy.grads_dtype_for(self.dtype)
            self.main_grad = DBuffer(mesh, main_grad_placements, shapes, grad_dtype, device, name=name)
            accounting.add_persistent("main_grads", _nbytes(self.main_grad))
        self.fsdp_parameters = tuple(self._make_parameters(fqns_of, tensor_parallel or {}))
        self._synced_version = self._main_version()
        self._bind_unsharded(self._unsharded_model_weight)
        self.reshard_parameters()
        self._unsharded_model_weight.release_storage()
        # Counted from here on: every reallocation is a temporary full-weight buffer.
        self._unsharded_model_weight.allocator = allocator

    def _make_parameters(
        self, fqns_of: dict[nn.Parameter, list[str]], tensor_parallel: dict[nn.Parameter, TPParam]
    ) -> list[FsdpParameter]:
        out = []
        grad_dtype = self.main_grad.dtype if self.main_grad is not None else None
        for index, (parameter, fqns) in enumerate(fqns_of.items()):
            tp = tensor_parallel.get(parameter)
            view = self._unsharded_model_weight.get_local_tensor(index)
            if parameter.is_meta or (isinstance(parameter, DTensor) and parameter.device != view.device):
                # A meta tensor's data cannot be pointed at real storage, nor a DTensor at
                # another device; swap in a new Parameter keeping the object's identity
                # (and attributes, hooks).
                value = view if tp is None else tp.module_view(view)
                torch.utils.swap_tensors(parameter, nn.Parameter(value, requires_grad=parameter.requires_grad))
            parameter.grad = None
            sharded = nn.Parameter(_dtensor(tp, self.main_weight, index), requires_grad=parameter.requires_grad)
            share_grad_hooks(parameter, sharded)  # sharded.register_hook runs on the local gradient
            if grad_dtype is not None:
                # The optimizer sees main-dtype weights with main-grad-dtype gradients.
                sharded.grad_dtype = grad_dtype
            _OWNER[parameter] = _OWNER[sharded] = weakref.ref(self)
            out.append(FsdpParameter(fqns=tuple(fqns), sharded=sharded, unsharded=parameter,
                                     sharded_address=wrapper_address(sharded), tp=tp))
        return out

    def rename(self, name: str) -> None:
        """Label this group's collectives (names are known once the context is finalized)."""
        self.name = name
        for buffer in (self.main_weight, self.model_weight, self._unsharded_model_weight, self.main_grad):
            if buffer is not None:
                buffer.name = name

    # -- parameter swapping ----------------------------------------------------------------
    def _set_module_parameter(self, fqns: tuple[str, ...], parameter: nn.Parameter) -> None:
        owner = self._owning_module()
        if owner is None:
            raise RuntimeError("an FSDP parameter group outlived its module")
        for fqn in fqns:
            prefix, _, leaf = fqn.rpartition(".")
            module = owner.get_submodule(prefix) if prefix else owner
            module._parameters[leaf] = parameter

    def _bind_unsharded(self, unsharded: DBuffer) -> None:
        for index, fsdp_parameter in enumerate(self.fsdp_parameters):
            bind_local(fsdp_parameter.unsharded, unsharded.get_local_tensor(index))

    def reshard_parameters(self) -> None:
        """Install the sharded DTensor parameters on the modules."""
        for p in self.fsdp_parameters:
            self._set_module_parameter(p.fqns, p.sharded)

    def _install_unsharded(self) -> None:
        for p in self.fsdp_parameters:
            self._set_module_parameter(p.fqns, p.unsharded)

    # -- weights -------------------------------------------------------------------------
    def sync_model_weight_from_main_weight(self) -> None:
        """Refresh the compute weights from the (optimizer-updated) main weights."""
        reuse = (
            self.model_weight is not self.main_weight
            and self.model_weight.placements == self.main_weight.placements
            and self.model_weight.dtype == self.dtype
        )
        self.model_weight = self.main_weight.cast(self.dtype, out=self.model_weight if reuse else None)
        self._synced_version = self._main_version()

    def _main_version(self) -> tuple[int, int]:
        """Changes whenever the main weights are written in place: through the buffer,
        or through the sharded parameters (whose local tensors keep version
        counters of their own)."""
        through_params = sum(p.sharded._local_tensor._version for p in self.fsdp_parameters)
        return self.main_weight.local_buffer._version, through_params

    def _refresh_if_stale(self) -> None:
        # The optimizer writes the main weights in place, which bumps a version
        # counter: a changed version means compute weights older than the main weights.
        if self.model_weight is not self.main_weight or self.model_weight.placements != self._model_weight_placements:
            if self._main_version() != self._synced_version:
                self.sync_model_weight_from_main_weight()

    @property
    def _replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self._model_weight_placements)

    def unshard_parameters(self, *, async_op: bool = False) -> Optional[DBuffer]:
        """Start materialising the full weights; returns the buffer to ``wait()`` on
        (``None`` when nothing is in flight), then call ``install_unsharded``."""
        for p in self.fsdp_parameters:  # before anything is gathered from them
            if p.sharded_address is not None and wrapper_address(p.sharded) != p.sharded_address:
                raise RuntimeError(data_assignment_message(p.fqns[0]))
        self._refresh_if_stale()
        if self.model_weight.placements != self._model_weight_placements:
            self.model_weight = self.model_weight.redistribute(self._model_weight_placements)
            self._synced_version = self._main_version()
        if self._replicated:
            return None
        target = self._unsharded_model_weight
        target.reallocate_storage()
        # Autograd saved views of these parameters in forward; writing the gathered
        # values back into the same storage is not a change it should see.
        with torch.autograd._unsafe_preserve_version_counter(target.local_buffer):
            self.model_weight.redistribute(target.placements, out=target, async_op=async_op)
        return target

    def install_unsharded(self) -> None:
        """After the gather completed: point the parameters at the full weights and install them."""
        source = self.model_weight if self._replicated else self._unsharded_model_weight
        if source.is_pending:
            with torch.autograd._unsafe_preserve_version_counter(source.local_buffer):
                source.wait()
        self._bind_unsharded(source)
        self._install_unsharded()

    def release_unsharded_storage(self) -> None:
        if not self._replicated:
            self._unsharded_model_weight.release_storage()

    # -- gradients -------------------------------------------------------------------------
    def _has_sharded_grads(self) -> bool:
        present = [p.sharded.grad is not None for p in self.fsdp_parameters]
        if any(present) and not all(present):
            missing = [p.fqns[0] for p, has in zip(self.fsdp_parameters, present) if not has]
            raise RuntimeError(
                f"{self.name}: some sharded gradients were set to None by hand ({missing}); "
                "clear all of a module's gradients or none (optimizer.zero_grad does this)"
            )
        return all(present)

    def pack_gradients(self) -> Optional[DBuffer]:
        """Copy the full local gradients into one Partial buffer and free them.
        ``None`` when no parameter of the group received a gradient."""
        grads = [p.unsharded.grad for p in self.fsdp_parameters]
        if all(g is None for g in grads):
            return None
        missing = [p.fqns[0] for p, g in zip(self.fsdp_parameters, grads) if g is None]
        if missing:
            raise RuntimeError(
                f"{self.name}: parameters {missing} got no gradient while others of the same module did; "
                "unused parameters inside a sharded module are not supported: remove them, freeze them "
                "(requires_grad=False) before fully_shard, or shard them in a module of their own"
            )
        # A tensor-parallel gradient in its parameter's TP placement (summed over tp if Partial).
        grads = [g if p.tp is None else p.tp.local_grad(g) for p, g in zip(self.fsdp_parameters, grads)]
        dtype = self.main_grad.dtype if self.main_grad is not None else grads[0].dtype
        partial = DBuffer(
            self.mesh, (Partial("avg"),) * self.mesh.ndim, [g.shape for g in grads], dtype, grads[0].device,
            name=self.name,
        )
        self._allocator.accounting.on_alloc(_nbytes(partial))
        for index, (p, grad) in enumerate(zip(self.fsdp_parameters, grads)):
            partial.get_local_tensor(index).copy_(grad)
            p.unsharded.grad = None
        return partial

    def reduce_gradients(self, partial: DBuffer) -> "PendingReduction":
        """Launch the reduction of ``partial`` into ``main_grad`` (asynchronously)."""
        assert self.main_grad is not None
        accumulate = self._has_sharded_grads()
        if self.main_grad.placements != self._main_grad_placements:
            self._reset_main_grad(accumulate)
        direct = not accumulate
        reduced = partial.redistribute(
            self.main_grad.placements, out=self.main_grad if direct else None, async_op=True
        )
        return PendingReduction(group=self, partial=partial, reduced=reduced, accumulate=accumulate)

    def _reset_main_grad(self, accumulate: bool) -> None:
        # The previous step finalised main_grad into the optimizer placements; go back
        # to the accumulation placements (a relabel for HSDP, a new buffer for HFSDP).
        axis = changed_mesh_axis(self.main_grad.placements, self._main_grad_placements)
        if isinstance(self.main_grad.placements[axis], Replicate):
            self.main_grad = self.main_grad.redistribute(self._main_grad_placements)
            return
        old = self.main_grad
        self.main_grad = DBuffer(
            self.mesh, self._main_grad_placements, self.main_weight.layout.tensor_shapes, old.dtype, old.device,
            name=self.name,
        )
        if accumulate:
            # The sharded .grad stayed bound (zero_grad(set_to_none=False)) and may hold
            # what the user wrote into it since (a decay term): backward accumulates on
            # it, as in PyTorch. Carry it over as this rank's contribution to its own
            # rows, zero elsewhere, so the coming Partial -> Flat reduction gives back
            # exactly the old value plus the new gradients (AVG divides by the axis size).
            self.main_grad.local_buffer.zero_()
            own = self.main_grad.local_buffer.narrow(0, old.offset - self.main_grad.offset, old.local_buffer.numel())
            partial = self._main_grad_placements[axis]
            scale = self.mesh.size(axis) if partial.reduce_op == "avg" else 1
            torch.mul(old.local_buffer, scale, out=own)

    def finish_reduction(self, pending: "PendingReduction", is_last_microbatch: bool) -> None:
        """Wait for the reduction, accumulate, finalise on the last microbatch, bind ``.grad``."""
        reduced = pending.reduced.wait()
        self._allocator.accounting.on_free(_nbytes(pending.partial))
        if self.grad_divisor != 1:
            reduced.local_buffer.div_(self.grad_divisor)
        if pending.accumulate:
            self.main_grad.local_buffer.add_(reduced.local_buffer)
        elif reduced is not self.main_grad:
            self.main_grad.local_buffer.copy_(reduced.local_buffer)
        if is_last_microbatch and self.main_grad.placements != self.main_weight.placements:
            self.main_grad = self.main_grad.redistribute(self.main_weight.placements)
        for index, p in enumerate(self.fsdp_parameters):
            p.sharded.grad = _dtensor(p.tp, self.main_grad, index)
        if is_last_microbatch:
            for p in self.fsdp_parameters:
                # As FSDP2: a post-accumulate-grad hook on a sharded parameter runs once its
                # reduced gradient is bound (e.g. an optimizer step inside backward).
                for hook in (p.sharded._post_accumulate_grad_hooks or {}).values():
                    hook(p.sharded)


@dataclasses.dataclass(eq=False)
class PendingReduction:
    """A gradient reduction in flight; the module finishes it at the end of backward."""

    group: FsdpParameterGroup
    partial: DBuffer
    """Keeps the reduce-scatter input alive until the collective completed."""
    reduced: DBuffer
    accumulate: bool


def _nbytes(buffer: DBuffer) -> int:
    return buffer.local_buffer.numel() * buffer.local_buffer.element_size()
