"""Triton kernels for the small ops of a decoder layer, and their launchers.

Owns three memory-bound kernels, each one pass over its rows with fp32 math that rounds where the
torch ops round (ref.py), so the results are those of the CPU twin up to reduction order:
`_add_rms_norm_kernel` (residual add + HF RMSNorm, one program per row), `_qk_norm_rope_kv_kernel`
(q/k RMSNorm + RoPE + paged K/V store from the fused q|k|v projection; program = token × block
of heads) and `_silu_mul_kernel` (silu(gate) · up). The launchers validate (ValueError); the
kernels check nothing. Not here: the layer wiring (`specserve.models.fused_layer`).

Exact rounding: every launch turns FMA contraction off (`enable_fp_fusion=False`): torch rounds
x·cos and roll(x)·sin each before their sum, and a fused multiply-add would skip one of those
roundings (on the H200 that alone put RoPE outputs 1 ulp or more off: BENCHMARKS.md,
"Figures formerly in source comments"). Divisions and
square roots are the round-to-nearest forms (div_rn, sqrt_rn, as torch's CPU kernels compute
them); exp on CUDA is libdevice's (not the ex2.approx of tl.exp).
Under the CPU interpreter a float32 → bfloat16 cast truncates, so `_round` rounds to nearest even
by hand there (what torch and CUDA's cvt.rn do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from specserve.kernels.tree_attention import fix_interpreter_index

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 `x` rounded to DTYPE (nearest even), as float32 again — one torch op's rounding."""
    if INTERPRET and DTYPE == tl.bfloat16:  # noqa: SIM300 — the interpreter's cast truncates
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rstd(x, n, eps, AXIS: tl.constexpr):
    """1 / sqrt(mean(x²) + eps) along AXIS, correctly rounded steps (torch's CPU rms_norm)."""
    ms = tl.math.div_rn(tl.sum(x * x, AXIS), n)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, H, XNew,  # pointers: [T, N] x, residual, out h, out x + residual; [N] weight
    n_cols, eps,
    stride_x, stride_r, stride_h, stride_xn,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dt: tl.constexpr = X.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # torch's add: fp32 sum rounded to the dtype
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dt, INTERPRET)
        tl.store(XNew + row * stride_xn + cols, x.to(dt), mask=mask)
    rstd = _rstd(x, n_cols.to(tl.float32), eps, 0)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    h = _round(_round(x * rstd, dt, INTERPRET) * w, dt, INTERPRET)  # normalised, then × weight
    tl.store(H + row * stride_h + cols, h.to(dt), mask=mask)


@triton.jit
def _qk_norm_rope_kv_kernel(
    QKV, NormW, Cos, Sin, Slots, Q, KCache, VCache,  # pointers
    eps,
    stride_qkv, stride_cos, stride_sin, stride_slot,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dt: tl.constexpr = QKV.dtype.element_ty
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] of q | k | v
    d = tl.arange(0, BLOCK_D)
    d_rolled = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2)[i] = x[(i + D/2) mod D]
    is_q = heads < HQ
    is_k = (heads >= HQ) & (heads < HQ + HKV)
    is_v = (heads >= HQ + HKV) & (heads < HQ + 2 * HKV)
    dmask = (d < HEAD_DIM)[None, :]
    row = QKV + t * stride_qkv + heads[:, None] * HEAD_DIM
    mask = (heads < HQ + 2 * HKV)[:, None] & dmask
    raw = tl.load(row + d[None, :], mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    x = raw.to(tl.float32)
    xr = tl.load(row + d_rolled[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # per head: normalised → round, × weight → round (x and its roll alike)
        rstd = _rstd(x, HEAD_DIM, eps, 1)[:, None]
        w_row = NormW + heads[:, None] * HEAD_DIM
        w_mask = (is_q | is_k)[:, None] & dmask
        w = tl.load(w_row + d[None, :], mask=w_mask, other=0.0).to(tl.float32)
        wr = tl.load(w_row + d_rolled[None, :], mask=w_mask, other=0.0).to(tl.float32)
        x = _round(_round(x * rstd, dt, INTERPRET) * w, dt, INTERPRET)
        xr = _round(_round(xr * rstd, dt, INTERPRET) * wr, dt, INTERPRET)
    c = tl.load(Cos + t * stride_cos + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_sin + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    y = _round(_round(x * c[None, :], dt, INTERPRET) + _round(xr * s[None, :], dt, INTERPRET),
               dt, INTERPRET).to(dt)  # x·cos → round, roll(x)·sin → round, sum → round
    tl.store(Q + t * (HQ * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :], y,
             mask=is_q[:, None] & dmask)
    slot = tl.load(Slots + t) * stride_slot  # int64: pools may span > 2**31 elements
    kh = tl.where(is_k, heads - HQ, 0)
    vh = tl.where(is_v, heads - HQ - HKV, 0)
    tl.store(KCache + slot + kh[:, None] * HEAD_DIM + d[None, :], y, mask=is_k[:, None] & dmask)
    tl.store(VCache + slot + vh[:, None] * HEAD_DIM + d[None, :], raw, mask=is_v[:, None] & dmask)


@triton.jit
def _silu_mul_kernel(
    GU, Out,  # pointers: [T, 2I] gate | up, [T, I] out
    n_inter,
    stride_gu, stride_out,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dt: tl.constexpr = GU.dtype.element_ty
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:  # noqa: SIM108 — libdevice has no interpreter twin
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    silu = _round(tl.math.div_rn(g, 1.0 + e), dt, INTERPRET)  # F.silu rounds, then × u rounds
    tl.store(Out + row * stride_out + cols, _round(silu * u, dt, INTERPRET).to(dt), mask=mask)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name} must be [T, N] with contiguous rows in {_DTYPES}, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


def _interpret(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return False
    fix_interpreter_index()
    return True


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # h [T, N], x_new [T, N] (x itself without residual)
    """h = rms_norm(x_new, weight), x_new = x + residual: one read of each row, two writes."""
    _check_rows("x", x)
    t, n = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {x.dtype} {tuple(x.shape)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    if residual is not None:
        _check_rows("residual", residual)
    if weight.shape != (n,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {x.dtype} [{n}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    h = torch.empty((t, n), dtype=x.dtype, device=x.device)
    x_new = x if residual is None else torch.empty_like(h)
    if t == 0:
        return h, x_new
    block = triton.next_power_of_2(n)
    r = x if residual is None else residual
    _add_rms_norm_kernel[(t,)](
        x, r, weight, h, x_new, n, eps,
        x.stride(0), r.stride(0), h.stride(0), x_new.stride(0),
        HAS_RES=residual is not None, BLOCK=block, INTERPRET=_interpret(x),
        num_warps=min(max(block // 512, 1), 16), enable_fp_fusion=False,
    )
    return h, x_new


def _check_qkv(qkv, norm_w, cos, sin, slots, k_cache, v_cache, hq, hkv) -> None:
    _check_rows("qkv", qkv)
    t = qkv.shape[0]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2] != hkv or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache / v_cache must be contiguous [P, page_size, {hkv}, D], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    d = k_cache.shape[3]
    if qkv.shape[1] != (hq + 2 * hkv) * d or d % 2:
        raise ValueError(f"qkv must be [T, (hq + 2·hkv)·D] = [T, {(hq + 2 * hkv) * d}] with D "
                         f"even, got {tuple(qkv.shape)}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"the caches must hold qkv's dtype {qkv.dtype}, got {k_cache.dtype}")
    if norm_w is not None and (norm_w.shape != (hq + hkv, d) or norm_w.dtype != qkv.dtype
                               or not norm_w.is_contiguous()):
        raise ValueError(f"norm_w must be contiguous {qkv.dtype} [{hq + hkv}, {d}], got "
                         f"{norm_w.dtype} {tuple(norm_w.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if (tab.shape[0] != t or tab.shape[-1] != d or tab.numel() != t * d
                or tab.stride(-1) != 1 or tab.dtype != qkv.dtype):
            raise ValueError(f"{name} must be {qkv.dtype} [T, 1, D] = [{t}, 1, {d}] with "
                             f"contiguous rows, got {tab.dtype} {tuple(tab.shape)}")
    if slots.shape != (t,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots must be contiguous int64 [{t}], got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if len({x.device for x in (qkv, cos, sin, slots, k_cache, v_cache)}) != 1:
        raise ValueError("qkv, cos, sin, slots and the caches must be on one device")


def qk_norm_rope_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2·Hkv)·D] the fused q|k|v projection (bias included)
    norm_w: torch.Tensor | None,  # [Hq + Hkv, D] q/k norm weight per head; None: no q/k norm
    cos: torch.Tensor,  # [T, 1, D] Rotary.rolled_tables
    sin: torch.Tensor,  # [T, 1, D] signed sin
    slots: torch.Tensor,  # [T] int64 flat slot = page · page_size + offset
    k_cache: torch.Tensor,  # [P, page_size, Hkv, D] one layer's pool view: rotated k written
    v_cache: torch.Tensor,  # [P, page_size, Hkv, D] raw v written
    hq: int,
    hkv: int,
    eps: float = 1e-6,
) -> torch.Tensor:  # q [T, Hq, D] contiguous, normalised and rotated
    """q/k RMSNorm + RoPE and the K/V cache write of one layer in one kernel (ref.py's math)."""
    _check_qkv(qkv, norm_w, cos, sin, slots, k_cache, v_cache, hq, hkv)
    t, d = qkv.shape[0], k_cache.shape[3]
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    block_d = triton.next_power_of_2(d)
    block_h = min(max(1024 // block_d, 1), triton.next_power_of_2(hq + 2 * hkv))
    grid = (t, triton.cdiv(hq + 2 * hkv, block_h))
    _qk_norm_rope_kv_kernel[grid](
        qkv, qkv if norm_w is None else norm_w, cos, sin, slots, q, k_cache, v_cache, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(1),
        HQ=hq, HKV=hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h,
        HAS_NORM=norm_w is not None, INTERPRET=_interpret(qkv), num_warps=4,
        enable_fp_fusion=False,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(g) · u, g the first half of each row of the fused gate|up projection."""
    _check_rows("gate_up", gate_up)
    t, n = gate_up.shape
    if n % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    out = torch.empty((t, n // 2), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n // 2), 1024)
    _silu_mul_kernel[(t, triton.cdiv(n // 2, block))](
        gate_up, out, n // 2, gate_up.stride(0), out.stride(0),
        BLOCK=block, INTERPRET=_interpret(gate_up), num_warps=4, enable_fp_fusion=False,
    )
    return out
