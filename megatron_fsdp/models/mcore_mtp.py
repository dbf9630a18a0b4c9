"""megatron-core's multi-token prediction for ``build_mcore_gpt`` (``--use-mcore-models
--mtp-num-layers``) and what the launcher drives of it. Imported by ``mcore.py`` only for
an MTP config, so it may import megatron-core at the top.

megatron-core 0.16.1 builds its ``MultiTokenPredictionBlock`` on the local spec without
TransformerEngine (``get_gpt_mtp_block_spec(..., use_transformer_engine=False)``: torch
norms, a local linear for ``eh_proj``, the decoder's last layer spec for the transformer
layer). Two things Megatron-LM's training loop does around it fall to the launcher:

* the MTP loss's gradient factor: Megatron-LM's forward step calls
  ``MTPLossAutoScaler.set_loss_scale`` every micro batch (the loss scale, divided by the
  micro batches unless ``--calculate-per-token-loss``) -- ``McoreMTPLoss.set_mtp_loss_settings``;
* the ``mtp_k loss`` log fields: megatron-core adds each depth's token-mean loss of a
  training forward to ``MTPLossLoggingHelper.tracker`` -- ``McoreMTPLoss.mtp_losses``.

[Note: per-token MTP loss in megatron-core 0.16.1] With ``calculate_per_token_loss`` the
pinned Megatron-LM weighs depth k's loss sum by (micro-batch tokens) / (tokens of depth
k) before the global token division (mtp.py, [Note: per-token MTP loss]); megatron-core
0.16.1 leaves that ratio out. With one depth the ratio is the constant t / (t - 1), so
``McoreMTPLoss`` folds it into the gradient factor and megatron-core computes Megatron-LM's
gradient; with more depths no single factor can, and ``per_token_rolled_count_problem``
refuses the combination.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from .config import GPTConfig
from .mcore_specs import megatron_core_rescales_per_token_mtp, per_token_rolled_count_problem


def mtp_block_spec(config, decoder_spec):
    """Megatron-LM's ``gpt_builder`` choice: megatron-core's MTP block spec around the last
    decoder layer's spec (dense or MoE), local modules."""
    return get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=False)


class McoreMTPLoss:
    """What the launcher drives of megatron-core's MTP (see the module docstring): the
    interface of the embedded GPT's (``set_mtp_loss_settings``, ``mtp_losses``) plus
    ``clear()`` before each micro batch's forward, as ``McoreBalancingLoss``: the tracker
    is process-wide and evaluation forwards in training mode add to it too."""

    def __init__(self, cfg: GPTConfig, *, sequence_length: int, per_token: bool) -> None:
        problem = per_token_rolled_count_problem(cfg.mtp_num_layers, per_token)
        if problem:
            raise ValueError(problem)
        self.num_depths = cfg.mtp_num_layers
        self.per_token = per_token
        # [Note: per-token MTP loss in megatron-core 0.16.1]
        rescale = per_token and not megatron_core_rescales_per_token_mtp()
        self.per_token_correction = sequence_length / max(sequence_length - 1, 1) if rescale else 1.0

    def set_mtp_loss_settings(self, *, backward_scale: float, per_token: bool) -> None:
        if per_token != self.per_token:
            raise ValueError(f"per_token={per_token}, but megatron-core's model was built with "
                             f"calculate_per_token_loss={self.per_token}; build it with the training loop's mode")
        scale = backward_scale * (self.per_token_correction if per_token else 1.0)
        # A 0-dim CPU tensor multiplies tensors on any device without a copy.
        MTPLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32))

    @staticmethod
    def _values() -> Optional[torch.Tensor]:
        tracker = MTPLossLoggingHelper.tracker
        return tracker.get("values", tracker.get("loss_values"))  # 0.16.1's key, then newer releases'

    def clear(self) -> None:
        values = self._values()
        if values is not None:
            values.zero_()

    def mtp_losses(self) -> Optional[torch.Tensor]:
        """(D,) each depth's token-mean loss of the forward since ``clear()``; None before any."""
        values = self._values()
        return None if values is None else values.detach().clone()
