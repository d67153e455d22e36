"""Naive Triton tree-verify attention: the benchmark baseline (SGLang `extend_attention` style).

Owns `tree_attention_naive`: one program per (request, query head, block of new tokens), no
split-KV, no GQA packing (each K/V tile is re-read by all G query heads of a group), per-token page
lookups over the whole prefix, mask ops on every tile. Same semantics as the real kernel minus
sliding windows. Only for benchmarks and its test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.tree_attention import check_inputs, fix_interpreter_index
from specserve.kernels.tree_attention.kernel import LOG2E, _dot


@triton.jit
def _naive_tree_kernel(
    Q, K, V, Out, BlockTable, CuQ, CtxLens, TreeMask,
    sm_scale_log2,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q0 = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q0
    if tl.program_id(2) * BLOCK_M < q_len:
        tok = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] new tokens
        valid = tok < q_len
        offs_d = tl.arange(0, HEAD_DIM)
        flat = (q0 + tok).to(tl.int64)
        q = tl.load(Q + flat[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        q = (q.to(tl.float32) * sm_scale_log2).to(Q.dtype.element_ty)
        ctx = tl.load(CtxLens + b)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_head = (head // GROUP) * stride_kh
        for n in range(0, ctx + q_len, BLOCK_N):
            kpos = n + tl.arange(0, BLOCK_N)
            kmask = kpos < ctx + q_len
            page = tl.load(BlockTable + b * stride_bt + kpos // PAGE_SIZE, mask=kmask, other=0)
            off = page.to(tl.int64) * stride_kp + (kpos % PAGE_SIZE) * stride_ks + kv_head
            k = tl.load(K + off[None, :] + offs_d[:, None], mask=kmask[None, :], other=0.0)
            v = tl.load(V + off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            s = _dot(q, k, DOT_PREC)
            j = kpos - ctx  # index among the new tokens (negative on the prefix)
            if HAS_TREE:
                words = tl.load(TreeMask + flat[:, None] * stride_mt + (j >> 5)[None, :],
                                mask=valid[:, None] & (j >= 0)[None, :] & kmask[None, :],
                                other=0)
                new_vis = ((words >> (j & 31)[None, :]) & 1) != 0
            else:
                new_vis = j[None, :] <= tok[:, None]
            vis = kmask[None, :] & ((j < 0)[None, :] | new_vis)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC)
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Out + flat[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None])


def tree_attention_naive(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    v_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    batch,  # specserve.attention.base.AttnBatch
    scale: float,
    block_m: int = 16,
    block_n: int = 64,
) -> torch.Tensor:  # [T, Hq, D]
    """The baseline: grid (B, Hq, cdiv(max q_len, block_m)); no sliding window."""
    check_inputs(q, k_pool, v_pool, batch, None, None)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if not q.is_cuda:
        fix_interpreter_index()
        dot_prec, block_n = "interpret", 16
    hq, d = q.shape[1], q.shape[2]
    tree = batch.tree_mask if batch.tree_mask is not None else batch.cu_q
    grid = (batch.batch_size, hq, triton.cdiv(max(batch.q_lens), block_m))
    _naive_tree_kernel[grid](
        q, k_pool, v_pool, out, batch.block_table, batch.cu_q, batch.ctx_lens_t, tree,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        batch.block_table.stride(0), tree.stride(0),
        GROUP=hq // k_pool.shape[2], HEAD_DIM=d, PAGE_SIZE=k_pool.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, HAS_TREE=batch.tree_mask is not None, DOT_PREC=dot_prec,
        num_warps=4, num_stages=2,
    )
    return out
