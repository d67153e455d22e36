"""The torch formulas the fused kernels replace: what `lean.layer_inference` computes.

Owns nothing new: each function is the lean inference path's own sequence of torch ops
(`norm.rms_norm`, the stacked q/k RMSNorm, `rope.apply_rotary_rolled`, `KVPool.write`,
`F.silu(g) * u`), so the kernels are checked against the CPU twin op for op, rounding included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.norm import rms_norm
from specserve.models.rope import apply_rotary_rolled


def add_rms_norm_ref(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # h, x_new [T, N]
    """x_new = x + residual (or x), h = rms_norm(x_new): the residual add, then HF's norm."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def qk_norm_rope_kv_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2·Hkv)·D] the fused q|k|v projection
    norm_w: torch.Tensor | None,  # [Hq + Hkv, D] q/k norm weights per head, None: no q/k norm
    cos: torch.Tensor,  # [T, 1, D] from Rotary.rolled_tables
    sin: torch.Tensor,  # [T, 1, D] signed sin
    slots: torch.Tensor,  # [T] int64 flat slot = page · page_size + offset
    k_cache: torch.Tensor,  # [P, page_size, Hkv, D] one layer's pool view (written)
    v_cache: torch.Tensor,  # [P, page_size, Hkv, D]
    hq: int,
    hkv: int,
    eps: float = 1e-6,
) -> torch.Tensor:  # q [T, Hq, D] contiguous
    """Per-head q/k RMSNorm, RoPE on q and k, rotated k and raw v stored at `slots`."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=1)
    qk, v = qk.view(t, hq + hkv, d), v.view(t, hkv, d)
    if norm_w is not None:
        qk = F.rms_norm(qk, (d,), eps=eps) * norm_w
    q, k = apply_rotary_rolled(qk, cos, sin).split([hq, hkv], dim=1)
    rows = (-1, hkv, d)
    k_cache.view(rows).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(rows).index_copy_(0, slots, v.to(v_cache.dtype))
    return q.contiguous()


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(g) · u with g the first half of each row (the fused gate|up projection)."""
    g, u = gate_up.chunk(2, dim=1)
    return F.silu(g) * u
