"""Pieces of ``scripts/pretrain_gpt.py`` (the Megatron-LM style launcher), one
module per concern: flags and their validation, data, learning-rate schedule, loss
scaling, model and optimizer setup, the training step, checkpoints, logging and
the loss-curve plot."""
