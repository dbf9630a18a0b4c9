"""The language-model cross-entropy as Megatron computes it, shared by the launcher's
loss and the multi-token prediction heads (mtp.py): fp32 whatever the model's dtype,
and with ``--cross-entropy-loss-fusion`` the logits' gradient rounded to bf16. Also
how a side loss (MoE balancing, multi-token prediction) joins the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LogitsGradInBF16(torch.autograd.Function):
    """Identity in forward; backward rounds the logits' gradient to bf16 (then back to
    its dtype). Megatron-LM's ``--cross-entropy-loss-fusion`` (its native fused kernel,
    the only implementation it allows) computes the loss in fp32 as the unfused path
    does, but returns the logits' gradient cast to bf16 whatever the model's dtype:
    a no-op for a bf16 model, a precision loss for fp32 and fp16 models that this
    reproduces."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(torch.bfloat16).to(grad.dtype)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, bf16_logits_grad: bool = False,
                        reduction: str = "none") -> torch.Tensor:
    """logits (b, t, vocab), labels (b, t) -> per-token losses (b, t) in fp32 (or their
    sum with ``reduction="sum"``). Computed in fp32 whatever the logits' dtype: a bf16
    log-softmax over 256+ classes is coarse."""
    logits = logits.float()
    if bf16_logits_grad:
        logits = LogitsGradInBF16.apply(logits)
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction=reduction)
    return losses if reduction != "none" else losses.view(labels.shape)


class AttachLossGradient(torch.autograd.Function):
    """Identity on ``activation``; in backward, ``scale`` is ``loss``'s gradient, so the
    backward of the main loss also runs the side loss's backward, without the side loss
    being added to the reported value (megatron-core's ``MoEAuxLossAutoScaler`` and
    ``MTPLossAutoScaler``). ``scale`` is the factor the training loop gives the main
    loss of one forward (1 / micro batches times the loss scale)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None
