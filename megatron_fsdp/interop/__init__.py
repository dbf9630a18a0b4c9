"""Other projects' checkpoint formats: Hugging Face ``transformers`` directories and
megatron-core's ``torch_dist`` distributed checkpoints, read into and written from a model
(plain, or wrapped by this package at any world size) piece by piece.

Modules, one concern each:

- ``hf_config.py``: the Hugging Face families (``HFFamily``), ``config.json`` to and from a
  ``GPTConfig``, and the check that a configuration matches a ``config.json``.
- ``hf_names.py``: name maps (``NameMap``) between a model's parameters and a Hugging Face
  checkpoint's tensors (fused QKV and gate/up layouts, transposed GPT-2 weights, tied
  embeddings, experts), one per family of the embedded GPT, or the identity.
- ``safetensors_io.py``: sharded ``safetensors`` directories read lazily by slices
  (memory-mapped) and written shard by shard with their index.
- ``hf_slices.py``: where a state-dict value's local tensor lies in the whole tensor
  (``local_box``), and reading exactly that box of a checkpoint through a name map.
- ``hf_checkpoint.py``: ``load_hf_checkpoint`` (each rank reads only the slices it keeps),
  ``save_hf_checkpoint`` (gathered one tensor at a time, written by one rank) and
  ``is_hf_directory``.
- ``hf_modules.py``: the decoder layers of a ``transformers`` model (``hf_decoder_layer_classes``,
  ``hf_decoder_layers``), found from its ``_no_split_modules``: the FSDP units.
- ``torch_dist.py``: megatron-core's ``torch_dist`` format through its own
  ``dist_checkpointing``: ``save_torch_dist`` / ``load_torch_dist``.
- ``torch_dist_keys.py``: where each tensor goes among megatron-core's keys (stacked layer and
  expert axes, per-group QKV, TransformerEngine vs local norm names, extra-state objects).
- ``torch_dist_shards.py``: each rank's blocks as megatron-core ``ShardedTensor``s (uneven
  blocks; QKV as runs of rows) and back.
- ``torch_dist_io.py``: the ``dist_checkpointing`` calls, directory checks, the CUDA-free save
  strategy, ``is_torch_dist_checkpoint``.
- ``torch_dist_optim.py``: Adam state in the distributed optimizer's ``fully_reshardable``
  per-parameter layout.

This floor sits beside the planner (``tools/``): it reads the public face, ``state``'s declared
surface and the embedded models; the launcher (``training/``) and the converter
(``python -m megatron_fsdp.convert``) use it.
"""
