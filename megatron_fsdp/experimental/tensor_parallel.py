"""Tensor parallelism under experimental ``fully_shard``: a module whose parameters
are DTensors of a TP plan, sharded over the data-parallel mesh.

[Note: tensor-parallel modules] FSDP2's 2-D layout on DBuffers. The user builds one
mesh, applies a TP plan on ``mesh["tp"]`` (``parallelize_module``) and passes the
data-parallel part, ``mesh["dp"]`` (or ``mesh["dp_outer", "dp_shard"]``), to
``fully_shard``. Every data-parallel rank of a group holds the same TP piece, so
the DBuffers shard each parameter's *TP-local* tensor: gathers and reductions run
over the data-parallel groups only and see plain local tensors. ``TPParam``
remembers the rest, one per parameter of such a module (a plain parameter, say a
norm outside the plan, is one replicated over tp):

* while the module runs, it reads the user's own DTensor parameter over the TP mesh
  (the plan's hooks and DTensor's ops need one), its local tensor pointed at the
  gathered weights (``bind_local``);
* the gradient autograd leaves there is redistributed to the parameter's TP placement
  before the data-parallel reduction (``TPParam.local_grad``): a ``Partial`` one (a
  sequence-parallel norm's weight) is summed over tp, as FSDP2 does;
* the sharded parameters, their gradients and optimizer states are DTensors over the
  data-parallel axes and tp (``DeviceMesh._concatenate``, as FSDP2) whose
  ``full_tensor()`` is the whole weight (``TPParam.sharded_dtensor``), so norms count
  a TP-sharded element once on its TP rank and a replicated one once;
* full weights gather the TP pieces after the data-parallel gather (``TPParam.full``)
  and checkpoints place each local piece inside the whole tensor (``piece_offsets``).

A module is tensor-parallel when one of the parameters it owns is a DTensor. One
without any (a block the plan left alone) is sharded as without tensor parallelism,
its DTensors over the data-parallel axes alone, as FSDP2 does; torch's
``clip_grad_norm_`` cannot combine norms of DTensors on different meshes, so in a
tensor-parallel model let such parameters be owned by a tensor-parallel module (shard
the plain module together with its parent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from torch.distributed import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .dbuffer import DBuffer
from .dtensor import flat_dtensor
from .placement import Flat, NestedRows

__all__ = ["TPParam", "bind_local", "find_tensor_parallel", "local_tensor"]


def local_tensor(parameter: torch.Tensor) -> torch.Tensor:
    """What a DBuffer holds of ``parameter``: its local tensor when it is a DTensor."""
    return parameter._local_tensor if isinstance(parameter, DTensor) else parameter


def bind_local(parameter: nn.Parameter, view: torch.Tensor) -> None:
    """Point ``parameter`` (keeping the object: autograd saved it, hooks hang on it)
    at ``view``. A DTensor's local tensor is its own attribute, as FSDP2 sets it."""
    if isinstance(parameter, DTensor):
        parameter._local_tensor = view
    else:
        parameter.data = view


@dataclasses.dataclass(frozen=True, eq=False)
class TPParam:
    """One parameter of a tensor-parallel module across the TP ranks."""

    tp_mesh: DeviceMesh
    """The 1-D tensor-parallel mesh."""
    mesh: DeviceMesh
    """The data-parallel axes and tp: where the sharded DTensors live."""
    placement: Placement
    """``Shard(d)`` or ``Replicate()`` over tp."""
    shape: torch.Size
    """The whole weight's shape."""
    reads_dtensor: bool
    """The module reads a DTensor (a TP plan's parameter), not a plain tensor."""

    @property
    def split_dim(self) -> Optional[int]:
        return self.placement.dim if isinstance(self.placement, Shard) else None

    def module_view(self, local: torch.Tensor) -> torch.Tensor:
        """A new parameter value over ``local`` (meta parameters are swapped for one)."""
        if not self.reads_dtensor:
            return local
        return DTensor.from_local(local, self.tp_mesh, (self.placement,), run_check=False, shape=self.shape,
                                  stride=_contiguous_stride(self.shape))

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local gradient in the parameter's TP placement (a collective over tp
        for a ``Partial`` one; every TP rank runs the same modules in the same order)."""
        if not isinstance(grad, DTensor):
            return grad
        if grad.placements != (self.placement,):
            grad = grad.redistribute(self.tp_mesh, (self.placement,))
        return grad._local_tensor

    def piece_offsets(self) -> tuple[int, ...]:
        """Where this rank's TP piece starts in the whole tensor, per dim."""
        offsets = [0] * len(self.shape)
        dim = self.split_dim
        if dim is not None:  # pieces of equal size (find_tensor_parallel refuses others)
            offsets[dim] = self.tp_mesh.get_local_rank() * (self.shape[dim] // self.tp_mesh.size())
        return tuple(offsets)

    def full(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every TP rank's ``piece`` (a collective over tp)."""
        if self.split_dim is None:
            return piece
        return DTensor.from_local(piece, self.tp_mesh, (self.placement,), run_check=False, shape=self.shape,
                                  stride=_contiguous_stride(self.shape)).full_tensor()

    def sharded_dtensor(self, buffer: DBuffer, index: int) -> DTensor:
        """Tensor ``index`` of ``buffer`` as a DTensor over the data-parallel axes and tp."""
        local = buffer.get_local_tensor(index)
        return flat_dtensor(local, self.mesh, self._placements(buffer, index), shape=self.shape,
                            stride=_contiguous_stride(self.shape))

    def _placements(self, buffer: DBuffer, index: int) -> tuple[Placement, ...]:
        dp = buffer.tensor_placements(index)
        flat_axes = [axis for axis, p in enumerate(dp) if isinstance(p, Flat)]
        if not flat_axes:
            return (*dp, self.placement)
        if self.split_dim == 0:
            # Rows of a TP piece: nested on every row-split axis, tp included (dtensor.py
            # [Note: gathering nested rows]); this rank's rows start inside its piece.
            start, rows = buffer.local_rows(index)
            offset = self.piece_offsets()[0] + start
            inner = NestedRows(self.shape[0], rows, offset, outermost=False, gatherable=True)
            outer = dataclasses.replace(inner, outermost=True)  # the first in mesh order places the rows
            dp = tuple(Flat(nested=outer if axis == flat_axes[0] else inner) if axis in flat_axes else p
                       for axis, p in enumerate(dp))
            return (*dp, Flat(nested=inner))
        # TP leaves the rows whole: the data-parallel placements hold as they are;
        # rows nested on several data-parallel axes (HFSDP) become gatherable.
        return (*(Flat(nested=dataclasses.replace(p.nested, gatherable=True))
                  if isinstance(p, Flat) and p.nested is not None else p for p in dp), self.placement)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def find_tensor_parallel(
    parameters: Iterable[tuple[str, nn.Parameter]], dp_mesh: DeviceMesh
) -> dict[nn.Parameter, TPParam]:
    """``TPParam`` of every parameter when some are DTensors (of a TP plan), else
    ``{}``. Refuses, before anything changes, a DTensor this module cannot shard."""
    named = list(parameters)
    dtensors = [(name, p) for name, p in named if isinstance(p, DTensor)]
    if not dtensors:
        return {}
    first_name, first = dtensors[0]
    tp_mesh = first.device_mesh
    for name, p in dtensors:
        _check_dtensor(name, p, tp_mesh, first_name)
    mesh = _spmd_mesh(dp_mesh, tp_mesh, first_name)
    specs: dict[nn.Parameter, TPParam] = {}
    for _, p in named:
        if p not in specs:
            placement = p.placements[0] if isinstance(p, DTensor) else Replicate()
            specs[p] = TPParam(tp_mesh, mesh, placement, p.shape, reads_dtensor=isinstance(p, DTensor))
    return specs


_HOW = (
    "megatron_fsdp.experimental composes with a 1-D tensor-parallel plan: build one mesh, e.g. "
    "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply the plan with "
    "parallelize_module(model, mesh['tp'], plan) and pass the data-parallel part to fully_shard(module, "
    "mesh=mesh['dp'], ...)"
)


def _check_dtensor(name: str, p: DTensor, tp_mesh: DeviceMesh, first_name: str) -> None:
    where = f"parameter {name!r} is a DTensor on {p.device_mesh} with placements {tuple(p.placements)}"
    if p.device_mesh.ndim != 1:
        raise NotImplementedError(f"{where}: only a 1-D tensor-parallel mesh is supported. {_HOW}")
    if p.device_mesh != tp_mesh:
        raise ValueError(
            f"{where}, but {first_name!r} of the same module is one on {tp_mesh}: one module's parameters "
            f"share one tensor-parallel mesh. {_HOW}"
        )
    (placement,) = p.placements
    if type(placement) not in (Shard, Replicate):
        raise NotImplementedError(
            f"{where}: {placement!r} cannot be sharded over the data-parallel ranks (Shard(d) and Replicate() "
            f"can); give the plan's parameters one of those. {_HOW}"
        )
    tp = tp_mesh.size()
    if isinstance(placement, Shard) and p.shape[placement.dim] % tp:
        raise NotImplementedError(
            f"{where}: dim {placement.dim} of size {p.shape[placement.dim]} does not split evenly over the "
            f"{tp} tensor-parallel ranks, and the sharded DTensors place each rank's piece by the even split; "
            f"make that dim a multiple of {tp}"
        )


def _spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The data-parallel axes and tp as one mesh, as FSDP2 builds it (no new groups)."""
    if not dp_mesh.mesh_dim_names or not tp_mesh.mesh_dim_names:
        raise ValueError(
            f"parameter {name!r} is a DTensor on {tp_mesh} and fully_shard got the mesh {dp_mesh}: with tensor "
            f"parallelism both must be named parts of one mesh. {_HOW}"
        )
    try:
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError as exc:
        raise ValueError(
            f"parameter {name!r} is a DTensor on {tp_mesh}, which is not a part of the device mesh the "
            f"data-parallel mesh {dp_mesh} was taken from, or overlaps it ({exc}): the sharded parameters "
            f"need both in one mesh, and gradients are reduced over the data-parallel ranks only. {_HOW}"
        ) from exc
