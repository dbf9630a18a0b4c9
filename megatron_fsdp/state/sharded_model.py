"""``ShardedModel``: what the state code reads from the wrapper it saves and loads.

[Note: the state floor's view of the wrapper] ``MegatronFSDP`` (in the package root)
builds its state dicts with this floor's functions, so this floor cannot import it
back. It names instead the few members it reads, as a structural ``Protocol``:
``MegatronFSDP`` satisfies it without declaring so, and nothing here depends on
the wrapper's module.
"""

from __future__ import annotations

from typing import Protocol

import torch.nn as nn

from ..buffers.param_and_grad_buffer import ParamAndGradBuffer
from ..comm.distributed_index import FSDPDistributedIndex
from ..runtime.all_gather_pipeline import AllGatherPipeline


class ShardedModel(Protocol):
    """A ``MegatronFSDP`` as the state dicts, exports and checkpoints see it."""

    module: nn.Module
    """The wrapped module, whose names key the state dicts."""
    param_and_grad_buffer: ParamAndGradBuffer
    """The parameter groups and their main weights."""
    all_gather_pipeline: AllGatherPipeline
    """Its ``timeout`` bounds the state dicts' gathers."""
    dist_index: FSDPDistributedIndex
    """The process groups (the expert-parallel one for full state dicts of experts)."""
    @property
    def keeps_extra_state(self) -> bool:
        """Whether ``state_dict()`` includes modules' extra state."""

    def settle_weights_for_reading(self) -> None:
        """Apply in-place edits of the parameters made since the last step."""

    def install_optimized_model_weights(self) -> None:
        """Re-cast the compute weights from the (newly loaded) main weights."""
