"""megatron_fsdp.experimental: per-module ``fully_shard`` on distributed buffers
(upstream Megatron-FSDP's experimental API).

Apply ``fully_shard`` bottom-up inside ``fully_shard_context`` (like FSDP2's
``fully_shard``); parameters become sharded DTensors backed by ``DBuffer``s; wrap
the optimizer with ``fully_shard_optimizer``. See the README section
"megatron_fsdp.experimental".

Modules, one concern each:

- ``fully_shard.py``: the entry points: ``Placements``, ``fully_shard``, ``fully_shard_context``,
  ``microbatch``.
- ``module.py``: the ``FsdpModule`` mixin and ``FsdpContext``: the hooks that gather, release
  and reduce.
- ``parameter_group.py``: one dtype- and requires_grad-homogeneous group of a module's
  parameters, its buffers and sharded parameters.
- ``dbuffer.py``: ``DBuffer``: several logical tensors in one flat local buffer.
- ``placement.py``: placements of a ``DBuffer`` along each mesh axis (``Flat``).
- ``upstream_placements.py``: upstream 0.6.1's own ``Replicate`` / ``Partial`` placement classes,
  accepted by ``Placements`` (code written for that release runs unchanged).
- ``layout.py``: the row-aligned global layout of one ``DBuffer``'s tensors (pure index math).
- ``dtensor.py``: the DTensors that expose ``DBuffer`` tensors.
- ``tensor_parallel.py``: modules whose parameters are DTensors of a tensor-parallel plan
  (``TPParam``: what a parameter's local tensor is a piece of, across the TP ranks).
- ``optimizer.py``: ``fully_shard_optimizer``'s step hooks.
- ``checkpoint.py``: checkpoints and full weights of an experimentally sharded model;
  ``dcp_chunks.py`` the DCP chunk metadata of a flat shard.
"""

from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from .dbuffer import DBuffer
from .fully_shard import Placements, fully_shard, fully_shard_context, microbatch
from .module import FsdpContext, FsdpModule
from .optimizer import fully_shard_optimizer
from .placement import Flat
from .upstream_placements import Partial, Placement, Replicate

__all__ = [
    "DBuffer",
    "Flat",
    "FsdpContext",
    "FsdpModule",
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "full_state_dict",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]
