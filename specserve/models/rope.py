"""Rotary position embeddings: inverse frequencies for default / linear / YaRN / llama3 scaling.

Formulas follow the published definitions (and transformers' `modeling_rope_utils`, the oracle
the tests compare against); cos/sin are computed in float32 then cast to the activation dtype.
"""

from __future__ import annotations

import math

import torch

from specserve.models.config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:  # [dim/2] float32
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = cfg.factor
    attn = cfg.attention_factor
    if attn is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attn = mscale(factor, cfg.mscale) / mscale(factor, cfg.mscale_all_dim)
        else:
            attn = mscale(factor)
    original = cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


def _llama3(cfg: RopeConfig, dim: int) -> torch.Tensor:
    inv = _base_inv_freq(cfg.theta, dim)
    old = cfg.original_max_position_embeddings
    low_wavelen, high_wavelen = old / cfg.low_freq_factor, old / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / cfg.factor, inv)
    smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_scale(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim/2]` float32 and the cos/sin scale (YaRN's attention factor)."""
    if cfg.rope_type == "yarn":
        return _yarn(cfg, dim)
    if cfg.rope_type == "llama3":
        return _llama3(cfg, dim), 1.0
    inv = _base_inv_freq(cfg.theta, dim)
    return (inv / cfg.factor if cfg.rope_type == "linear" else inv), 1.0


class Rotary(torch.nn.Module):
    """cos/sin tables at arbitrary absolute positions (tree nodes share positions)."""

    def __init__(self, cfg: RopeConfig, head_dim: int) -> None:
        super().__init__()
        inv, self.scale = inv_freq_and_scale(cfg, head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _half(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled cos and sin `[T, D/2]` float32 (each frequency once)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos, sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin `[T, D]` for `apply_rotary` (both halves equal)."""
        cos, sin = self._half(positions)
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)

    def rolled_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[T, 1, D]` for `apply_rotary_rolled` (once per forward).

        Equal to `forward`'s tables, with the rotate-half sign folded into sin's first half:
        `[-sin, +sin]` (negation is exact, so the rotation's results are bitwise the same).
        """
        cos, sin = self._half(positions)
        cos = torch.cat([cos, cos], dim=-1).to(dtype)
        sin = torch.cat([-sin, sin], dim=-1).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, H, D]` by per-token `cos/sin [T, D]` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_rolled(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """`apply_rotary` with tables from `Rotary.rolled_tables` `[T, 1, D]`: 4 kernels, not 7.

    rotate_half(x) · sin = roll(x, D/2) · [-sin, +sin]; products and sum round as in the
    rotate-half form, so the result is bitwise equal.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
