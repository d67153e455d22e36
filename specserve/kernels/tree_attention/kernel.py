"""Triton tree-verify attention over a paged KV pool: split-KV prefix + tree tail, then combine.

Owns the attention kernel and the launcher; the merge is `combine.py`, the
per-batch launch plan (config, splits, grid, scratch) `plan.py`, the tile helpers `tiles.py`.
Kernel A (`_tree_attn_kernel`), grid (row-block r, request b · kv head h, part s) with r
fastest, so the R row blocks of one KV chunk run side by side and share it through L2, and
parts outermost, so the short tree-tail programs are scheduled after every prefix split
(interleaved with them, a tail could hold an SM that a prefix split of a one-wave grid then
waits for: BENCHMARKS.md, "Tree-verify attention kernel — third H200 run"). Rows are GQA-packed (new
token, q head in group), head fastest, so each prefix K/V tile is read once per kv head for all
rows of a block. Parts s < S are prefix splits: the split range is computed on device from
ctx_lens (chunk = round_up(cdiv(span, S), BLOCK_N)); full prefix tiles carry no mask ops; empty
splits write lse = −inf. Part s = S is the tree tail: the request's new tokens as keys under the
ancestor bitmask (causal without one).
Every part writes a normalised fp32 partial O and its log2-domain LSE; kernel B merges them
(combine.py: by blocks of rows for plans of few parts, by row for many, in one round of loads
for the measured long-context 64-row plans — configs.combine_shot_rows). On sm_90+ both use
programmatic dependent launch: each waits (griddepcontrol.wait) for the kernel before it, then
lets the next one become resident, so their launch gaps overlap work; the one-round combine
lets the next kernel launch before its wait, and beside a one-CTA-per-SM plan
(configs.one_cta_splits) it is resident, waiting, while the attention kernel runs.
Scores live in the log2 domain (q pre-scaled by scale·log2 e), accumulation is fp32.

Pipelining: K/V addresses come from a block-table load, and Triton's pipeliner splits num_stages
over that indirection — each load gets (num_stages − 1) // 2 iterations of latency. At 3 stages
the hot loop waits for every tile it just issued (no overlap: a fraction of copy bandwidth;
BENCHMARKS.md, "Figures formerly in source comments"); the tables use 5 (two K/V tiles in
flight). Check `async_wait {num = …}` in the TTGIR.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.tree_attention import check_inputs
from specserve.kernels.tree_attention.combine import combine, combine_rows, combine_shot
from specserve.kernels.tree_attention.configs import Config
from specserve.kernels.tree_attention.plan import plan_launch, scratch
from specserve.kernels.tree_attention.tiles import _dot, _load_q, _online_update, _prefix_tile

LOG2E = 1.4426950408889634
LAST_LAUNCH: dict = {}  # the last compiled kernels launched (benchmarks read n_regs / spills)


_NO_SPEC = ["window", "h_kv", "stride_bt", "stride_mt", "stride_ls", "stride_lt"]  # one compile


@triton.jit(do_not_specialize=_NO_SPEC)
def _tree_attn_kernel(
    Q, K, V, BlockTable, CuQ, CtxLens, Positions, TreeMask, OPart, LsePart,
    sm_scale_log2, window, h_kv,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, SLIDING: tl.constexpr,
    HAS_TREE: tl.constexpr, MASK_ALL: tl.constexpr, DOT_PREC: tl.constexpr,
    ROW_WORDS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the combine may become resident (it waits)
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    part = tl.program_id(2)  # parts outermost: the tree tails are scheduled last
    b = bh // h_kv
    h = bh % h_kv
    q0 = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q0
    row0 = rb * BLOCK_M
    if row0 < q_len * GROUP:
        _attend(Q, K, V, BlockTable, CtxLens, Positions, TreeMask, OPart, LsePart,
                sm_scale_log2, window, b, h, q0, q_len, row0, part, tl.num_programs(2) - 1,
                stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, TAIL_N, SLIDING, HAS_TREE,
                MASK_ALL, DOT_PREC, ROW_WORDS)


@triton.jit
def _attend(
    Q, K, V, BlockTable, CtxLens, Positions, TreeMask, OPart, LsePart,
    sm_scale_log2, window, b, h, q0, q_len, row0, part, num_splits,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, SLIDING: tl.constexpr,
    HAS_TREE: tl.constexpr, MASK_ALL: tl.constexpr, DOT_PREC: tl.constexpr,
    ROW_WORDS: tl.constexpr,
):
    """Part `part` of BLOCK_M packed rows from row0 — prefix split `part` < S, or the tree tail
    (part S) — written as a normalised partial O and its LSE."""
    rows = row0 + tl.arange(0, BLOCK_M)  # packed (token, head) rows
    tok = rows // GROUP
    head = h * GROUP + rows % GROUP
    valid = tok < q_len
    flat = q0 + tok
    q = _load_q(Q, q0, tok, head, valid, sm_scale_log2, stride_qt, stride_qh, HEAD_DIM)
    ctx = tl.load(CtxLens + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = b * stride_bt
    kv_head_off = h * stride_kh
    if SLIDING:
        q_pos = tl.load(Positions + flat, mask=valid, other=2**31 - 1).to(tl.int32)
    else:
        q_pos = tok
    if part < num_splits:
        m_i, l_i, acc = _prefix_split(
            q, m_i, l_i, acc, K, V, BlockTable, bt_row, ctx, q_pos, window, kv_head_off, part,
            num_splits, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, SLIDING, MASK_ALL,
            DOT_PREC)
    else:
        m_i, l_i, acc = _tree_tail(
            q, m_i, l_i, acc, K, V, BlockTable, TreeMask, Positions, bt_row, ctx, q0, q_len,
            row0, tok, flat, valid, q_pos, window, kv_head_off, stride_kp, stride_ks, stride_mt,
            GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_M, TAIL_N, SLIDING, HAS_TREE, DOT_PREC, ROW_WORDS)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = OPart + part * stride_os + flat[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], o, mask=valid[:, None])
    tl.store(LsePart + part * stride_ls + flat * stride_lt + head, lse, mask=valid)


@triton.jit
def _prefix_split(q, m_i, l_i, acc, K, V, BlockTable, bt_row, ctx, q_pos, window, kv_head_off,
                  part, num_splits, stride_kp, stride_ks,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  SLIDING: tl.constexpr, MASK_ALL: tl.constexpr, DOT_PREC: tl.constexpr):
    """Split `part` of `num_splits` of the paged prefix [0, ctx), range derived on device.
    MASK_ALL (fp32 inputs): no unmasked hot loop beside the masked last tile — one loop body;
    the FMA-dot (ieee) kernels then need half the registers (sm_120, D = 256: 255 + 564 B of
    spill → 103, none)."""
    if SLIDING:  # noqa: SIM108 — keys below every row's window are never read
        start = tl.minimum(tl.maximum(tl.min(q_pos, 0) - window + 1, 0), ctx)
    else:
        start = 0
    base = start // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(ctx - base, num_splits), BLOCK_N) * BLOCK_N
    lo = base + part * chunk
    hi = tl.minimum(lo + chunk, ctx)
    if SLIDING or MASK_ALL:  # one loop body, every tile masked
        for n in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _prefix_tile(
                q, m_i, l_i, acc, K, V, BlockTable, bt_row, n, start, hi, q_pos, window,
                kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, SLIDING,
                DOT_PREC)
    else:
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for n in range(lo, full, BLOCK_N):  # the hot loop: no mask ops
            m_i, l_i, acc = _prefix_tile(
                q, m_i, l_i, acc, K, V, BlockTable, bt_row, n, lo, hi, q_pos, window,
                kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False,
                DOT_PREC)
        if full < hi:
            m_i, l_i, acc = _prefix_tile(
                q, m_i, l_i, acc, K, V, BlockTable, bt_row, full, lo, hi, q_pos, window,
                kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, False,
                DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _tree_tail(q, m_i, l_i, acc, K, V, BlockTable, TreeMask, Positions, bt_row, ctx, q0, q_len,
               row0, tok, flat, valid, q_pos, window, kv_head_off, stride_kp, stride_ks,
               stride_mt, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_M: tl.constexpr, TAIL_N: tl.constexpr, SLIDING: tl.constexpr,
               HAS_TREE: tl.constexpr, DOT_PREC: tl.constexpr, ROW_WORDS: tl.constexpr):
    """The new tokens as keys (they sit at ctx + j in the pool) under the ancestor bitmask, or
    causal without one. ROW_WORDS: the tile's mask as one word per row, shifted per key
    (faster at short context: BENCHMARKS.md, "Tree tail: one mask word per row", and "Figures
    formerly in source comments"), else a word per (row, key) loaded in the scores' layout
    (sm_120: the broadcast spills)."""
    if HAS_TREE:  # noqa: SIM108 — constexpr branches
        n_keys = q_len
    else:  # causal: no key beyond the block's last token
        n_keys = tl.minimum(q_len, (row0 + BLOCK_M - 1) // GROUP + 1)
    offs_d = tl.arange(0, HEAD_DIM)
    for j0 in range(0, n_keys, TAIL_N):
        offs_j = j0 + tl.arange(0, TAIL_N)
        jmask = offs_j < n_keys
        kpos = ctx + offs_j
        page = tl.load(BlockTable + bt_row + kpos // PAGE_SIZE, mask=jmask, other=0)
        tok_off = page * stride_kp + (kpos % PAGE_SIZE) * stride_ks + kv_head_off
        offs = tok_off[:, None] + offs_d[None, :]
        k = tl.load(K + offs, mask=jmask[:, None], other=0.0)
        v = tl.load(V + offs, mask=jmask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_PREC)  # [BLOCK_M, TAIL_N]
        if HAS_TREE and ROW_WORDS:  # one mask word per row covers the tile (TAIL_N | 32)
            word = tl.load(TreeMask + flat * stride_mt + (j0 >> 5), mask=valid, other=0)
            bits = (j0 & 31) + tl.arange(0, TAIL_N)
            vis = ((word[:, None] >> bits[None, :]) & 1) != 0
        elif HAS_TREE:  # a word per (row, key), in the scores' layout (fewer registers)
            w_ptrs = TreeMask + flat[:, None] * stride_mt + (offs_j >> 5)[None, :]
            words = tl.load(w_ptrs, mask=valid[:, None] & jmask[None, :], other=0)
            vis = ((words >> (offs_j & 31)[None, :]) & 1) != 0
        else:
            vis = offs_j[None, :] <= tok[:, None]
        vis = vis & jmask[None, :]
        if SLIDING:
            k_pos = tl.load(Positions + q0 + offs_j, mask=jmask, other=0)
            vis = vis & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_update(s, m_i, l_i, acc, v, True, DOT_PREC)
    return m_i, l_i, acc


def tree_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, page_size, Hkv, D] (new tokens' K already written)
    v_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    batch,  # specserve.attention.base.AttnBatch
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_ctx_len: int | None = None,
    config: Config | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D] written in place when given
    options: dict | None = None,  # A/B runs: plan.OPTIONS (e.g. {"pdl": False})
) -> torch.Tensor:  # [T, Hq, D]
    """Tree-verify attention; see the module docstring.

    No host sync: sizes come from the host tuples `batch.q_lens` / `batch.ctx_lens`. The grid is
    (cdiv(max q_len·G, BLOCK_M), S + 1, B·Hkv); split ranges are derived on device, so any
    ctx_lens give correct results for any S. For CUDA graphs pass `max_ctx_len` (the longest
    context the graph will replay at) or an explicit `num_splits`: S then does not depend on the
    capture-time contexts, and a graph captured short replays long with the same S.

    Per-layer host cost: everything derived from the batch (validation, config, splits, grid)
    is planned on the first call and memoised in `batch.memo` (every layer of a forward shares
    the batch), and the fp32 partial-result scratch is allocated once per batch and reused by
    every layer — safe because all layers run in order on one stream.
    """
    check_inputs(q, k_pool, v_pool, batch, sliding_window, num_splits)
    t, hq, d = q.shape
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {q.dtype} {tuple(q.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if t == 0:
        return out
    opts = tuple(sorted((options or {}).items()))
    key = ("plan", q.shape, k_pool.shape, q.dtype, q.device, sliding_window, num_splits,
           max_ctx_len, config, opts)
    plan = batch.memo.get(key)
    if plan is None:
        plan = batch.memo[key] = plan_launch(q, k_pool, batch, sliding_window, num_splits,
                                             max_ctx_len, config, dict(opts))
    o_part, lse_part = scratch(batch, plan.parts, t, hq, d, q.device)
    _launch(plan, q, k_pool, v_pool, batch, scale, o_part, lse_part, sliding_window)
    merge(plan, o_part, lse_part, out)
    return out


def _launch(plan, q, k_pool, v_pool, batch, scale, o_part, lse_part, sliding_window) -> None:
    """The attention kernel's launch over the plan's grid, partial results into the parts."""
    (_, hq, d), cfg, hkv, tree = q.shape, plan.config, plan.hkv, plan.tree
    LAST_LAUNCH["attn"] = _tree_attn_kernel[plan.grid](
        q, k_pool, v_pool, batch.block_table, batch.cu_q, batch.ctx_lens_t, batch.positions,
        tree, o_part, lse_part,
        scale * LOG2E, plan.window, hkv,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        batch.block_table.stride(0), tree.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, PAGE_SIZE=k_pool.shape[1], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, TAIL_N=plan.tail_n, SLIDING=sliding_window is not None,
        HAS_TREE=batch.tree_mask is not None, MASK_ALL=q.dtype == torch.float32,
        DOT_PREC=plan.dot_prec, ROW_WORDS=plan.row_words, USE_PDL=plan.use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=plan.use_pdl,
    )


def merge(plan, o_part, lse_part, out) -> None:
    """The plan's combine of the parts into `out`."""
    if plan.combine_shot:
        combine_shot(o_part, lse_part, out, plan.parts, plan.combine_shot, plan.use_pdl,
                     plan.trigger_first)
    elif plan.combine_rows is not None:
        combine_rows(o_part, lse_part, out, plan.parts, plan.combine_rows, plan.use_pdl,
                     plan.trigger_first)
    else:
        combine(o_part, lse_part, out, plan.parts, plan.block_s, plan.lse_block, plan.use_pdl,
                plan.trigger_first)
