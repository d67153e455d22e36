"""The parts of a tree-attention program (kernel.py `_attend`): a prefix split or the tree tail.

Owns the loops over K/V tiles: `_prefix_split` (split `part` of the paged prefix, its range
derived on device), `_prefix_split_rem` (the same for a row block plus the request's remainder
rows — the ≤ REM_M packed rows past its last full row block — from the same K/V tiles: a 65-node
tree at 4 q heads per KV head is 2 × 128 rows + 4, and those 4 then cost a 16-row dot per tile
instead of a third 128-row block streaming the whole prefix again) and `_tree_tail` (the new
tokens as keys under the ancestor bitmask). The tile math is tiles.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tree_attention.tiles import _dot, _online_update, _prefix_tile, _prefix_tile_rem


@triton.jit
def _split_range(ctx, q_pos, window, part, num_splits, BLOCK_N: tl.constexpr,
                 SLIDING: tl.constexpr):
    """(first visible key, lo, hi) of split `part`: chunks of round_up(cdiv(span, S), BLOCK_N)
    keys from the first BLOCK_N-aligned visible key."""
    if SLIDING:  # noqa: SIM108 — keys below every row's window are never read
        start = tl.minimum(tl.maximum(tl.min(q_pos, 0) - window + 1, 0), ctx)
    else:
        start = 0
    base = start // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(ctx - base, num_splits), BLOCK_N) * BLOCK_N
    lo = base + part * chunk
    return start, lo, tl.minimum(lo + chunk, ctx)


@triton.jit
def _prefix_split(q, m_i, l_i, acc, K, V, BlockTable, bt_row, ctx, q_pos, window, kv_head_off,
                  part, num_splits, stride_kp, stride_ks,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  SLIDING: tl.constexpr, MASK_ALL: tl.constexpr, DOT_PREC: tl.constexpr):
    """Split `part` of `num_splits` of the paged prefix [0, ctx), range derived on device.
    MASK_ALL (fp32 inputs): no unmasked hot loop beside the masked last tile — one loop body;
    the FMA-dot (ieee) kernels then need half the registers (sm_120, D = 256: 255 + 564 B of
    spill → 103, none)."""
    start, lo, hi = _split_range(ctx, q_pos, window, part, num_splits, BLOCK_N, SLIDING)
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
def _prefix_split_rem(q, m_i, l_i, acc, qr, mr, lr, accr, K, V, BlockTable, bt_row, ctx, window,
                      kv_head_off, part, num_splits, stride_kp, stride_ks,
                      HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASK_ALL: tl.constexpr, DOT_PREC: tl.constexpr):
    """`_prefix_split` for a row block (q) and the remainder rows (qr) together."""
    start, lo, hi = _split_range(ctx, 0, window, part, num_splits, BLOCK_N, False)
    if MASK_ALL:  # one loop body, every tile masked
        for n in range(lo, hi, BLOCK_N):
            m_i, l_i, acc, mr, lr, accr = _prefix_tile_rem(
                q, m_i, l_i, acc, qr, mr, lr, accr, K, V, BlockTable, bt_row, n, lo, hi,
                window, kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
                DOT_PREC)
    else:
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for n in range(lo, full, BLOCK_N):  # the hot loop: no mask ops
            m_i, l_i, acc, mr, lr, accr = _prefix_tile_rem(
                q, m_i, l_i, acc, qr, mr, lr, accr, K, V, BlockTable, bt_row, n, lo, hi,
                window, kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, False,
                DOT_PREC)
        if full < hi:
            m_i, l_i, acc, mr, lr, accr = _prefix_tile_rem(
                q, m_i, l_i, acc, qr, mr, lr, accr, K, V, BlockTable, bt_row, full, lo, hi,
                window, kv_head_off, stride_kp, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
                DOT_PREC)
    return m_i, l_i, acc, mr, lr, accr


@triton.jit
def _tree_tail(q, m_i, l_i, acc, K, V, BlockTable, TreeMask, Positions, bt_row, ctx, q0, q_len,
               row0, tok, flat, valid, q_pos, window, kv_head_off, stride_kp, stride_ks,
               stride_mt, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_M: tl.constexpr, TAIL_N: tl.constexpr, SLIDING: tl.constexpr,
               HAS_TREE: tl.constexpr, DOT_PREC: tl.constexpr, ROW_WORDS: tl.constexpr):
    """The new tokens as keys (they sit at ctx + j in the pool) under the ancestor bitmask, or
    causal without one. ROW_WORDS: the tile's mask as one word per row, shifted per key (H200,
    1k context, 65 nodes: 26.1 → 20.6 µs a call; the tail alone 28.5 → 17.0), else a word per
    (row, key) loaded in the scores' layout (sm_120: the broadcast spills)."""
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
