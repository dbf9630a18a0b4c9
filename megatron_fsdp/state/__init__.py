"""State of a sharded model: state dicts, full export, checkpoints.

Modules, one concern each:

- ``sharded_model.py``: ``ShardedModel``, the members of the wrapper this floor reads (a
  protocol: the wrapper sits above and is never imported here).
- ``keys.py``: the key rules: ``torch_key``, tied-weight aliases, persistent buffers,
  modules' extra state.
- ``gather.py``: a group's flat main weights gathered whole, or to one rank shard by shard.
- ``model_state_dict.py``: the model's sharded (standard DTensor) state dict and its load;
  ``get_full_state_dict`` / ``save_full_state_dict`` / ``load_full_state_dict``.
- ``full_state_dict.py``: the full export, one group at a time into host memory, and the
  main weights gathered to one rank (legacy one-file checkpoints).
- ``optimizer_state_dict.py``: the optimizer's state dict in the same standard form; its
  state gathered to one rank.
- ``optimizer_names.py``: a MoE model's optimizer state keyed by parameter name in checkpoints
  (the same key for an expert's state whatever the expert-parallel size).
- ``eager_state.py``: an optimizer's per-parameter state created before its first step.
- ``checkpoint.py``: ``save_checkpoint`` / ``load_checkpoint`` through DCP, atomic and
  checksummed.
- ``uneven_dtensor.py``: DTensors with uneven shards (upstream's ``megatron_fsdp.uneven_dtensor``).

The names below are this floor's declared surface: what the launcher (``training/``)
and other callers above the engine may use. Everything else here is internal.
"""

from .checkpoint import (
    EXTRA_STATE_FILE,
    CheckpointReadError,
    CheckpointWriteError,
    checkpoint_state,
    file_sha256,
    load_checkpoint,
    materialize_optimizer_state,
    save_checkpoint,
)
from .full_state_dict import gather_main_weights_to, module_state_dict_from
from .keys import alias_names, torch_key
from .model_state_dict import (
    StateDictMismatchError,
    clone_for_load,
    get_full_state_dict,
    load_full_state_dict,
    save_full_state_dict,
    sharded_state_dict,
)
from .optimizer_names import parameter_names
from .optimizer_state_dict import gather_optimizer_state_to

__all__ = [
    "CheckpointReadError",
    "CheckpointWriteError",
    "EXTRA_STATE_FILE",
    "StateDictMismatchError",
    "alias_names",
    "checkpoint_state",
    "clone_for_load",
    "file_sha256",
    "gather_main_weights_to",
    "gather_optimizer_state_to",
    "get_full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "materialize_optimizer_state",
    "parameter_names",
    "module_state_dict_from",
    "save_checkpoint",
    "save_full_state_dict",
    "sharded_state_dict",
    "torch_key",
]
