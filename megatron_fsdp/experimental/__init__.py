"""megatron_fsdp.experimental: per-module ``fully_shard`` on distributed buffers
(upstream Megatron-FSDP's experimental API).

Apply ``fully_shard`` bottom-up inside ``fully_shard_context`` (like FSDP2's
``fully_shard``); parameters become sharded DTensors backed by ``DBuffer``s; wrap
the optimizer with ``fully_shard_optimizer``. See the README section
"megatron_fsdp.experimental".
"""

from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .dbuffer import DBuffer
from .fully_shard import Placements, fully_shard, fully_shard_context, microbatch
from .module import FsdpContext, FsdpModule
from .optimizer import fully_shard_optimizer
from .placement import Flat

__all__ = [
    "DBuffer",
    "Flat",
    "FsdpContext",
    "FsdpModule",
    "Placements",
    "full_state_dict",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]
