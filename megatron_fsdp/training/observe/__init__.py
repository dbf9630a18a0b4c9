"""What the launcher reports about a run.

- ``logging_utils.py``: Megatron-LM's iteration line, per-rank memory, the validation box,
  the JSON metrics log.
- ``profiling.py``: ``--profile`` / ``--use-pytorch-profiler`` / ``--record-memory-history`` over
  Megatron-LM's iteration window and ``--profile-ranks``.
- ``flops.py``: the model FLOPs of a global batch by Megatron-LM's rule (the TFLOP/s column).
- ``timers.py``: Megatron-LM's named timers for ``--timing-log-level``.
- ``tensorboard.py``: TensorBoard events and Weights & Biases, with Megatron-LM's scalar names.
- ``replica_check.py``: ``--check-weight-hash-across-dp-replicas-interval``: replicas bit-identical.
- ``plot.py``: the loss-curve PNG at the end of a run.
"""
