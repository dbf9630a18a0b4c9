"""``PieceDTensor``: the DTensor type of the main engine's sharded parameters,
gradients and optimizer states.

[Note: flat pieces] A sharded parameter's local tensor is this rank's 1-D piece of
its group's flat buffer: possibly uneven, empty, or starting mid-row. It is
labelled ``Shard(0)`` because elementwise math, full reductions and the optimizers
only ever touch local data (a norm or a sum reduces over the mesh, whatever the
split), but DTensor assumes ``torch.chunk``'s rows wherever it moves or reshapes
data: ``full_tensor()`` returned a (15,) tensor for a (7, 15) weight, ``mean()``
averaged uneven local means, a view reinterpreted the piece. So around each op:

* allowed as DTensor computes them (exact on any split): pointwise ops, the
  ``_foreach`` ops (GradScaler's unscale included), copies and casts, ``*_like`` creation, full ``sum`` and norms;
  outputs shaped and placed like a piece input stay ``PieceDTensor``s (so clones
  and optimizer states keep these rules);
* ``mean()`` of the whole tensor is computed as sum / count (exact);
* everything else (views, per-dimension reductions, matmuls, indexing, a full
  ``max``/``min`` that an empty piece cannot take) and ``full_tensor()`` /
  ``redistribute`` raise ``NotImplementedError`` with the remedy. The decision
  depends only on the op and the placements, so every rank raises alike and no
  rank is left waiting in a collective;
* a value reduced from a piece (a norm, a sum: ``Partial`` over the mesh) stays a
  ``PieceDTensor``: every op and ``full_tensor()`` work on it as on any DTensor,
  but reading it on the host (``.item()``, ``float()``) raises, naming
  ``.full_tensor()``, where plain DTensor would return this rank's part.

Full weights come from ``megatron_fsdp.get_full_state_dict(model)`` or
``model.state_dict()`` (standard torch.chunk DTensors). The experimental engine's
``FlatDTensor`` (row-aligned pieces) makes its redistributions exact instead.
"""

from __future__ import annotations

import enum
import math
import sys

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from . import dtensor_dispatch as dtensor_route

__all__ = ["AUTOGRAD_INPUTS_MESSAGE", "EXTREME_NORMS", "FLAT_START_ATTR", "PieceDTensor", "RANDOM_FILLS", "TP_CUT_ATTR",
           "TRUNC_NORMAL_REFUSED", "init_caller", "is_flat_piece", "piece_dtensor", "stand_in_for_empty_locals"]

aten = torch.ops.aten
_MEAN = {aten.mean.default}
_FULL_REDUCTIONS = {aten.sum.default, aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dtype}
_ALLOWED = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.copy_.default, aten._to_copy.default,
    aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
    aten.is_same_size.default, aten._local_scalar_dense.default, aten.equal.default,
}

_REMEDY = (
    "megatron_fsdp's sharded parameters (and their gradients and optimizer states) hold this rank's flat "
    "piece of a buffer, not torch.chunk's rows, so DTensor would get {what} wrong. Elementwise math, "
    "full sums and norms, clip_grad_norm_ and optimizers are exact; for full values use "
    "megatron_fsdp.get_full_state_dict(model) or model.state_dict() (standard DTensors)"
)


class _Kind(enum.Enum):
    ALLOWED = enum.auto()
    FOREACH = enum.auto()
    REDUCTION = enum.auto()
    """Allowed when it reduces over every dimension."""
    REFUSED = enum.auto()


_KINDS: dict = {}
"""op -> _Kind, decided once per op (the hot path of every optimizer step)."""


def is_foreach(func) -> bool:
    """A per-tensor op over lists of tensors: the ``_foreach`` ops, and GradScaler.unscale_'s
    ``_amp_foreach_non_finite_check_and_unscale_``, which is elementwise plus a max over
    every element: DTensor runs it on the local pieces and reduces ``found_inf`` over
    the mesh (a collective every rank joins, as unscale_ runs on every rank), so a
    non-finite value on one rank skips the step on all of them. Shared with the
    experimental engine's FlatDTensor."""
    return func._schema.name.startswith(("aten::_foreach", "aten::_amp_foreach"))


def _classify(func) -> _Kind:
    if is_foreach(func):
        return _Kind.FOREACH
    if func in _ALLOWED or torch.Tag.pointwise in func.tags:
        return _Kind.ALLOWED
    if func in _FULL_REDUCTIONS:
        return _Kind.REDUCTION
    return _Kind.REFUSED


# [Note: random fills of pieces] ``nn.init.normal_`` / ``uniform_`` (and the inits built
# on them: xavier, kaiming) on a sharded parameter after wrapping (a
# model built on the meta device and initialised after ``fully_shard``, as FSDP2 users
# do, or HF's ``_init_weights`` applied late) would draw only the piece's numbers, so
# the weights would differ from the same init of the unwrapped model. Instead the op
# draws the whole parameter, as the unwrapped model would (same RNG stream and
# consumption), and keeps this rank's piece: with the same RNG state on every rank
# (``torch.manual_seed`` on each), every rank draws the same tensor and the weights
# equal the unwrapped init bit for bit. The piece's offset in the parameter's flat
# order is set on the distributed parameter (``FLAT_START_ATTR``) and follows it
# through ``.data`` / ``detach()``; a piece without it (a gradient, an optimizer
# state) is refused. The temporary is one parameter's full size (init time only), in the
# main weights' dtype. ``trunc_normal_`` (drawn by rejection over the whole tensor on
# recent torch) and ``orthogonal_`` (a QR of the whole matrix) are refused before writing.
RANDOM_FILLS = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
    aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
    aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
}
FLAT_START_ATTR = "_megatron_fsdp_flat_start"
TP_CUT_ATTR = "_megatron_fsdp_tp_cut"
"""On a tensor-parallel distributed parameter: ``(dim, tp size, tp rank)``, the cut of
the whole parameter whose flat order ``FLAT_START_ATTR`` counts in (its TP piece)."""
_ALIASES = {aten.detach.default, aten.alias.default}

_RANDOM_FILL_REFUSED = (
    "{func} on a sharded tensor that is not a distributed parameter (a gradient or an optimizer "
    "state: this rank's flat piece, with no place in a whole tensor to draw from) is refused; "
    "initialise parameters through model.parameters() (their random fills equal the unwrapped "
    "model's), or fill the tensor elementwise (zero_(), fill_(), mul_())"
)


TRUNC_NORMAL_REFUSED = (
    "torch.nn.init.trunc_normal_ on a sharded parameter after wrapping is refused (nothing was "
    "written): torch draws it by rejection, redrawing until every element of the whole tensor is in "
    "range, a loop over values no rank holds. Fix: initialise before wrapping, or build on the meta "
    "device and initialise through the modules' reset_parameters() (init_model_with_meta_device=True "
    "for fully_shard), equal to an eager build, or use nn.init.normal_ followed by clamp_ (both exact "
    "here)"
)


_INIT_REFUSED = (
    "torch.nn.init.{name} on a sharded parameter after wrapping is refused: it needs {func} over the "
    "whole tensor, which no rank holds. Fix: initialise before wrapping, or build "
    "on the meta device with init_model_with_meta_device=True (each module's reset_parameters() then "
    "writes the shards, equal to an eager build); normal_, uniform_, xavier_*, kaiming_* and constant "
    "fills work after wrapping"
)


def init_caller(frame, depth: int = 12) -> str | None:
    """The torch.nn.init function among the ``depth`` nearest callers, if any."""
    while frame is not None and depth > 0:
        if frame.f_globals.get("__name__") == "torch.nn.init":
            return frame.f_code.co_name
        frame, depth = frame.f_back, depth - 1
    return None


def _fill_piece_at_random(func, args, kwargs):
    """[Note: random fills of pieces]."""
    piece = args[0]
    start = getattr(piece, FLAT_START_ATTR, None)
    if start is None:
        raise NotImplementedError(_RANDOM_FILL_REFUSED.format(func=func))
    if init_caller(sys._getframe(1)) == "_no_grad_trunc_normal_":
        raise NotImplementedError(TRUNC_NORMAL_REFUSED)
    local = piece._local_tensor
    whole = torch.empty(piece.shape, dtype=local.dtype, device=local.device)
    func(whole, *args[1:], **kwargs)
    cut = getattr(piece, TP_CUT_ATTR, None)
    if cut is not None:  # the tensor-parallel piece the flat order counts in
        dim, size, rank = cut
        whole = torch.chunk(whole, size, dim=dim)[rank].contiguous()
    with torch.no_grad():
        local.copy_(whole.reshape(-1)[start:start + local.numel()].view_as(local))
    return piece


def _is_full_reduction(func, args, kwargs) -> bool:
    dims = kwargs.get("dim", args[2] if func is aten.linalg_vector_norm.default and len(args) > 2 else None)
    return dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0)


EXTREME_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar}


def stand_in_for_empty_locals(func, args, kwargs, cls: type):
    """An inf (-inf) norm is a max (min) of absolute values, which an empty local tensor
    (a rank holding no element of a parameter) cannot take: torch raises "cannot compute
    the inf norm on an empty tensor" where the other norms sum to 0. Such a ``cls``
    instance (of a non-empty tensor) takes part as one element holding the identity of
    that max (0: absolute values are never below it) or min (+inf), so
    ``clip_grad_norm_(..., norm_type=inf)`` is exact on every split. The decision
    depends only on shapes, the same on every rank. Shared with the experimental
    engine's FlatDTensor."""
    order = kwargs.get("ord", args[1] if len(args) > 1 else 2)
    if order not in (math.inf, -math.inf):
        return args, kwargs
    fill = 0.0 if order > 0 else math.inf

    def stand_in(t):
        if not (isinstance(t, cls) and t._local_tensor.numel() == 0 and t.numel() > 0):
            return t
        local = torch.full((1,), fill, dtype=t._local_tensor.dtype, device=t._local_tensor.device)
        return cls(local, t._spec, requires_grad=False)

    first = args[0]
    first = [stand_in(t) for t in first] if isinstance(first, (list, tuple)) else stand_in(first)
    return (first, *args[1:]), kwargs


def _guard(func, types, args, kwargs, base):
    """The aten-level guard ([Note: flat pieces]); ``base`` computes an op as plain
    DTensor does ([Note: DTensor subclass routes])."""
    if not _any_sharded(args, kwargs):
        # Only values reduced from pieces (a norm, a sum): DTensor is exact on
        # them, but a Partial one read on the host is this rank's part alone.
        if func is aten._local_scalar_dense.default and _partial(args[0]):
            raise NotImplementedError(_PARTIAL_READ)
        return _keep_partial_guarded(_rewrap_outputs(base(func, types, args, kwargs), func, args, kwargs))
    if func in _MEAN:
        total = _guard(aten.sum.default, types, (args[0],), {"dtype": kwargs.get("dtype")}, base)
        return _guard(aten.div.Scalar, types, (total, args[0].numel()), {}, base)
    if func in EXTREME_NORMS:
        args, kwargs = stand_in_for_empty_locals(func, args, kwargs, PieceDTensor)
    if func in RANDOM_FILLS:
        return _fill_piece_at_random(func, args, kwargs)
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = _classify(func)
    if kind is _Kind.REDUCTION and not _is_full_reduction(func, args, kwargs):
        kind = _Kind.REFUSED
    if kind is _Kind.REFUSED:
        init = init_caller(sys._getframe(1))
        if init is not None:  # orthogonal_, sparse_, eye_, dirac_: say which init and what to do
            raise NotImplementedError(_INIT_REFUSED.format(name=init.removeprefix("_no_grad_"), func=func))
        raise NotImplementedError(f"{func}: " + _REMEDY.format(what="it"))
    out = base(func, types, args, kwargs)
    if kind is _Kind.REDUCTION and type(out) is DTensor:
        # Keep the guard on the reduced value: reading it (.item()) must not give
        # this rank's partial sum silently.
        return PieceDTensor(out._local_tensor, out._spec, requires_grad=out.requires_grad)
    return _rewrap_outputs(out, func, args, kwargs)


# [Note: autograd to distributed parameters] The forward computes with the compute
# parameters (gathered copies), so the distributed ones (model.parameters() between
# steps) are not in the autograd graph: loss.backward(inputs=those) computed nothing and
# trained nothing, silently, and torch.autograd.grad(loss, those) failed with torch's
# "not used in the graph". Both reach this type's __torch_function__ (the no_shard
# strategy's replicated parameters are PieceDTensors too) and are refused.
AUTOGRAD_INPUTS_MESSAGE = (
    "torch.autograd.backward(inputs=...) / torch.autograd.grad(..., inputs) with megatron_fsdp's parameters: "
    "the forward computes with gathered copies of them, so autograd would return no gradient (and backward "
    "with inputs= would train nothing). Call loss.backward() (freeze what must not train with "
    "requires_grad_(False)) and read p.grad after it; gradients with respect to activations or inputs "
    "(torch.autograd.grad(out, x)) work as usual. No gradient or weight has changed"
)


class PieceDTensor(DTensor):
    """A DTensor over a flat piece, or a value reduced from one ([Note: flat pieces]);
    also the replicated parameters of ``no_shard`` groups, on which every op is
    DTensor's own (nothing is sharded) but the autograd entry points are refused
    ([Note: autograd to distributed parameters])."""

    if dtensor_route.ROUTE is dtensor_route.DispatchRoute.TORCH_DISPATCH:
        __torch_dispatch__ = dtensor_route.torch_dispatch_route(_guard)
        __torch_function__ = dtensor_route.autograd_refusal(AUTOGRAD_INPUTS_MESSAGE)
    else:
        __torch_function__ = dtensor_route.torch_function_route(_guard, AUTOGRAD_INPUTS_MESSAGE)

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kwargs):  # type: ignore[override]
        if not _sharded(self):  # a reduced value: DTensor's redistribution is exact
            return super().redistribute(device_mesh, placements, async_op=async_op, **kwargs)
        if (device_mesh is None or device_mesh == self.device_mesh) and (
            placements is None or tuple(placements) == tuple(self.placements)
        ):
            return self
        raise NotImplementedError(f"redistribute to {placements}: " + _REMEDY.format(what="the rows"))

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        if not _sharded(self):
            return super().full_tensor(grad_placements=grad_placements)
        raise NotImplementedError("full_tensor(): " + _REMEDY.format(what="the full tensor"))

    def to_local(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        if _sharded(self) and _writes_chunk_rows(sys._getframe(1)):
            raise NotImplementedError(_BROADCAST_FROM_RANK0)
        return super().to_local(grad_placements=grad_placements)


# [Note: broadcast_from_rank0] torch.distributed.checkpoint.state_dict's
# ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
# broadcast_from_rank0=True))`` broadcasts each full tensor from rank 0 and then, in
# ``_distribute_tensors``, copies its torch.chunk rows into ``param.to_local()`` of
# every DTensor parameter it walked to, before the model's ``load_state_dict`` sees
# anything. For a flat piece that copy is a size mismatch, or, where the sizes happen
# to agree (a 1-D weight, a one-element chunk broadcast over the piece), a silently
# wrong value: a LayerNorm walked before the first matrix came out corrupted and
# the load then failed. No hook of the module runs in between, so the piece
# recognises that caller and refuses before the first write, on every rank alike
# (each rank walks the same keys). The experimental engine's row-aligned
# FlatDTensor takes this path exactly.
_BROADCAST_FROM_RANK0 = (
    "torch.distributed.checkpoint.state_dict with broadcast_from_rank0=True would copy torch.chunk rows into "
    "megatron_fsdp's sharded parameters, which hold this rank's flat piece of a buffer (a wrong value or a "
    "size mismatch), so it is refused; no sharded parameter was loaded. Fix: give every rank the full state "
    "dict and load it with StateDictOptions(full_state_dict=True) without broadcast_from_rank0 "
    "(torch.load(path, mmap=True, weights_only=True) keeps host memory low), or call "
    "model.load_state_dict(full_state_dict) on every rank"
)


def _writes_chunk_rows(frame) -> bool:
    """The caller is DSD's ``_distribute_tensors`` ([Note: broadcast_from_rank0])."""
    return frame.f_code.co_name == "_distribute_tensors" and frame.f_globals.get("__name__") == (
        "torch.distributed._state_dict_utils"
    )


_PARTIAL_READ = (
    "reading a partial value on the host: a norm or sum of megatron_fsdp's sharded parameters (or their "
    "gradients) holds this rank's part until it is reduced over the ranks; call .full_tensor() on it first "
    "(a collective: on every rank), e.g. p.norm().full_tensor().item()"
)


def _sharded(t: DTensor) -> bool:
    return any(isinstance(p, Shard) for p in t.placements)


def is_flat_piece(t) -> bool:
    """A ``PieceDTensor`` holding a sharded flat piece (not a replicated whole)."""
    return isinstance(t, PieceDTensor) and _sharded(t)


def _partial(t) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements)


def _any_sharded(args, kwargs) -> bool:
    def visit(value) -> bool:
        if isinstance(value, PieceDTensor):
            return _sharded(value)
        if isinstance(value, (list, tuple)):
            return any(visit(item) for item in value)
        return False

    return any(visit(v) for v in args) or any(visit(v) for v in kwargs.values())


def _rewrap_outputs(out, func, args, kwargs):
    if out is None or (isinstance(out, (list, tuple)) and not out):
        return out  # in-place _foreach ops
    if is_foreach(func) and isinstance(out, (list, tuple)) and args \
            and isinstance(args[0], (list, tuple)):
        # The i-th output comes from the i-th tensor of the first list.
        return type(out)(_rewrap_like(o, a) for o, a in zip(out, args[0]))
    if args and isinstance(args[0], PieceDTensor) and isinstance(out, DTensor):
        out = _rewrap_like(out, args[0])  # the common case: a method on a piece
        if func in _ALIASES:  # ``param.data``
            for attr in (FLAT_START_ATTR, TP_CUT_ATTR):
                if hasattr(args[0], attr):
                    setattr(out, attr, getattr(args[0], attr))
        return out
    return _rewrap(out, _piece_specs(args, kwargs))


def piece_dtensor(local: torch.Tensor, mesh, placements, *, shape: torch.Size, stride) -> PieceDTensor:
    """A ``PieceDTensor`` over ``local`` (a view, no copy)."""
    plain = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    piece = PieceDTensor(plain._local_tensor, plain._spec, requires_grad=plain.requires_grad)
    dtensor_route.verify(piece, PieceDTensor)
    return piece


def _piece_specs(args, kwargs) -> set:
    specs = set()

    def visit(value):
        if isinstance(value, PieceDTensor):
            specs.add((tuple(value.shape), value.placements, value._local_tensor.numel()))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for value in (*args, *kwargs.values()):
        visit(value)
    return specs


def _keep_partial_guarded(out):
    """A value computed from reduced pieces that is still ``Partial`` (``torch.stack`` of
    per-parameter inf norms: clip_grad_norm_'s total) stays a ``PieceDTensor``, so reading
    it on the host raises instead of returning this rank's part (the 2-norm's total
    DTensor makes ``Replicate`` itself)."""
    if isinstance(out, (list, tuple)):
        return type(out)(_keep_partial_guarded(o) for o in out)
    if type(out) is DTensor and _partial(out):
        return PieceDTensor(out._local_tensor, out._spec, requires_grad=out.requires_grad)
    return out


def _rewrap_like(out, like):
    if (
        isinstance(like, PieceDTensor)
        and type(out) is DTensor
        and out.shape == like.shape
        and out.placements == like.placements
        and out._local_tensor.numel() == like._local_tensor.numel()
    ):
        return PieceDTensor(out._local_tensor, out._spec, requires_grad=out.requires_grad)
    return out


def _rewrap(out, specs: set):
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, specs) for o in out)
    if (
        isinstance(out, DTensor)
        and not isinstance(out, PieceDTensor)
        and (tuple(out.shape), out.placements, out._local_tensor.numel()) in specs
    ):
        return PieceDTensor(out._local_tensor, out._spec, requires_grad=out.requires_grad)
    return out
