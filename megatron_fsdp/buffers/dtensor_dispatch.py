"""How this package's DTensor subclasses see each op, on every torch.

[Note: DTensor subclass routes] ``PieceDTensor`` (the main engine) and
``FlatDTensor`` (the experimental API) guard the ops DTensor would get wrong on
their flat pieces: they refuse some, compute ``mean`` exactly, and keep their type
on outputs (``nn.Parameter`` needs ``detach()`` to keep it). The guard is an aten-level
function ``guard(func, types, args, kwargs, base)``, where ``base`` computes the op
as plain DTensor would. Two routes reach it:

* ``TORCH_DISPATCH``: the subclass's own ``__torch_dispatch__``, with ``base`` being
  DTensor's (which unwraps the subclass and re-enters DTensor's C++ fast path);
* ``TORCH_FUNCTION``: torch 2.10 and 2.11 hand every DTensor instance, subclasses
  included, to DTensor's C++ fast path and never call a subclass's
  ``__torch_dispatch__`` (pytorch/pytorch#177716, fixed for 2.12). There the
  subclass's ``__torch_function__`` runs each Python-level call under a dispatch
  mode that hands every aten op touching the subclass to the same guard, with
  ``base`` the op itself (the fast path computes it; the guard relabels the plain
  DTensor outputs). Ops torch issues below the Python API (autograd accumulating
  into a leaf) skip the guard on this route; the engines never let autograd reach
  these tensors.

``MFSDP_DTENSOR_ROUTE=torch_function`` forces the second route on any torch, so the
suite checks it where the affected torch is not installed.
"""

from __future__ import annotations

import enum
import os
import re
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AUTOGRAD_ENTRY_POINTS", "DispatchRoute", "ROUTE", "autograd_refusal", "route_for", "torch_dispatch_route",
           "torch_function_route", "verify"]

Guard = Callable  # (func, types, args, kwargs, base) -> outputs


class DispatchRoute(enum.Enum):
    TORCH_DISPATCH = "torch_dispatch"
    TORCH_FUNCTION = "torch_function"


_ENV = "MFSDP_DTENSOR_ROUTE"


def route_for(version: str, override: str | None = None) -> DispatchRoute:
    """The route for a torch version string (``"2.11.0+cu130"``); ``override`` is
    the environment's choice, if any."""
    if override:
        try:
            return DispatchRoute(override)
        except ValueError:
            choices = ", ".join(r.value for r in DispatchRoute)
            raise ValueError(f"{_ENV}={override!r}: expected one of {choices} (or unset for the torch default)") from None
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return DispatchRoute.TORCH_DISPATCH
    major_minor = (int(match.group(1)), int(match.group(2)))
    return DispatchRoute.TORCH_FUNCTION if (2, 10) <= major_minor < (2, 12) else DispatchRoute.TORCH_DISPATCH


ROUTE = route_for(torch.__version__, os.environ.get(_ENV))


def _dtensor_base(func, types, args, kwargs):
    return DTensor.__torch_dispatch__(func, types, args, kwargs)


def _op_itself(func, types, args, kwargs):
    return func(*args, **kwargs)


def torch_dispatch_route(guard: Guard):
    """The subclass's ``__torch_dispatch__`` (the ``TORCH_DISPATCH`` route)."""

    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return guard(func, types, args, kwargs or {}, _dtensor_base)

    return classmethod(__torch_dispatch__)


class _GuardMode(TorchDispatchMode):
    """Hands the aten ops of one Python-level call that touch ``cls`` to its guard."""

    def __init__(self, cls: type, guard: Guard):
        super().__init__()
        self.cls, self.guard = cls, guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(isinstance(t, self.cls) for t in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        return self.guard(func, types, args, kwargs, _op_itself)


_verified: set = set()


def verify(value: DTensor, cls: type) -> None:
    """Once per subclass, on its first instance: its ops reach the guard on this torch
    (an alias keeps the subclass). A torch that bypasses the route chosen for its
    version would otherwise run every op unguarded, so this refuses at wrap time."""
    if cls in _verified:
        return
    if type(value.detach()) is not cls:
        raise RuntimeError(
            f"torch {torch.__version__} does not route {cls.__name__}'s ops through {ROUTE.value} "
            f"([Note: DTensor subclass routes] in megatron_fsdp/buffers/dtensor_dispatch.py): its guards against wrong "
            f"DTensor results could not run. Set {_ENV}=torch_function (or torch_dispatch) to take the other "
            f"route, and please report this torch version"
        )
    _verified.add(cls)


AUTOGRAD_ENTRY_POINTS = (torch.autograd.backward, torch.autograd.grad)
"""``loss.backward(inputs=...)`` and ``torch.autograd.grad(..., inputs)`` reach a
subclass's ``__torch_function__`` when an input is one of its instances."""


def autograd_refusal(message: str):
    """A ``__torch_function__`` for the ``TORCH_DISPATCH`` route that refuses the autograd
    entry points with ``message`` and leaves every other call as DTensor has it (torch
    function disabled: the op goes on to ``__torch_dispatch__``)."""

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in AUTOGRAD_ENTRY_POINTS:
            raise RuntimeError(message)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    return classmethod(__torch_function__)


_COMPUTED_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
"""Tensor properties whose read runs an op making a new tensor: unguarded, the fast path
made them plain DTensors over the piece (``p.data.view(-1)`` reinterpreted it, ``p.T``
permuted a 1-D piece), so they are read under the guard like any call."""


def _property_name(getter) -> str | None:
    """``"data"`` for ``Tensor.data.__get__`` (its descriptor's name)."""
    return getattr(getattr(getter, "__self__", None), "__name__", None)


def torch_function_route(guard: Guard, autograd_message: str | None = None):
    """The subclass's ``__torch_function__`` (the ``TORCH_FUNCTION`` route);
    ``autograd_message``: refuse the autograd entry points with it."""

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if autograd_message is not None and func in AUTOGRAD_ENTRY_POINTS:
            raise RuntimeError(autograd_message)
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", None) == "__get__" and _property_name(func) not in _COMPUTED_PROPERTIES:
                return func(*args, **kwargs)  # a property read (.grad, .shape): no op to guard
            with _GuardMode(cls, guard):
                return func(*args, **kwargs)

    return classmethod(__torch_function__)
