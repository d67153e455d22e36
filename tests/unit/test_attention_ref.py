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
            n, c = q_lens[b], ctx[b]
            pos = np.arange(c + n)
            slots = [tables[b][p // page] * page + p % page for p in pos]
            k = k_pool.view(-1, hkv, d)[slots].repeat_interleave(3, 1)
            v = v_pool.view(-1, hkv, d)[slots].repeat_interleave(3, 1)
            new = mask_to_dense(masks[b], n) if b == 0 else np.tril(np.ones((n, n), bool))
            vis = torch.from_numpy(np.concatenate([np.ones((n, c), bool), new], 1))
            if window is not None:
                qp = torch.as_tensor(positions[sum(q_lens[:b]):sum(q_lens[:b + 1])])
                kp = torch.cat([torch.arange(c), qp])
                vis &= (qp[:, None] - kp[None]) < window
            ref = _dense(q[sum(q_lens[:b]):sum(q_lens[:b + 1])], k, v, vis, 0.3)
            torch.testing.assert_close(out[sum(q_lens[:b]):sum(q_lens[:b + 1])], ref)


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
