"""Rotary position embeddings (RoPE), in Megatron-core's two layouts.

By default channel j of the rotated part is paired with channel j + rot_dim/2 (the
"rotate half" layout of GPT-NeoX and Megatron); with ``interleaved`` (Megatron's
``--rotary-interleaved``, GPT-J's layout) channels 2j and 2j + 1 are the pair. Pair j
at position p turns by angle p * base^(-2j/rot_dim) either way.
With ``rotary_percent < 1`` only the first rot_dim channels of each head turn;
the rest pass through unchanged.

cos/sin are recomputed per forward from the sequence length (or the tokens' positions,
which context parallelism passes: a rank's tokens are not positions 0 .. t-1): t * rot_dim/2
trig evaluations are nothing next to attention, and holding no buffer keeps the
module free of meta-device and device-placement concerns.
"""

from __future__ import annotations

import torch


def rope_angles(seq_len: int, rot_dim: int, base: float, device: torch.device, *,
                interleaved: bool = False, positions: torch.Tensor | None = None) -> torch.Tensor:
    """(seq_len, rot_dim) angles: position * inverse frequency, each frequency on both
    channels of its pair ([f0.. | f0..] halves, or f0 f0 f1 f1 ... interleaved).
    ``positions`` (seq_len,): the tokens' positions; ``None``: 0 .. seq_len - 1.
    Computed in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))  # (rot_dim/2,)
    freqs = torch.outer(token_positions(seq_len, device, positions), inv_freq)  # (t, rot_dim/2)
    if interleaved:
        return freqs.repeat_interleave(2, dim=-1)  # (t, rot_dim)
    return torch.cat((freqs, freqs), dim=-1)  # (t, rot_dim)


def token_positions(seq_len: int, device: torch.device | None, positions: torch.Tensor | None) -> torch.Tensor:
    """(seq_len,) fp32 positions: ``positions`` (exact in fp32 below 2^24) or 0 .. seq_len - 1."""
    if positions is None:
        return torch.arange(seq_len, dtype=torch.float32, device=device)
    if positions.shape != (seq_len,):
        raise ValueError(f"positions of shape {tuple(positions.shape)} for {seq_len} tokens; pass one position "
                         "per token, shape (seq_len,)")
    return positions.to(device=device, dtype=torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """x: (b, heads, t, head_dim), angles: (t, rot_dim) from ``rope_angles`` with the
    same ``interleaved`` -> x with its first rot_dim channels rotated per position."""
    rot_dim = angles.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (t, rot_dim), broadcast over (b, heads)
    rotated = x_rot * cos + (_rotate_pairs(x_rot) if interleaved else _rotate_half(x_rot)) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated
