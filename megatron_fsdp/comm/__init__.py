"""Communication: the bottom floor. Everything that talks to process groups, devices and
streams; nothing here knows about parameters, units or models.

Modules, one concern each:

- ``collectives.py``: stateless collective wrappers (each takes its group and tensors and
  returns a handle), counted by ``CollectiveRecorder``; gloo's wait at exit.
- ``broadcast_tensors.py``: many tensors made equal to their first copy, in flat buckets.
- ``p2p_transport.py``: flat all-gather and reduce-scatter over point-to-point messages, for gloo.
- ``release_after_wait.py``: [Note: release after wait]: a bucket is released only after its
  collective's ``wait()``.
- ``streams.py``: communication streams and events (a no-op on CPU).
- ``device.py``: the one module that calls ``torch.cuda``: device choice, memory queries, RNG
  state. Part of the engine's public surface: the launcher uses it.
- ``distributed_index.py``: ``FSDPDistributedIndex``, the process groups and the device mesh.
"""
