"""Copying, pickling, moving or casting a wrapped model raises, with the remedy.

Under DDP ``copy.deepcopy(model.module)`` (an EMA, a frozen teacher) copies a full
replica. A module wrapped by megatron_fsdp holds no full model on any rank: its
parameters are this rank's shards of flat buffers that the whole model shares, and
its hooks run collectives over the model's process groups. A copy could keep neither
(torch failed inside with "invalid python storage"), so ``copy.deepcopy`` and
pickling (``torch.save(model)``) of the wrapper, the wrapped module and its
submodules raise instead. ``state_dict()``, ``get_full_state_dict`` and the checkpoint functions are
the ways to take weights out.

[Note: parameters added after wrapping] The wrapper builds its buffers from the
parameters present at wrapping. A parameter assigned later (``module.out.weight =
nn.Parameter(...)``, ``module.head = nn.Linear(...)``, a parametrization's new
``original``) would be silently ignored (the next forward registered the wrapper's
own weight over it: a re-initialisation that never happened) or trained on this rank
alone (a new submodule: never reduced, never in the optimizer). So, through torch's
global registration hooks, assigning a parameter the wrapper does not own to a
wrapped module, or attaching a submodule that holds one, raises before anything is
assigned. Submodules holding only the wrapper's parameters (an activation-checkpoint
wrapper around a block) attach as before and are guarded too; ``del`` of a parameter
is caught at the next forward (registered_params.py).

Moving or casting it after wrapping (``model.to(device)``, ``.cuda()``, ``.half()``)
would replace tensors that are views of those buffers (torch failed inside with
"Couldn't swap"): such a call raises, naming the remedy, unless it changes nothing
(``model.to(the device it is on)``, as a habit from DDP scripts).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from .owners import is_managed

_MESSAGE = (
    "{what} of a model wrapped by megatron_fsdp is not supported: its parameters are this rank's shards of "
    "flat buffers the whole model shares, and its hooks run collectives, so no rank holds a model to copy "
    "(DDP keeps a full replica). For an EMA or a frozen copy, deep-copy the module before wrapping and load "
    "the full weights into it: ema.load_state_dict({full}) (a collective: call it on every rank). To save "
    "weights use model.state_dict(), {full} or the package's save_checkpoint"
)
_MAIN_FULL = "megatron_fsdp.get_full_state_dict(model)"

_DEEPCOPY, _PICKLE = "copy.deepcopy()", "Pickling (torch.save of the model object)"


def _raise(what: str, full: str = _MAIN_FULL) -> NoReturn:
    raise TypeError(_MESSAGE.format(what=what, full=full))


class RefusesCopies:
    """Mixin for the wrapper module (and the experimental API's sharded modules)."""

    _FULL_WEIGHTS = _MAIN_FULL
    """The call that returns the full weights, named in the message."""

    def __deepcopy__(self, memo: dict) -> NoReturn:
        _raise(_DEEPCOPY, self._FULL_WEIGHTS)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        _raise(_PICKLE, self._FULL_WEIGHTS)


def _refuse_deepcopy(memo: dict) -> NoReturn:
    _raise(_DEEPCOPY)


def _refuse_pickle(protocol: Any) -> NoReturn:
    _raise(_PICKLE)


# Instance attributes take precedence over the class's methods for copy and pickle
# lookups (getattr), which leaves the user's module class untouched.
_GUARDS = {"__deepcopy__": _refuse_deepcopy, "__reduce_ex__": _refuse_pickle}


_MOVE_MESSAGE = (
    "model.to() / .cuda() / .half() / .double() after wrapping with megatron_fsdp would move or cast tensors "
    "that are views of its flat buffers ({name}: {before} -> {after}). Move and cast the module before wrapping "
    "(fully_shard_model(module.to(device, dtype), device=device)); for bf16 compute with fp32 main weights pass "
    "mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32). A call that changes nothing "
    "(model.to(the device it is on)) is allowed"
)


def refuse_moves(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``nn.Module._apply`` for a wrapped model: nothing to do when ``fn`` keeps every
    parameter's and buffer's dtype and device (tried on an empty tensor of each kind),
    else raise."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    for name, tensor in named:
        refuse_move(name, tensor, fn)
    return module


def refuse_move(name: str, tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise when ``fn`` (an ``nn.Module._apply`` conversion) would change ``tensor``'s
    dtype or device; tried on an empty tensor of its kind, so nothing is copied."""
    probe = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    out = fn(probe)
    if out.dtype != tensor.dtype or out.device != tensor.device:
        before, after = f"{tensor.dtype} on {tensor.device}", f"{out.dtype} on {out.device}"
        raise TypeError(_MOVE_MESSAGE.format(name=name, before=before, after=after))


def _refuse_moves_of(module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    return refuse_moves(module, fn)


_WRAPPED_MARK = "_megatron_fsdp_wrapped"
"""Instance attribute of every guarded module (what the registration hooks test)."""

_ADDED_MESSAGE = (
    "{what} on a module wrapped by megatron_fsdp: the wrapper built its sharded buffers from the parameters "
    "present at wrapping, so {these} would not be sharded, reduced or optimized (a new value would be "
    "silently ignored, a new module trained on this rank alone). Nothing was assigned. Make the change before "
    "wrapping; to set new values of an existing parameter, write into it in place (with torch.no_grad(): "
    "model.module.<path>.zero_() / .normal_(...) / .mul_(...)) or load them with model.load_state_dict(...)"
)

_hook_handles: list = []


_OWNERSHIP_TESTS: list[Callable[[torch.Tensor], bool]] = [is_managed]
"""One per engine: whether a parameter is one of that engine's (the experimental
engine adds its own when it shards a module)."""


def _owned(param: torch.Tensor) -> bool:
    return any(test(param) for test in _OWNERSHIP_TESTS)


def _on_parameter_registration(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """[Note: parameters added after wrapping] (torch's global hook, run before assignment)."""
    if module.__dict__.get(_WRAPPED_MARK) and param is not None and not _owned(param):
        raise TypeError(_ADDED_MESSAGE.format(what=f"assigning a new parameter {type(module).__name__}.{name}",
                                              these="its values"))


def _on_module_registration(module: nn.Module, name: str, submodule: nn.Module) -> None:
    """[Note: parameters added after wrapping] (torch's global hook, run before assignment)."""
    if not module.__dict__.get(_WRAPPED_MARK) or submodule is None:
        return
    new = [n for n, p in submodule.named_parameters() if not _owned(p)]
    if new:
        raise TypeError(_ADDED_MESSAGE.format(
            what=f"attaching {type(submodule).__name__} with parameters of its own ({', '.join(new[:4])}) as "
                 f"{type(module).__name__}.{name}",
            these="they"))
    # Part of the wrapped tree from now on, guarded as its new parent is.
    if "_apply" in module.__dict__:  # the main engine's guards (guard_module)
        guard_module(submodule)
    else:
        refuse_new_parameters(submodule)


def _install_registration_hooks() -> None:
    if not _hook_handles:
        _hook_handles.append(nn_module.register_module_parameter_registration_hook(_on_parameter_registration))
        _hook_handles.append(nn_module.register_module_module_registration_hook(_on_module_registration))


def refuse_new_parameters(module: nn.Module, owns: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
    """``module`` and its submodules refuse parameters no engine owns ([Note: parameters
    added after wrapping]); ``owns``: the calling engine's ownership test, if not the
    main engine's."""
    if owns is not None and owns not in _OWNERSHIP_TESTS:
        _OWNERSHIP_TESTS.append(owns)
    _install_registration_hooks()
    for sub in module.modules():
        sub.__dict__[_WRAPPED_MARK] = True


def guard_module(module: nn.Module) -> None:
    """The wrapped module and its submodules (whose parameters are shards too) refuse
    copies, moves or casts that change anything, and parameters the wrapper does not
    own, while wrapped."""
    refuse_new_parameters(module)
    for sub in module.modules():
        sub.__dict__.update(_GUARDS, _apply=functools.partial(_refuse_moves_of, sub))


def release_module(module: nn.Module) -> None:
    """Unwrapped again (``unshard_module``): copies, moves and new parameters work as for any module."""
    for sub in module.modules():
        for name in (*_GUARDS, "_apply", _WRAPPED_MARK):
            sub.__dict__.pop(name, None)
