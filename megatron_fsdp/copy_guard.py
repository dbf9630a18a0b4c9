"""Copying or pickling a wrapped model raises, with the remedy.

Under DDP ``copy.deepcopy(model.module)`` (an EMA, a frozen teacher) copies a full
replica. A module wrapped by megatron_fsdp holds no full model on any rank: its
parameters are this rank's shards of flat buffers that the whole model shares, and
its hooks run collectives over the model's process groups. A copy could keep neither
(torch failed inside with "invalid python storage"), so ``copy.deepcopy`` and
pickling (``torch.save(model)``) of the wrapper, the wrapped module and its
submodules raise instead. ``state_dict()``, ``get_full_state_dict`` and the checkpoint functions are
the ways to take weights out.
"""

from __future__ import annotations

from typing import Any, NoReturn

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


def guard_module(module: nn.Module) -> None:
    """The wrapped module and its submodules (whose parameters are shards too) refuse
    copies while wrapped."""
    for sub in module.modules():
        sub.__dict__.update(_GUARDS)


def release_module(module: nn.Module) -> None:
    """Unwrapped again (``unshard_module``): copies work as for any module."""
    for sub in module.modules():
        for name in _GUARDS:
            sub.__dict__.pop(name, None)
