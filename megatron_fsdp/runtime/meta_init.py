"""Meta-device initialisation: materialise a model built under ``torch.device("meta")``
one module at a time, straight into the (sharded) buffers.

Modules are visited in registration order, which is their construction order, and
each runs its own ``reset_parameters()``: the random stream is consumed exactly as
an eager build would, so the same seed gives the same weights. A weight tied to an
earlier module (an output head sharing the embedding) is re-initialised by its
second owner as in an eager build, then restored, since tying discards that value.

Parameter objects keep their identity (``torch.utils.swap_tensors``), so hooks,
``fsdp_no_shard`` marks and attributes such as Megatron's ``tensor_model_parallel``
survive. At most one module's full parameters exist at a time.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..param_marks import pop_marks, restore_marks
from ..buffers.param_and_grad_buffer import ParamAndGradBuffer
from ..buffers.tensor_parallel import TPKind
from .init_sync import sync_materialized

logger = logging.getLogger(__name__)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _init_shape(param: nn.Parameter, buffer: ParamAndGradBuffer) -> torch.Size:
    """[Note: meta init of tensor-parallel parameters] A parameter of a PyTorch TP plan
    is initialised whole, as the unwrapped model would draw it (``nn.Linear`` takes
    its bound from the whole fan-in, not the TP piece's), and each rank keeps its TP
    piece: with the same seed on every rank the weights equal the unwrapped model's.
    Megatron-core's layers initialise their own pieces, as megatron-core does."""
    spec = buffer.tp_spec(param)
    return spec.global_shape if spec is not None and spec.kind is TPKind.DTENSOR else param.shape


def _tp_piece(param: nn.Parameter, buffer: ParamAndGradBuffer) -> torch.Tensor:
    """What the buffers keep of a materialised parameter: its TP piece if it was drawn whole."""
    spec = buffer.tp_spec(param)
    if spec is not None and spec.kind is TPKind.DTENSOR:
        return spec.local_of(param.detach())
    return param.detach()


def _materialize_in_place(param: nn.Parameter, device: torch.device, shape: torch.Size) -> None:
    attributes = dict(param.__dict__)
    marked = pop_marks(param)
    real = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
    param.__dict__.update(attributes)
    restore_marks(param, marked)


def _resets_buffers(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_buffers", None))


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def _has_private_reset(module: nn.Module) -> bool:
    """PyTorch's attention / transformer modules initialise through a private
    ``_reset_parameters()`` that runs after their children were built."""
    return not _has_reset(module) and callable(getattr(module, "_reset_parameters", None))


def _eager_resets(module: nn.Module) -> list:
    """The initialisers of ``module``'s subtree in eager construction order: a
    module's own ``reset_parameters()`` / ``reset_buffers()`` before its children's
    (they run at the end of its ``__init__``; children built after it run later), a
    ``_reset_parameters()`` after them (``nn.MultiheadAttention`` builds
    ``out_proj``, then resets)."""
    children = [call for child in module.children() for call in _eager_resets(child)]
    own = [getattr(module, m) for m in ("reset_parameters", "reset_buffers") if callable(getattr(module, m, None))]
    if _has_private_reset(module):
        return own + children + [module._reset_parameters]
    return own + children


def _check_buffers_written(name: str, module: nn.Module, fresh: dict) -> None:
    """A materialised buffer starts as uninitialised memory (on CUDA, stale bytes from
    the caching allocator): the module's own init must write or replace it. An
    untouched tensor keeps its version counter."""
    for n, (tensor, version) in fresh.items():
        if module._buffers.get(n) is tensor and tensor._version == version:
            where = f"{name}.{n}" if name else n
            raise ValueError(
                f"buffer {where!r} of {type(module).__name__} was built on the meta device and neither "
                "reset_parameters() nor reset_buffers() initialised it, so it would hold uninitialised memory; "
                f"give {type(module).__name__} a reset_buffers() (or have reset_parameters() write it), "
                "or build the module on a real device"
            )


@torch.no_grad()
def materialize_meta_module(module: nn.Module, buffer: ParamAndGradBuffer, device: torch.device) -> int:
    """Materialise every meta parameter/buffer of ``module``; returns the peak bytes
    of full parameter values alive at once (one module's worth; a whole subtree for
    a module initialised by ``_reset_parameters()``)."""
    accounting = buffer.accounting
    peak_before, accounting.peak_temporary = accounting.peak_temporary, accounting.temporary
    handled: set[int] = set()
    materialized: set[int] = set()  # parameters given storage by this call
    for name, sub in module.named_modules():
        if id(sub) in handled:
            continue
        if _has_private_reset(sub) and has_meta_tensors(sub):
            # The whole subtree at once: _reset_parameters() may write its
            # children's parameters (MultiheadAttention zeroes out_proj.bias).
            members = dict(sub.named_modules(prefix=name))
            handled.update(id(m) for m in members.values())
            materialized.update(id(p) for m in members.values() for p in m.parameters(recurse=False))
            _materialize_block(members, _eager_resets(sub), buffer, device, accounting)
            continue
        own = [p for _, p in sub.named_parameters(recurse=False)]
        meta_params = [p for p in own if p.device.type == "meta"]
        meta_buffers = [n for n, b in sub.named_buffers(recurse=False) if b.device.type == "meta"]
        # A module whose weights are all tied to earlier ones (an output head sharing the
        # embedding) still runs its init: an eager build draws those numbers too, and the
        # modules built after it (multi-token prediction layers) must draw what follows.
        tied = [p for p in own if id(p) in materialized]
        materialized.update(id(p) for p in meta_params)
        if not meta_params and not meta_buffers and not (tied and _has_reset(sub)):
            continue
        if not _has_reset(sub) and (meta_params or not _resets_buffers(sub)):
            raise ValueError(
                f"module {name or '<root>'!r} ({type(sub).__name__}) has tensors on the meta device but neither "
                "reset_parameters() nor _reset_parameters(); implement reset_parameters() for it, or build it "
                "on a real device"
            )
        resets = [getattr(sub, m) for m in ("reset_parameters", "reset_buffers") if callable(getattr(sub, m, None))]
        _materialize_block({name: sub}, resets, buffer, device, accounting)
    peak = accounting.peak_temporary
    accounting.peak_temporary = max(peak_before, peak)
    if has_meta_tensors(module):
        left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.device.type == "meta"]
        raise ValueError(f"meta-device tensors were not materialised: {left}; give their modules reset_parameters()")
    return peak


def _materialize_block(members: dict[str, nn.Module], resets: list, buffer: ParamAndGradBuffer, device, accounting) -> None:
    """Give ``members``' own tensors real storage, run ``resets``, check every
    materialised buffer was written, store the new parameter values into the
    buffers and point the parameters back into them."""
    own = list(dict.fromkeys(p for m in members.values() for p in m.parameters(recurse=False)))
    meta_params = [p for p in own if p.device.type == "meta"]
    # Parameters already materialised (a weight tied to an earlier module) get
    # scratch storage: the resets write them as an eager build would, and the
    # value in the buffers, the one an eager build keeps, stays.
    earlier = [p for p in own if p.device.type != "meta" and p in buffer.param_names]
    for p in earlier:
        p.data = torch.empty(_init_shape(p, buffer), dtype=p.dtype, device=device)
    for p in meta_params:
        _materialize_in_place(p, device, _init_shape(p, buffer))
    fresh = {}
    for name, m in members.items():
        meta_buffers = [n for n, b in m._buffers.items() if b is not None and b.device.type == "meta"]
        for n in meta_buffers:
            m._buffers[n] = torch.empty_like(m._buffers[n], device=device)
        fresh[name] = (m, {n: (m._buffers[n], m._buffers[n]._version) for n in meta_buffers})
    scratch = _nbytes(meta_params + earlier)
    accounting.on_alloc(scratch)
    for reset in resets:
        reset()
    for name, (m, written) in fresh.items():
        _check_buffers_written(name, m, written)
    # [Note: initial state from data-parallel rank 0] in init_sync.py: before the values are stored.
    # A reset may have replaced a buffer: sync the tensor registered now.
    new_buffers = [(m, m._buffers[n]) for m, written in fresh.values() for n in written if m._buffers.get(n) is not None]
    sync_materialized(meta_params, new_buffers, buffer.dist_index)
    for p in meta_params:
        group, index = buffer.slot(p)
        buffer.store_param_value(group, index, _tp_piece(p, buffer))
    for p in meta_params + earlier:
        buffer.repoint(*buffer.slot(p))
    accounting.on_free(scratch)
