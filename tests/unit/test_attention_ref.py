"""The torch reference backend against a dense float64 attention written out by hand."""

from __future__ import annotations

import numpy as np
import torch

from specserve.attention.base import AttnBatch, causal_bits
from specserve.attention.torch_ref import torch_ref_attention
from specserve.spec.tree import DraftTree, mask_to_dense, verify_layout


def _dense(q, k, v, visible, scale):  # q [n,H,D], k/v [L,H,D], visible [n,L]
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


def test_tree_masks_gqa_and_windows_against_dense():
    g = torch.Generator().manual_seed(0)
    page, hkv, hq, d = 4, 2, 6, 8
    trees = [DraftTree(np.array([5, 6, 7, 8, 9]), np.array([0, 1, 1, 0, 4], dtype=np.int32),
                       np.array([1, 2, 2, 1, 2], dtype=np.int32)), None]
    ctx, q_lens = [13, 6], [6, 3]
    layouts = [verify_layout(trees[0], 1, ctx[0]), None]
    k_pool = torch.randn(12, page, hkv, d, generator=g, dtype=torch.float64)
    v_pool = torch.randn(12, page, hkv, d, generator=g, dtype=torch.float64)
    tables = [[7, 2, 9, 0, 11], [4, 10, 3]]
    positions = np.concatenate([layouts[0].positions, np.arange(6, 9)])
    masks = [layouts[0].mask, causal_bits(3)]
    batch = AttnBatch.build(q_lens, ctx, tables, positions, page, masks)
    q = torch.randn(9, hq, d, generator=g, dtype=torch.float64)
    for window in (None, 5):
        out = torch_ref_attention(q, k_pool, v_pool, batch, 0.3, window)
        for b in range(2):
            rows = slice(sum(q_lens[:b]), sum(q_lens[:b + 1]))
            ref = _dense_request(q, k_pool, v_pool, batch, tables[b], masks[b], b, 0.3, window)
            torch.testing.assert_close(out[rows], ref)


def _dense_request(q, k_pool, v_pool, batch, table, mask, b, scale, window=None):
    """Request b's rows of the batch by hand: its slots, its dense mask, `_dense`."""
    n, c, page = batch.q_lens[b], batch.ctx_lens[b], batch.page_size
    hq, (hkv, d) = q.shape[1], k_pool.shape[2:]
    rows = slice(sum(batch.q_lens[:b]), sum(batch.q_lens[:b + 1]))
    slots = [table[p // page] * page + p % page for p in range(c + n)]
    k = k_pool.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
    v = v_pool.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
    new = mask_to_dense(mask, n) if mask is not None else np.tril(np.ones((n, n), bool))
    vis = torch.from_numpy(np.concatenate([np.ones((n, c), bool), new], 1))
    if window is not None:
        qp = batch.positions[rows]
        kp = torch.cat([torch.arange(c), qp])
        vis &= (qp[:, None] - kp[None]) < window
    return _dense(q[rows], k, v, vis, scale)


def test_requests_of_one_shape_batched_against_dense(monkeypatch):
    """Five requests of one shape (different trees, pages), one causal of that shape, one of
    another: groups of at most two run as batched calls, each request equal to the dense one."""
    import specserve.attention.torch_ref as ref_mod

    g, rng = torch.Generator().manual_seed(5), np.random.default_rng(5)
    page, hkv, hq, d, n = 4, 2, 6, 8, 6
    q_lens, ctx = [n] * 6 + [3], [9] * 6 + [14]
    trees = [DraftTree(rng.integers(0, 50, 5), np.array([0, 1, p, 0, 4], dtype=np.int32),
                       np.array([1, 2, p + 1, 1, 2], dtype=np.int32)) for p in (1, 2, 0, 1, 2)]
    layouts = [verify_layout(t, 1, 9) for t in trees]
    masks = [lay.mask for lay in layouts] + [None, None]
    positions = np.concatenate([lay.positions for lay in layouts] + [np.arange(9, 15),
                                                                     np.arange(14, 17)])
    perm = rng.permutation(40).tolist()
    tables = [perm[5 * b : 5 * b + 5] for b in range(7)]
    batch = AttnBatch.build(q_lens, ctx, tables, positions, page, masks)
    k_pool, v_pool = (torch.randn(40, page, hkv, d, generator=g, dtype=torch.float64)
                      for _ in range(2))
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64)
    monkeypatch.setattr(ref_mod, "GROUP_SCORES", 3 * hq * n * (9 + n) - 1)
    assert sorted(map(sorted, ref_mod.same_shapes(batch, None, hq))) == [
        [0, 1], [2, 3], [4, 5], [6]]
    out = torch_ref_attention(q, k_pool, v_pool, batch, 0.3)
    for b in range(7):
        rows = slice(sum(q_lens[:b]), sum(q_lens[:b + 1]))
        ref = _dense_request(q, k_pool, v_pool, batch, tables[b], masks[b], b, 0.3)
        torch.testing.assert_close(out[rows], ref)


def test_causal_bits_match_tril():
    # 70 first: the shorter runs are views of its table, 130 makes a larger one
    for n in (70, 1, 5, 31, 32, 33, 130, 64, 65):
        bits = causal_bits(n)
        assert bits.dtype == np.uint32 and bits.shape == (n, (n + 31) // 32)
        assert (mask_to_dense(bits, n) == np.tril(np.ones((n, n), bool))).all()
        assert not bits.flags.writeable  # a shared table: nobody may write into it


def test_windowed_causal_chunk_in_row_tiles_against_dense(monkeypatch):
    """A causal chunk under a window runs in TILE-row tiles (each over the keys it can see)."""
    import specserve.attention.torch_ref as ref_mod

    monkeypatch.setattr(ref_mod, "TILE", 7)
    g = torch.Generator().manual_seed(3)
    page, hkv, hq, d, ctx, n, window = 4, 2, 4, 8, 11, 30, 9
    k_pool = torch.randn(16, page, hkv, d, generator=g, dtype=torch.float64)
    v_pool = torch.randn(16, page, hkv, d, generator=g, dtype=torch.float64)
    table = [int(p) for p in torch.randperm(16, generator=g)[:11]]
    batch = AttnBatch.build([n], [ctx], [table], np.arange(ctx, ctx + n), page)
    assert len(ref_mod.row_tiles(batch, 0, window)) == 5
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    out = torch_ref_attention(q, k_pool, v_pool, batch, 0.25, window)
    slots = [table[p // page] * page + p % page for p in range(ctx + n)]
    k = k_pool.view(-1, hkv, d)[slots].repeat_interleave(2, 1)
    v = v_pool.view(-1, hkv, d)[slots].repeat_interleave(2, 1)
    qp, kp = torch.arange(ctx, ctx + n), torch.arange(ctx + n)
    vis = (kp[None] <= qp[:, None]) & ((qp[:, None] - kp[None]) < window)
    torch.testing.assert_close(out, _dense(q, k, v, vis, 0.25))
