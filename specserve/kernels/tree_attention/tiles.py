"""Tile helpers of the tree-verify attention kernel (kernel.py): the log2-domain dot and online
softmax update, the paged K/V tile load (one block-table lookup per page-sized tile, or one per
key for small pages), a prefix tile, and the pre-scaled Q load. Pure `@triton.jit` functions,
inlined into `_tree_attn_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr):
    if DOT_PREC == "interpret":  # CPU interpreter: its bf16 dot multiplies raw bits; go fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _online_update(s, m_i, l_i, acc, v, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # noqa: SIM108 — a row may have no visible key in this tile (yet): keep exp2 finite
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefix_tile(
    q, m_i, l_i, acc, K, V, BlockTable, bt_row, n, lo_key, hi_key, q_pos, window, kv_head_off,
    stride_kp, stride_ks,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
):
    k, v, offs_n, kmask = _kv_tile(K, V, BlockTable, bt_row, n, lo_key, hi_key, kv_head_off,
                                   stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, MASKED)
    s = _dot(q, tl.trans(k), DOT_PREC)  # [BLOCK_M, BLOCK_N] log2-domain scores
    if MASKED:
        vis = kmask[None, :]
        if SLIDING:
            vis = vis & ((q_pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
    return _online_update(s, m_i, l_i, acc, v, MASKED, DOT_PREC)


@triton.jit
def _kv_offsets(BlockTable, bt_row, n, lo_key, hi_key, kv_head_off, stride_kp, stride_ks,
                HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr):
    offs_n = n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions (BLOCK_N-aligned tile)
    offs_d = tl.arange(0, HEAD_DIM)
    kmask = (offs_n >= lo_key) & (offs_n < hi_key)
    if PAGE_SIZE >= BLOCK_N:  # one page per tile: a single block-table lookup, scalar base
        page = tl.load(BlockTable + bt_row + n // PAGE_SIZE).to(tl.int64)
        base = page * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head_off
        tok_off = tl.arange(0, BLOCK_N) * stride_ks  # int32 tile offsets keep addresses cheap
    else:  # small pages: one page id per key (pool < 2**31 elements: int32 offsets)
        if MASKED:
            page = tl.load(BlockTable + bt_row + offs_n // PAGE_SIZE, mask=kmask, other=0)
        else:
            page = tl.load(BlockTable + bt_row + offs_n // PAGE_SIZE)
        base = kv_head_off
        tok_off = page * stride_kp + (offs_n % PAGE_SIZE) * stride_ks
    offs = tok_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM], shared by K and V
    return base, offs, offs_n, kmask


@triton.jit
def _load_tile(X, base, offs, kmask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(X + base + offs, mask=kmask[:, None], other=0.0)
    else:
        return tl.load(X + base + offs)


@triton.jit
def _kv_tile(K, V, BlockTable, bt_row, n, lo_key, hi_key, kv_head_off, stride_kp, stride_ks,
             HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr):
    base, offs, offs_n, kmask = _kv_offsets(BlockTable, bt_row, n, lo_key, hi_key, kv_head_off,
                                            stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                            MASKED)
    k = _load_tile(K, base, offs, kmask, MASKED)
    v = _load_tile(V, base, offs, kmask, MASKED)
    return k, v, offs_n, kmask


@triton.jit
def _load_q(Q, q0, tok, head, valid, sm_scale_log2, stride_qt, stride_qh, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(ptrs + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    return (q.to(tl.float32) * sm_scale_log2).to(Q.dtype.element_ty)
