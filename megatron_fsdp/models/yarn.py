"""YaRN rotary embeddings (Peng et al., 2023), as megatron-core computes them for
multi-latent attention.

YaRN stretches RoPE to a context ``scaling_factor`` times longer than the one the
model was trained on (``original_max_position_embeddings``) by interpolating only
the slow frequencies:

* each frequency pair j of a d-channel rotation has inverse frequency
  base^(-2j/d) ("extrapolated") or that divided by the factor ("interpolated");
* pairs that turn more than ``beta_fast`` times over the original context keep the
  extrapolated frequency, pairs that turn fewer than ``beta_slow`` times take the
  interpolated one, and a linear ramp over the pair index blends those in between
  (the ramp's ends are the pair indices where those rotation counts are reached,
  rounded outwards to integers);
* cos and sin are multiplied by a concentration factor (``concentration``), and MLA
  also rescales its softmax by ``yarn_mscale(factor, mscale_all_dim)`` squared.

Everything is computed in fp32 from the sequence length (or the tokens' positions) per
forward, like ``rope.rope_angles``: no buffers, nothing to place on a device or materialise
from the meta device.
"""

from __future__ import annotations

import math

import torch

from .rope import token_positions


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    if scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def concentration(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor on cos/sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
    return float(yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim))


def _correction_dim(rotations: float, dim: int, base: float, original_max_positions: int) -> float:
    """The (fractional) pair index whose frequency turns ``rotations`` times over the original context."""
    return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def ramp_bounds(beta_fast: float, beta_slow: float, dim: int, base: float,
                original_max_positions: int) -> tuple[int, int]:
    """(low, high) pair indices of the blend: floor/ceil of the correction dims, clamped to [0, dim - 1]."""
    low = math.floor(_correction_dim(beta_fast, dim, base, original_max_positions))
    high = math.ceil(_correction_dim(beta_slow, dim, base, original_max_positions))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_positions: int,
                  beta_fast: float, beta_slow: float, device: torch.device | None = None) -> torch.Tensor:
    """(dim/2,) fp32 inverse frequencies: interpolated below the ramp, extrapolated above it."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim  # (dim/2,)
    extrapolated = 1.0 / (base ** exponents)
    interpolated = 1.0 / (scaling_factor * base ** exponents)
    low, high = ramp_bounds(beta_fast, beta_slow, dim, base, original_max_positions)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: keep the extrapolated (fast) frequency, 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_angles(seq_len: int, dim: int, base: float, scaling_factor: float, original_max_positions: int,
                beta_fast: float, beta_slow: float, device: torch.device | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """(seq_len, dim) angles, each frequency repeated for both halves (rope.rope_angles' layout).
    ``positions`` (seq_len,): the tokens' positions; ``None``: 0 .. seq_len - 1."""
    inv_freq = yarn_inv_freq(dim, base, scaling_factor, original_max_positions, beta_fast, beta_slow, device)
    freqs = torch.outer(token_positions(seq_len, device, positions), inv_freq)  # (t, dim/2)
    return torch.cat((freqs, freqs), dim=-1)  # (t, dim)
