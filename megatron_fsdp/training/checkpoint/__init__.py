"""The launcher's checkpoints (``--save``, ``--load``, ``--ckpt-format``).

- ``dcp_checkpoint.py``: Megatron-LM's layout (``iter_XXXXXXX/``, the tracker file) over the
  engine's DCP checkpoints (``--ckpt-format fsdp_dtensor``) (``megatron_fsdp.state``), RNG state, asynchronous saves.
- ``torch_checkpoint.py``: Megatron-LM's legacy ``--ckpt-format torch`` (one ``torch.save``
  file, plus ``distrib_optim.pt`` for the distributed optimizer).
- ``mcore_dist.py``: ``--ckpt-format torch_dist`` in megatron-core's own format (what Megatron-LM
  reads and writes), for the runs its map covers ([Note: torch_dist's reach]).
- ``hf_weights.py``: Hugging Face directories: ``--load`` / ``--pretrained-checkpoint`` of one
  (a fine-tune's start) and ``--export-hf-dir``.
"""
