"""Buffers: how parameters are grouped, laid out flat, sharded and exposed as DTensors.

Modules, one concern each:

- ``layout.py``: pure index math (item offsets, padding, each rank's shard); no tensors.
- ``allocator.py``: temporary unsharded bucket memory (per use or pooled) and its accounting.
- ``data_parallel_buffer.py``: ``DataParallelBuffer``, one flat tensor for one group and role.
- ``units.py``: FSDP units: finding, splitting and merging them; double-buffer slots.
- ``param_and_grad_buffer.py``: ``ParamAndGradBuffer`` and ``ParameterGroup``: the groups,
  their model-weight, main-weight and main-gradient buffers, the distributed parameters.
- ``tensor_parallel.py``: each parameter's layout across the tensor-parallel ranks (``TPSpec``);
  DTensor parameters of a TP plan turned into plain local ones at wrapping.
- ``piece_dtensor.py``: ``PieceDTensor``, the DTensor type of the sharded parameters.
- ``dtensor_dispatch.py``: how the DTensor subclasses see each op on every torch.
- ``unsynced_grad.py``: what a distributed parameter's ``.grad`` is while its sync is deferred.
"""
