"""The launcher (Megatron-LM's ``pretrain_gpt.py``, its flags, data and checkpoints): the
driver ``pretrain_gpt.py`` runs as ``scripts/pretrain_gpt.py``, ``python -m
megatron_fsdp.training.pretrain_gpt`` and the ``megatron-fsdp-pretrain-gpt`` command. It sits above the engine and uses only its public surface
(the package root's modules, ``megatron_fsdp.state``, ``megatron_fsdp.comm.device`` and
``megatron_fsdp.models``); ``import megatron_fsdp`` never loads it.

Folders, one concern each:

- ``args/``: the flags: Megatron-LM's parser rebuilt from the flag table, configs, validation.
- ``data/``: datasets (indexed, mock, blended, FIM, the byte corpus), tokenizers, batching.
- ``optim/``: the learning-rate schedule, fp16 loss scaling, Muon.
- ``checkpoint/``: Megatron-LM's checkpoint layout over DCP, and the legacy torch format.
- ``observe/``: the iteration line, timers, dashboards, the replica check, the loss plot.

The training loop's own modules:

- ``pretrain_gpt.py``: the driver, read top to bottom: start-up, the loop, saves, evaluation, exit.
- ``model_setup.py``: build the model and wrap it (Megatron-FSDP, PyTorch DDP or FSDP2),
  build its optimizer.
- ``torch_fsdp2.py``: ``--use-torch-fsdp2``: PyTorch FSDP2 wrapping as Megatron-LM applies it.
- ``sharded_view.py``: the launcher's view of a model sharded in place (FSDP2, version 2) and the
  parameter marks sharding drops.
- ``megatron_fsdp_v2.py``: ``--megatron-fsdp-version 2``: the per-module API's sharding as
  Megatron-LM's ``FullyShardedDataParallelV2`` applies it.
- ``training_step.py``: one iteration (micro batches, sync, clipping, checks, step) and evaluation.
- ``microbatches.py``: the global batch of each iteration (ramp-up, step schedule).
- ``exit_conditions.py``: Megatron-LM's early exits, each after a checkpoint.
- ``determinism.py``: ``--deterministic-mode``'s settings.
- ``local_group.py``: the gloo group of one host's CPU processes (the benchmark and the tests).
"""
