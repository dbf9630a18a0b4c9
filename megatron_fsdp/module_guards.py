"""Copying, pickling, moving or casting a wrapped model raises, with the remedy.

Under DDP ``copy.deepcopy(model.module)`` (an EMA, a frozen teacher) copies a full
replica. A module wrapped by megatron_fsdp holds no full model on any rank: its
parameters are this rank's shards of flat buffers that the whole model shares, and
its hooks run collectives over the model's process groups. A copy could keep neither
(torch failed inside with "invalid python storage"), so ``copy.deepcopy`` and
pickling (``torch.save(model)``) of the wrapper, the wrapped module and its
submodules raise instead. ``state_dict()``, ``get_full_state_dict`` and the checkpoint functions are
the ways to take weights out.

Moving or casting it after wrapping (``model.to(device)``, ``.cuda()``, ``.half()``)
would replace tensors that are views of those buffers (torch failed inside with
"Couldn't swap"): such a call raises, naming the remedy, unless it changes nothing
(``model.to(the device it is on)``, as a habit from DDP scripts).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, NoReturn

import torch
import torch.nn as nn

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
        probe = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        out = fn(probe)
        if out.dtype != tensor.dtype or out.device != tensor.device:
            before, after = f"{tensor.dtype} on {tensor.device}", f"{out.dtype} on {out.device}"
            raise TypeError(_MOVE_MESSAGE.format(name=name, before=before, after=after))
    return module


def _refuse_moves_of(module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    return refuse_moves(module, fn)


def guard_module(module: nn.Module) -> None:
    """The wrapped module and its submodules (whose parameters are shards too) refuse
    copies, and moves or casts that change anything, while wrapped."""
    for sub in module.modules():
        sub.__dict__.update(_GUARDS, _apply=functools.partial(_refuse_moves_of, sub))


def release_module(module: nn.Module) -> None:
    """Unwrapped again (``unshard_module``): copies and moves work as for any module."""
    for sub in module.modules():
        for name in (*_GUARDS, "_apply"):
            sub.__dict__.pop(name, None)
