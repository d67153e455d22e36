"""Fused small ops of a decoder layer: public entry point `fused_ops`.

Owns the choice between the Triton kernels (kernel.py: residual add + RMSNorm, q/k norm + RoPE +
paged K/V write, silu · up) and the torch formulas they replace (ref.py, the CPU twin's ops).
Both sets take and return the same tensors; the Triton launchers validate their inputs
(ValueError). Not here: which layer calls what (`specserve.models.fused_layer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kernels import triton_available


@dataclass(frozen=True, slots=True)
class FusedOps:
    """One implementation of the three ops (signatures: kernel.py / ref.py)."""

    add_rms_norm: Callable  # (x, residual | None, weight, eps) -> (h, x_new)
    qk_norm_rope_kv: Callable  # (qkv, norm_w, cos, sin, slots, k_cache, v_cache, hq, hkv, eps)
    silu_mul: Callable  # (gate_up [T, 2I]) -> [T, I]


_OPS: dict[str, FusedOps] = {}  # impl -> its ops, built on first use


def fused_ops(impl: str, device: torch.device | str) -> FusedOps:
    """`impl`: "auto" (Triton on CUDA when triton is installed, else the torch ops), "triton"
    (on CPU needs TRITON_INTERPRET=1) or "ref"."""
    if impl == "auto":
        impl = "triton" if torch.device(device).type == "cuda" and triton_available() else "ref"
    ops = _OPS.get(impl)
    if ops is not None:
        return ops
    if impl == "triton":
        from specserve.kernels.fused import kernel

        ops = FusedOps(kernel.add_rms_norm, kernel.qk_norm_rope_kv, kernel.silu_mul)
    elif impl == "ref":
        from specserve.kernels.fused import ref

        ops = FusedOps(ref.add_rms_norm_ref, ref.qk_norm_rope_kv_ref, ref.silu_mul_ref)
    else:
        raise ValueError(f"impl must be 'auto', 'triton' or 'ref', got {impl!r}")
    _OPS[impl] = ops
    return ops


__all__ = ["FusedOps", "fused_ops", "triton_available"]
