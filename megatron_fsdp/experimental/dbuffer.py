"""DBuffer: several logical tensors in one flat local buffer, with DTensor-style
placements along each mesh axis, storage release / reallocation, and
redistribution (all-gather, reduce-scatter, all-reduce, local scatter) that can
write into a preallocated ``out=`` buffer.

Communication goes through ``megatron_fsdp.comm.collectives`` (so it is counted by
``record_collectives``, labelled for the profiler, and uses the point-to-point
gloo transport on CPU); asynchronous collectives leave a pending handle on the
destination that ``wait()`` completes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ..comm import collectives
from ..buffers.allocator import StorageResizeAllocator, is_allocated
from ..comm.device import current_stream
from .layout import GlobalLayout, non_leading_numel
from .dtensor import flat_dtensor
from .placement import Flat, NestedRows, changed_mesh_axis, validate_placements

__all__ = ["DBuffer"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


@dataclasses.dataclass
class _Pending:
    """An asynchronous collective writing into a DBuffer, and the local step after it."""

    handle: Optional[collectives.Handle]
    finish: Optional[Callable[[], None]] = None


def _reduce_op(placement: Partial) -> dist.ReduceOp.RedOpType:
    if placement.reduce_op not in _REDUCE_OPS:
        raise NotImplementedError(f"Partial({placement.reduce_op!r}): DBuffer reduces with 'sum' or 'avg' only")
    return _REDUCE_OPS[placement.reduce_op]


class DBuffer:
    """A distributed flat buffer holding a group of logical tensors (see module docstring)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    layout: GlobalLayout
    offset: int
    """Where this rank's local buffer starts in the global flat buffer."""
    local_buffer: torch.Tensor
    name: str
    """Label of this buffer's collectives in the profiler and the collective recorder."""
    allocator: Optional[StorageResizeAllocator]
    """Counts released / reallocated storage in its accounting (``None``: not counted)."""
    allocation_stream: Optional[torch.Stream]
    """The stream the local storage was allocated on (``None`` on the CPU). Kept for
    upstream's API (its users read and pass it); this package does not consult it, since
    its buffers are used on the stream they were allocated on."""

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        name: str = "",
        allocator: Optional[StorageResizeAllocator] = None,
    ) -> None:
        layout = GlobalLayout.build(tensor_shapes, dp_size=mesh.size())
        placements = self._check_placements(mesh, placements)
        offset, numel = self._local_range(mesh, layout, placements)
        self._init(mesh, placements, layout, offset, torch.empty(numel, dtype=dtype, device=device), name, allocator)

    def _init(self, mesh, placements, layout, offset, local_buffer, name, allocator, allocation_stream=None) -> None:
        self.mesh, self.placements, self.layout, self.offset = mesh, placements, layout, offset
        self.local_buffer, self.name, self.allocator = local_buffer, name, allocator
        self.allocation_stream = allocation_stream if allocation_stream is not None else current_stream(local_buffer.device)
        self._pending: list[_Pending] = []

    @staticmethod
    def _check_placements(mesh: DeviceMesh, placements: Iterable[Placement]) -> tuple[Placement, ...]:
        placements = validate_placements(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(f"{len(placements)} placements {placements!r} for a {mesh.ndim}-d mesh; give one per axis")
        return placements

    @staticmethod
    def _local_range(mesh: DeviceMesh, layout: GlobalLayout, placements: Sequence[Placement]) -> tuple[int, int]:
        sizes = [mesh.size(axis) for axis in range(mesh.ndim)]
        ranks = [mesh.get_local_rank(axis) for axis in range(mesh.ndim)]
        return layout.local_range(sizes, ranks, [isinstance(p, Flat) for p in placements])

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_local(
        cls,
        local_buffer: torch.Tensor,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
        *,
        name: str = "",
        allocator: Optional[StorageResizeAllocator] = None,
        allocation_stream: Optional[torch.Stream] = None,
    ) -> "DBuffer":
        """Wrap an existing flat, contiguous local buffer (no allocation). ``allocation_stream``:
        the stream ``local_buffer`` was allocated on (default: its device's current stream)."""
        placements = cls._check_placements(mesh, placements)
        layout = GlobalLayout.build(tensor_shapes, dp_size=mesh.size())
        offset, numel = cls._local_range(mesh, layout, placements)
        if local_buffer.dim() != 1 or not local_buffer.is_contiguous():
            raise ValueError(f"local_buffer must be flat and contiguous, got shape {tuple(local_buffer.shape)}")
        if local_buffer.numel() != numel:
            raise ValueError(f"local_buffer has {local_buffer.numel()} elements; these placements need {numel}")
        buffer = cls.__new__(cls)
        buffer._init(mesh, placements, layout, offset, local_buffer, name, allocator, allocation_stream)
        return buffer

    @classmethod
    def distribute_tensors(
        cls,
        tensors: Iterable[torch.Tensor],
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        *,
        device: torch.device | str | None = None,
        name: str = "",
    ) -> "DBuffer":
        """Copy this rank's part of full tensors into a new DBuffer. Meta tensors give
        only their shape; their range stays uninitialised."""
        tensors = tuple(t.detach() for t in tensors)
        if not tensors:
            raise ValueError("DBuffer.distribute_tensors needs at least one tensor")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"tensors of one DBuffer must share a dtype, got {sorted(map(str, dtypes))}")
        device = torch.device(device if device is not None else mesh.device_type)
        buffer = cls(mesh, placements, [t.shape for t in tensors], tensors[0].dtype, device, name=name)
        for index, tensor in enumerate(tensors):
            part = buffer._owned(index)
            if part is None or tensor.is_meta:
                continue
            source = tensor.reshape(-1).narrow(0, part.item_start, part.numel)
            buffer.local_buffer.narrow(0, part.shard_start, part.numel).copy_(source)
        return buffer

    # -- properties and storage ------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.local_buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.local_buffer.device

    @property
    def is_allocated(self) -> bool:
        return is_allocated(self.local_buffer) or self.local_buffer.numel() == 0

    def release_storage(self) -> None:
        """Free the local storage but keep the storage object: views of it (parameters,
        tensors autograd saved) stay valid and see the data again after reallocation."""
        if self.allocator is not None:
            self.allocator.release(self.local_buffer)
        else:
            self.local_buffer.untyped_storage().resize_(0)

    def reallocate_storage(self) -> None:
        """Give the local storage its size back (contents undefined)."""
        if self.allocator is not None:
            self.allocator.allocate(self.local_buffer)
        else:
            self.local_buffer.untyped_storage().resize_(self.local_buffer.numel() * self.local_buffer.element_size())

    # -- pending collectives -----------------------------------------------------------
    def wait(self) -> "DBuffer":
        """Complete the asynchronous collectives writing into this buffer."""
        pending, self._pending = self._pending, []
        for item in pending:
            if item.handle is not None:
                item.handle.wait()
            if item.finish is not None:
                item.finish()
        return self

    @property
    def is_pending(self) -> bool:
        return bool(self._pending)

    # -- redistribution ------------------------------------------------------------------
    def _destination(self, out: Optional["DBuffer"], placements, dtype=None) -> "DBuffer":
        dtype = dtype or self.dtype
        if out is None:
            return DBuffer(self.mesh, placements, self.layout.tensor_shapes, dtype, self.device, name=self.name)
        checks = (
            ("mesh", out.mesh, self.mesh),
            ("placements", out.placements, tuple(placements)),
            ("layout", out.layout, self.layout),
            ("dtype", out.dtype, dtype),
            ("device", out.device, self.device),
        )
        for what, got, want in checks:
            if got != want:
                raise ValueError(f"out= has {what} {got!r}; this operation writes {want!r}")
        return out

    def cast(self, dtype: torch.dtype, *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """The same tensors in ``dtype`` (``self`` when nothing changes and no ``out``)."""
        if dtype == self.dtype and out is None:
            return self
        destination = self._destination(out, self.placements, dtype)
        destination.local_buffer.copy_(self.local_buffer)
        return destination

    def redistribute(
        self, new_placements: Iterable[Placement], *, out: Optional["DBuffer"] = None, async_op: bool = False
    ) -> "DBuffer":
        """This buffer with one mesh axis's placement changed (see placement.py for the
        transitions). ``async_op``: return at once; ``wait()`` the result before use."""
        new_placements = self._check_placements(self.mesh, new_placements)
        axis = changed_mesh_axis(self.placements, new_placements)
        if axis is None:
            if out is None:
                return self
            destination = self._destination(out, new_placements)
            destination.local_buffer.copy_(self.local_buffer)
            return destination
        old, new = self.placements[axis], new_placements[axis]
        if isinstance(old, Flat) and isinstance(new, Replicate):
            return self.allgather(axis, out=out, async_op=async_op)
        if isinstance(old, Partial) and isinstance(new, Replicate):
            return self.allreduce(axis, out=out, async_op=async_op)
        if isinstance(old, Partial) and isinstance(new, Flat):
            return self.reduce_scatter(axis, new, out=out, async_op=async_op)
        if isinstance(old, Replicate) and isinstance(new, Flat):
            return self.scatter(axis, new, out=out)
        if isinstance(old, Replicate) and isinstance(new, Partial):
            return self._relabel_partial(axis, new, out)
        raise NotImplementedError(
            f"DBuffer cannot redistribute {old!r} -> {new!r} on mesh axis {axis}; supported: Flat->Replicate, "
            "Partial->Replicate, Partial->Flat, Replicate->Flat, Replicate->Partial('avg')"
        )

    def _with(self, axis: int, placement: Placement) -> tuple[Placement, ...]:
        placements = list(self.placements)
        placements[axis] = placement
        return validate_placements(placements)

    def _launch(self, destination: "DBuffer", pending: _Pending, async_op: bool) -> "DBuffer":
        destination._pending.append(pending)
        return destination if async_op else destination.wait()

    def allgather(self, mesh_axis: int, *, out: Optional["DBuffer"] = None, async_op: bool = False) -> "DBuffer":
        """Flat -> Replicate on ``mesh_axis``."""
        if not isinstance(self.placements[mesh_axis], Flat):
            raise ValueError(f"allgather needs Flat on mesh axis {mesh_axis}, got {self.placements[mesh_axis]!r}")
        destination = self._destination(out, self._with(mesh_axis, Replicate()))
        handle = collectives.all_gather(
            destination.local_buffer, self.local_buffer, self.mesh.get_group(mesh_axis), async_op=True, label=self.name
        )
        return self._launch(destination, _Pending(handle), async_op)

    def reduce_scatter(
        self, mesh_axis: int, new_placement: Placement, *, out: Optional["DBuffer"] = None, async_op: bool = False
    ) -> "DBuffer":
        """Partial -> Flat on ``mesh_axis``."""
        partial = self.placements[mesh_axis]
        if not isinstance(partial, Partial) or not isinstance(new_placement, Flat):
            raise ValueError(f"reduce_scatter goes Partial -> Flat, not {partial!r} -> {new_placement!r}")
        destination = self._destination(out, self._with(mesh_axis, new_placement))
        handle = collectives.reduce_scatter(
            destination.local_buffer,
            self.local_buffer,
            self.mesh.get_group(mesh_axis),
            op=_reduce_op(partial),
            async_op=True,
            label=self.name,
        )
        return self._launch(destination, _Pending(handle), async_op)

    def allreduce(self, mesh_axis: int, *, out: Optional["DBuffer"] = None, async_op: bool = False) -> "DBuffer":
        """Partial -> Replicate on ``mesh_axis``. Gloo has no AVG: sum, then divide."""
        partial = self.placements[mesh_axis]
        if not isinstance(partial, Partial):
            raise ValueError(f"allreduce needs Partial on mesh axis {mesh_axis}, got {partial!r}")
        destination = self._destination(out, self._with(mesh_axis, Replicate()))
        if destination.local_buffer.data_ptr() != self.local_buffer.data_ptr():
            destination.local_buffer.copy_(self.local_buffer)
        op = _reduce_op(partial)
        size = self.mesh.size(mesh_axis)
        handle = collectives.all_reduce(
            destination.local_buffer, self.mesh.get_group(mesh_axis), op=dist.ReduceOp.SUM, async_op=True, label=self.name
        )
        finish = (lambda: destination.local_buffer.div_(size)) if op == dist.ReduceOp.AVG else None
        return self._launch(destination, _Pending(handle, finish), async_op)

    def scatter(self, mesh_axis: int, new_placement: Placement, *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """Replicate -> Flat on ``mesh_axis``: keep this rank's slice (a view unless ``out``)."""
        if not isinstance(self.placements[mesh_axis], Replicate) or not isinstance(new_placement, Flat):
            raise ValueError(f"scatter goes Replicate -> Flat, not {self.placements[mesh_axis]!r} -> {new_placement!r}")
        placements = self._with(mesh_axis, new_placement)
        offset, numel = self._local_range(self.mesh, self.layout, placements)
        piece = self.local_buffer.narrow(0, offset - self.offset, numel)
        if out is None:
            return DBuffer.from_local(
                piece, self.mesh, placements, self.layout.tensor_shapes, name=self.name,
                allocation_stream=self.allocation_stream,
            )
        destination = self._destination(out, placements)
        destination.local_buffer.copy_(piece)
        return destination

    def _relabel_partial(self, axis: int, new: Partial, out: Optional["DBuffer"]) -> "DBuffer":
        # The average of identical values is that value, so the local data stays; a
        # SUM placement would need dividing by the axis size, which nothing here uses.
        if new.reduce_op != "avg" or out is not None:
            raise NotImplementedError("Replicate -> Partial is supported for Partial('avg') without out= only")
        return DBuffer.from_local(
            self.local_buffer, self.mesh, self._with(axis, new), self.layout.tensor_shapes, name=self.name,
            allocation_stream=self.allocation_stream,
        )

    # -- per-tensor views ------------------------------------------------------------------
    def _owned(self, index: int):
        return self.layout.overlap(index, self.offset, self.local_buffer.numel())

    def local_rows(self, index: int) -> tuple[int, int]:
        """(first row, number of rows) of tensor ``index`` held here."""
        part = self._owned(index)
        if part is None:
            return 0, 0
        row = non_leading_numel(self.layout.tensor_shapes[index])
        return part.item_start // row, part.numel // row

    def get_local_tensor(self, index: int) -> torch.Tensor:
        """This rank's rows of tensor ``index`` as a view of the local buffer."""
        shape = self.layout.tensor_shapes[index]
        part = self._owned(index)
        if part is None:
            return self.local_buffer.new_empty((0, *shape[1:]))
        row = non_leading_numel(shape)
        assert part.item_start % row == 0 and part.numel % row == 0, "row-aligned layout split a row"
        return self.local_buffer.narrow(0, part.shard_start, part.numel).view(part.numel // row, *shape[1:])

    def get_dtensor(self, index: int) -> DTensor:
        """Tensor ``index`` as a DTensor over this buffer's mesh and placements.

        [Note: uneven shards] A rank's rows follow the flat layout, not torch's
        ``chunk`` split. The DTensor's ``Flat`` placement therefore records each
        rank's rows, and DTensor's redistribution (``full_tensor()``,
        ``redistribute``) goes through ``Flat``'s methods, which use them.
        """
        local = self.get_local_tensor(index)
        return flat_dtensor(
            local, self.mesh, self.tensor_placements(index), shape=self.layout.tensor_shapes[index], stride=local.stride()
        )

    def tensor_placements(self, index: int) -> tuple[Placement, ...]:
        """This buffer's placements for tensor ``index``: each ``Flat`` records the
        tensor's rows per rank (see [Note: uneven shards])."""
        flat_axes = [isinstance(p, Flat) for p in self.placements]
        if sum(flat_axes) > 1:
            row = non_leading_numel(self.layout.tensor_shapes[index])
            part = self._owned(index)
            first = flat_axes.index(True)
            return tuple(
                Flat(nested=NestedRows(
                    total=self.layout.tensor_shapes[index][0],
                    local_rows=part.numel // row if part else 0,
                    offset=part.item_start // row if part else 0,
                    outermost=axis == first,
                )) if flat else p
                for axis, (p, flat) in enumerate(zip(self.placements, flat_axes))
            )
        sizes = [self.mesh.size(axis) for axis in range(self.mesh.ndim)]
        ranks = [self.mesh.get_local_rank(axis) for axis in range(self.mesh.ndim)]
        return tuple(
            Flat(self.layout.rows_per_rank(index, sizes, ranks, flat_axes, axis)) if flat else p
            for axis, (p, flat) in enumerate(zip(self.placements, flat_axes))
        )

    def __repr__(self) -> str:
        return (
            f"DBuffer(name={self.name!r}, placements={self.placements}, tensors={len(self.layout.tensor_shapes)}, "
            f"local={self.local_buffer.numel()} x {self.dtype}, offset={self.offset})"
        )
