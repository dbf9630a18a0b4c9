"""The optimizer side of the launcher.

- ``lr_schedule.py``: Megatron-LM's learning-rate schedules (warmup, decay styles, resume rules).
- ``loss_scaler.py``: ``--fp16`` loss scaling, constant or Megatron-LM's dynamic scaler.
- ``muon.py``: Muon's math (the orthogonalised update of one matrix) and its config.
- ``muon_optimizer.py``: ``--optimizer muon``: Muon on the hidden matrices, AdamW on the rest,
  in one optimizer that runs on the sharded parameters' flat pieces.
"""
