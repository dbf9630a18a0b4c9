"""Which ``MegatronFSDP`` a parameter or module belongs to.

Lookups from code that holds only a tensor (``fully_shard_optimizer``, the state-dict
builders, misuse checks). The maps hold neither side strongly: a wrapper holds its
module and parameters, so a strong value would keep its own key, and with it the
whole model and its buffers, alive for the life of the process.

The owners are typed ``nn.Module``: this floor sits below the wrapper (``MegatronFSDP``,
in the package root) and never imports it; callers know what they registered.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary


class OwnerMap:
    """Object (by identity) -> the MegatronFSDP it belongs to, both held weakly."""

    def __init__(self) -> None:
        self._refs = WeakIdKeyDictionary()

    def __setitem__(self, key: Any, owner: nn.Module) -> None:
        self._refs[key] = weakref.ref(owner)

    def get(self, key: Any) -> Optional[nn.Module]:
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def pop(self, key: Any) -> None:
        self._refs.pop(key, None)


OWNERS = OwnerMap()
"""Distributed parameter -> the MegatronFSDP that owns it (fully_shard_optimizer's lookup)."""
WRAPPED = OwnerMap()
"""Wrapped module -> its MegatronFSDP (wrapping twice is an error)."""
COMPUTE_OWNERS = OwnerMap()
"""Compute parameter (the wrapped module's own) -> its MegatronFSDP (misuse checks)."""


def owner_of(param: Any) -> Optional[nn.Module]:
    return OWNERS.get(param)


def compute_owner_of(param: Any) -> Optional[nn.Module]:
    """The MegatronFSDP whose wrapped module holds ``param`` as a compute parameter."""
    return COMPUTE_OWNERS.get(param)


def is_managed(param: Any) -> bool:
    """``param`` is a distributed or compute parameter of some live MegatronFSDP."""
    return param in OWNERS or param in COMPUTE_OWNERS
