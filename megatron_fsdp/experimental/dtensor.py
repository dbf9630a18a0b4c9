"""The DTensors that expose DBuffer tensors (sharded parameters and gradients).

Their ``Flat`` placements record each rank's rows (placement.py), so DTensor's
own redistribution (``full_tensor()``, ``redistribute``) is exact. What no
placement method sees is handled by ``FlatDTensor``, the DTensor subclass these
tensors have, around each op:

* sharding propagation labels outputs with plain ``Shard(d)`` (torch.chunk rows):
  an output with the same rows as a ``Flat`` input is relabelled ``Flat`` (so
  ``p * 2``, ``p.clone()``, optimizer states stay exact); any other ``Shard`` of
  a ``Flat`` axis (``p.t()``, ``p.reshape(-1)``) is refused;
* ``mean`` would average per-rank means (``Partial("avg")``): it is computed as a
  sum over the count instead, and any other ``Partial("avg")`` of a Flat axis is
  refused; a full ``max``/``min`` where some rank holds no rows, and element-wise
  work pairing tensors whose rows sit on different ranks, are refused on every
  rank alike (the rows are known everywhere, so no rank is left waiting);
* ``redistribute`` to a plain ``Shard(0)`` (DTensor would leave a dim-0 shard's
  rows in place) goes through ``Replicate``;
* in-place ops advance the local tensors' version counters (DTensor's do not),
  which is how stale compute weights are noticed;
* pickling writes this rank's rows, not the whole flat buffer they are a view of;
* ``redistribute`` of rows nested on several axes that can be gathered (a
  tensor-parallel weight) gathers them first, see [Note: gathering nested rows].

[Note: gathering nested rows] A weight that tensor parallelism splits by rows and
the data-parallel ranks split again (rows of each tensor-parallel piece) is laid
out tp-first, which torch's left-to-right ``Shard`` composition cannot describe
(FSDP2 uses ``_StridedShard``, which assumes torch.chunk's even rows; the flat
layout's are not). Each rank's ``Flat(nested=...)`` records its own rows instead,
and these rows are disjoint across the ranks of every nested axis. So the whole
tensor is a sum: each rank writes its rows into zeros and an all-reduce over each
nested axis in turn fills in the rest. Adding zeros is exact (only a ``-0.0``
element reads back as ``0.0``). One collective of the whole tensor per axis: this
serves ``full_tensor()`` and state dicts, not training, which gathers through the
DBuffers.

[Note: Flat specs] torch requires a ``Shard`` subclass to compare equal to the
plain ``Shard`` of its dim (DTensorSpec checks its shard order that way), so a
``Flat`` equals ``Shard(0)`` (placement.py). DTensor's native sharding cache finds
entries by hash bucket and then equality, so on an unlucky bucket a plain
``Shard(0)`` DTensor (FSDP2's, a user's) was served the outputs cached for a
``Flat`` one, rows and all (seen as a hang in ``full_tensor()``, measured at about
1 op in 300). So every spec with a ``Flat`` placement is a ``FlatSpec``, which
equals only another ``FlatSpec``: cache keys of the two kinds never match.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten, tree_map

from ..buffers import dtensor_dispatch as dtensor_route
from ..buffers.piece_dtensor import (
    AUTOGRAD_INPUTS_MESSAGE, EXTREME_NORMS, RANDOM_FILLS, TRUNC_NORMAL_REFUSED, init_caller, is_foreach,
    stand_in_for_empty_locals,
)
from .placement import Flat

__all__ = ["FlatDTensor", "FlatSpec", "flat_dtensor", "gather_nested_rows"]

aten = torch.ops.aten
_MEAN = {aten.mean.default, aten.mean.dim}
# Full reductions that fail on a rank holding no rows (torch raises there alone,
# and the other ranks would wait for it in a collective).
_NO_EMPTY = {aten.max.default, aten.min.default}
_ALIASES = {aten.detach.default, aten.alias.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


class FlatSpec(DTensorSpec):
    """A DTensorSpec with a ``Flat`` placement; see [Note: Flat specs]."""

    def __eq__(self, other: object, /) -> bool:
        return isinstance(other, FlatSpec) and self._check_equals(other)

    __hash__ = DTensorSpec.__hash__  # defining __eq__ would otherwise drop it


def _flat_spec(spec: DTensorSpec, placements=None) -> DTensorSpec:
    """``spec`` (with ``placements``) as a FlatSpec when any placement is Flat."""
    placements = tuple(spec.placements if placements is None else placements)
    if not any(isinstance(p, Flat) for p in placements):
        return spec if placements == spec.placements and type(spec) is DTensorSpec else DTensorSpec(
            spec.mesh, placements, tensor_meta=spec.tensor_meta)
    if type(spec) is FlatSpec and all(a is b for a, b in zip(placements, spec.placements)):
        return spec
    return FlatSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _guard(func, types, args, kwargs, base):
    """The aten-level guard (module docstring); ``base`` computes an op as plain
    DTensor does ([Note: DTensor subclass routes] in ``dtensor_dispatch.py``)."""
    if func in EXTREME_NORMS:  # an inf norm over ranks holding no rows
        args, kwargs = stand_in_for_empty_locals(func, args, kwargs, FlatDTensor)
    flats = _flat_axes((args, kwargs))
    if func in RANDOM_FILLS and isinstance(args[0], DTensor) and any(isinstance(p, Shard) for p in args[0].placements):
        return _fill_rows_at_random(func, args, kwargs)  # Flat rows, or a tensor-parallel piece
    if func in _MEAN:
        return _exact_mean(args, kwargs, types, base)
    _refuse_before(func, args, flats)
    _refuse_mismatched_rows(func, args, kwargs, flats)
    out = base(func, types, args, kwargs)
    if func._schema.is_mutable:
        _bump_versions(func, args, kwargs)
        first = func._schema.arguments[0] if func._schema.arguments else None
        in_place = first is not None and first.alias_info is not None and first.alias_info.is_write
        if in_place and args and isinstance(args[0], FlatDTensor) and isinstance(out, DTensor):
            return args[0]  # an in-place op returns its input (an out= op its out)
    if is_foreach(func) and isinstance(out, (list, tuple)):
        # The i-th output comes from the i-th tensor of each input list.
        groups = _paired_tensors(func, args, kwargs)
        return type(out)(_relabel(o, _flat_axes(g), func) for o, g in zip(out, groups))
    return tree_map(lambda t: _relabel(t, flats, func), out)


class FlatDTensor(DTensor):
    """A DTensor with ``Flat`` placements (see the module docstring)."""

    if dtensor_route.ROUTE is dtensor_route.DispatchRoute.TORCH_DISPATCH:
        __torch_dispatch__ = dtensor_route.torch_dispatch_route(_guard)
        # piece_dtensor.py [Note: autograd to distributed parameters]: the sharded
        # parameters are not in the graph either (the forward uses the unsharded ones).
        __torch_function__ = dtensor_route.autograd_refusal(AUTOGRAD_INPUTS_MESSAGE)
    else:
        __torch_function__ = dtensor_route.torch_function_route(_guard, AUTOGRAD_INPUTS_MESSAGE)

    def __reduce_ex__(self, protocol):
        # This rank's rows only, in storage of their own: the local tensor is a view
        # of a whole flat buffer, which pickling would otherwise write out entirely.
        local = self._local_tensor.detach().clone()
        return _rebuild, (local, self.device_mesh, self.placements, self.shape, self.stride(), self.requires_grad)

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kwargs):  # type: ignore[override]
        placements = tuple(placements) if placements is not None else None
        if placements is not None and placements != self.placements and any(_gatherable(p) for p in self.placements):
            if device_mesh is not None and device_mesh != self.device_mesh:
                raise ValueError(f"redistribute to mesh {device_mesh}: this DTensor lives on {self.device_mesh}")
            gathered = gather_nested_rows(self)
            return gathered.redistribute(device_mesh, placements, async_op=async_op, **kwargs)
        if placements is not None and any(
            type(new) is Shard and isinstance(old, Flat) for old, new in zip(self.placements, placements)
        ):
            # DTensor leaves a dim-0 shard's rows in place when asked for Shard(0):
            # go through Replicate, from which Shard(0) is torch.chunk's split.
            staged = tuple(Replicate() if isinstance(p, Flat) else p for p in self.placements)
            replicated = super().redistribute(device_mesh, staged, async_op=async_op, **kwargs)
            return replicated.redistribute(device_mesh, placements, async_op=async_op, **kwargs)
        out = super().redistribute(device_mesh, placements, async_op=async_op, **kwargs)
        # Still Flat on some axis: keep it a FlatDTensor ([Note: Flat specs]).
        spec = _flat_spec(out._spec)
        return out if spec is out._spec else FlatDTensor(out._local_tensor, spec, requires_grad=out.requires_grad)


def _gatherable(p: Placement) -> bool:
    return isinstance(p, Flat) and p.nested is not None and p.nested.gatherable


def gather_nested_rows(t: DTensor) -> DTensor:
    """``t`` with ``Replicate`` on its gatherable nested axes (see [Note: gathering
    nested rows]); a plain DTensor when no ``Flat`` is left. Not differentiable."""
    axes = [axis for axis, p in enumerate(t.placements) if _gatherable(p)]
    rows = t.placements[axes[0]].nested
    local = t._local_tensor.detach()
    whole = local.new_zeros((rows.total, *local.shape[1:]))
    whole.narrow(0, rows.offset, rows.local_rows).copy_(local)
    for axis in axes:
        whole = funcol.wait_tensor(funcol.all_reduce(whole, "sum", (t.device_mesh, axis)))
    placements = tuple(Replicate() if axis in axes else p for axis, p in enumerate(t.placements))
    plain = DTensor.from_local(whole, t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    spec = _flat_spec(plain._spec)
    return plain if spec is plain._spec else FlatDTensor(plain._local_tensor, spec, requires_grad=False)


def flat_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *, shape: torch.Size, stride
) -> DTensor:
    """A ``FlatDTensor`` over ``local`` (a view, no copy) with per-tensor placements
    (also when no axis is ``Flat``: the version counting below applies to every
    DBuffer tensor)."""
    plain = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    flat = FlatDTensor(plain._local_tensor, _flat_spec(plain._spec), requires_grad=plain.requires_grad)
    dtensor_route.verify(flat, FlatDTensor)
    return flat


def _rebuild(local, mesh, placements, shape, stride, requires_grad) -> "FlatDTensor":
    t = flat_dtensor(local, mesh, placements, shape=shape, stride=stride)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _bump_versions(func, args, kwargs) -> None:
    """Advance the version counters of the local tensors ``func`` wrote. DTensor runs
    local ops below the autograd layer that counts writes, so without this an
    optimizer's in-place step would leave them unchanged, and the compute weights
    could not tell that the main weights moved (FsdpParameterGroup._refresh_if_stale)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, DTensor):
                torch.autograd.graph.increment_version(t._local_tensor)


def _flat_axes(inputs) -> dict[int, Flat]:
    """Mesh axis -> the Flat placement of an input on that axis."""
    flats: dict[int, Flat] = {}
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, DTensor):
            for axis, p in enumerate(t.placements):
                if isinstance(p, Flat):
                    flats.setdefault(axis, p)
    return flats


def _refuse_before(func, args, flats: dict[int, Flat]) -> None:
    """Refuse, on every rank alike (the rows are known everywhere), what would fail
    on some ranks only or reshape the rows away."""
    for axis, flat in flats.items():
        if func in _NO_EMPTY and (flat.nested is not None or flat.rows is not None and 0 in flat.rows):
            raise RuntimeError(
                f"{func}: some ranks hold no rows of this tensor ({flat!r} on mesh axis {axis}) and a full "
                "max/min of an empty shard fails there; use p.full_tensor().max() or p.amax()"
            )
        if func in _VIEWS and isinstance(args[0], DTensor) and len(args) > 1:
            shape = list(args[1])
            if not shape or shape[0] != args[0].shape[0]:
                raise RuntimeError(
                    f"{func}: reshaping {tuple(args[0].shape)} -> {tuple(shape)} would move dim-0 rows that are "
                    f"sharded as {flat!r} (the flat buffer's split, not torch.chunk's); take the full tensor "
                    "first (p.full_tensor())"
                )


def _row_split(t: DTensor, axis: int):
    """How ``t``'s dim-0 rows are split over mesh ``axis`` (``None``: not by rows)."""
    p = t.placements[axis]
    if isinstance(p, Flat):
        return p.nested if p.nested is not None else p.rows
    if type(p) is Shard and p.dim == 0 and t.dim() > 0:
        if sum(1 for q in t.placements if isinstance(q, Shard) and q.dim == 0) > 1:
            return ("nested torch.chunk",)
        return tuple(c.size(0) for c in torch.chunk(torch.empty(t.shape[0], 0), t.device_mesh.size(axis)))
    return None


def _paired_tensors(func, args, kwargs) -> list[list[DTensor]]:
    """The DTensors an op combines element by element: all of them, or for a
    ``_foreach`` op the i-th of each list (with any single tensor argument)."""
    values = [*args, *kwargs.values()]
    if not is_foreach(func):
        return [[t for t in tree_flatten(values)[0] if isinstance(t, DTensor)]]
    lists = [v for v in values if isinstance(v, (list, tuple))]
    singles = [v for v in values if isinstance(v, DTensor)]
    length = max((len(v) for v in lists), default=0)
    return [[v[i] for v in lists if i < len(v) and isinstance(v[i], DTensor)] + singles for i in range(length)]


def _refuse_mismatched_rows(func, args, kwargs, flats: dict[int, Flat]) -> None:
    """Element-wise work on tensors whose rows sit on different ranks would pair the
    wrong rows: refuse (e.g. a parameter plus a torch.chunk-sharded DTensor)."""
    for tensors in _paired_tensors(func, args, kwargs):
        if len(tensors) < 2:
            continue
        for axis in flats:
            splits = {}
            for t in tensors:
                if t.device_mesh.ndim > axis:
                    split = _row_split(t, axis)
                    if split is not None:
                        splits.setdefault(split, t)
            if len(splits) > 1:
                described = ", ".join(f"{tuple(t.shape)} {t.placements[axis]!r}" for t in splits.values())
                raise RuntimeError(
                    f"{func}: inputs split their rows differently on mesh axis {axis} ({described}); "
                    "pairing their local rows would be wrong. Bring them to one placement first, e.g. "
                    "x.full_tensor() or x.redistribute(mesh, [Replicate()])"
                )


def _relabel(t, flats: dict[int, Flat], func):
    """``t`` (an op's output) with ``Flat`` where its rows are the input's; refuses
    a plain Shard or an average over a Flat axis otherwise."""
    if not isinstance(t, DTensor):
        return t
    if not flats:
        # Only an alias of the input keeps the subclass (nn.Parameter needs detach() to).
        return FlatDTensor(t._local_tensor, t._spec, requires_grad=t.requires_grad) if func in _ALIASES else t
    placements = list(t.placements)
    for axis, flat in flats.items():
        p = placements[axis]
        if isinstance(p, Flat):
            continue
        same_rows = t.dim() > 0 and (t.shape[0], t._local_tensor.size(0)) == _extent(flat, t, axis)
        if type(p) is Shard and p.dim == 0 and same_rows:
            placements[axis] = flat
            continue
        if isinstance(p, Shard) or (isinstance(p, Partial) and p.reduce_op == "avg"):
            raise RuntimeError(
                f"{func}: the output would be {p!r} on mesh axis {axis}, but the input's rows there follow "
                f"{flat!r} (the flat buffer's split, not torch.chunk's), so its values would be wrong. "
                "Take the full tensor first (p.full_tensor() or p.redistribute(mesh, [Replicate()]))"
            )
    spec = _flat_spec(t._spec, placements)
    if spec is t._spec and type(t) is FlatDTensor:
        return t
    return FlatDTensor(t._local_tensor, spec, requires_grad=t.requires_grad)


def _extent(flat: Flat, t: DTensor, axis: int) -> tuple[int, int]:
    """(rows of the whole tensor, rows on this rank) that ``flat`` describes."""
    if flat.nested is not None:
        return flat.nested.total, flat.nested.local_rows
    return sum(flat.rows), flat.rows[t.device_mesh.get_local_rank(axis)]


def _fill_rows_at_random(func, args, kwargs):
    """``normal_`` / ``uniform_`` (``nn.init``, ``reset_parameters()`` after
    ``fully_shard``) on Flat rows: DTensor fills each rank's rows from its own RNG, so
    with the same seed everywhere every rank drew the same numbers and the weight's
    row blocks came out as copies of each other. Draw the whole tensor instead, as the
    unsharded module would (same RNG stream and consumption), and keep this rank's
    rows (and tensor-parallel piece): equal to the unsharded init when every rank has
    the same RNG state (piece_dtensor.py [Note: random fills of pieces] does the same
    for the main engine)."""
    if init_caller(sys._getframe(1)) == "_no_grad_trunc_normal_":
        raise NotImplementedError(TRUNC_NORMAL_REFUSED)  # its redraw loop reads the whole tensor
    t = args[0]
    offsets = _local_offsets(t)
    if offsets is None:
        raise NotImplementedError(
            f"{func} on a DTensor placed {t.placements}: random fills are drawn whole and split by Flat rows "
            "and tensor-parallel pieces here, and this placement has other splits; fill its full tensor and "
            "distribute it instead"
        )
    local = t._local_tensor
    whole = torch.empty(t.shape, dtype=local.dtype, device=local.device)
    func(whole, *args[1:], **kwargs)
    box = tuple(slice(start, start + size) for start, size in zip(offsets, local.shape))
    with torch.no_grad():
        local.copy_(whole[box])  # advances the version (stale compute weights)
    return t


def _local_offsets(t: DTensor):
    """Where this rank's local tensor starts in the whole tensor, per dim (``None``: a
    split other than Flat rows, a plain ``Shard`` of another dim, and replication)."""
    offsets = [0] * t.dim()
    for axis, p in enumerate(t.placements):
        rank = t.device_mesh.get_local_rank(axis)
        if isinstance(p, Flat):
            if p.nested is not None:
                offsets[0] = p.nested.offset  # the whole tensor's row: every row split at once
            elif p.rows is None:
                return None
            else:
                offsets[0] += sum(p.rows[:rank])
        elif type(p) is Shard and not (p.dim == 0 and any(isinstance(q, Flat) for q in t.placements)):
            # A tensor-parallel piece (torch.chunk's split) of a dim no Flat splits.
            chunk = -(-t.shape[p.dim] // t.device_mesh.size(axis))
            offsets[p.dim] += min(rank * chunk, t.shape[p.dim])
        elif not isinstance(p, Replicate):
            return None
    return offsets


def _exact_mean(args, kwargs, types, base):
    """mean = sum / count: a sum reduces exactly over any row split."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        count, total = x.numel(), _guard(aten.sum.default, types, (x,), {"dtype": dtype}, base)
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        count = math.prod(x.shape[d] for d in dims)
        total = _guard(aten.sum.dim_IntList, types, (x, dims, keepdim), {"dtype": dtype}, base)
    return _guard(aten.div.Scalar, types, (total, count), {}, base)
