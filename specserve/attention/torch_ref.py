"""Reference attention backend in plain torch: gather each request's pages, mask, softmax.

Obviously right and slow; the CPU backend and the oracle for the Triton kernel. Math is done in
float32 (float64 if the inputs are float64) whatever the input dtype.
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttnBatch


def first_key(batch: AttnBatch, b: int, sliding_window: int | None) -> int:
    """First prefix position any new token of request `b` can see (0 without a window).

    Prefix positions below it may live in freed pages (a drafter's sliding layers): never read.
    """
    if sliding_window is None or batch.q_lens[b] == 0:
        return 0
    q0 = int(batch.cu_q[b])
    lowest = int(batch.positions[q0 : q0 + batch.q_lens[b]].min())
    return min(max(0, lowest - sliding_window + 1), batch.ctx_lens[b])


def visible_mask(
    batch: AttnBatch, b: int, sliding_window: int | None, k0: int = 0
) -> torch.Tensor:  # [q_len, ctx_len - k0 + q_len] bool
    """Which keys (prefix positions [k0, ctx), then new tokens) each new token of `b` sees."""
    q0, q1 = int(batch.cu_q[b]), int(batch.cu_q[b + 1])
    n, ctx = q1 - q0, batch.ctx_lens[b]
    device = batch.cu_q.device
    rows = torch.arange(n, device=device)
    if batch.tree_mask is None:
        new = rows[None, :] <= rows[:, None]
    else:
        words = batch.tree_mask[q0:q1, rows // 32]  # [n, n] word holding bit j for row i
        new = ((words >> (rows % 32)[None, :]) & 1).bool()
    mask = torch.cat([torch.ones(n, ctx - k0, dtype=torch.bool, device=device), new], dim=1)
    if sliding_window is not None:
        q_pos = batch.positions[q0:q1]
        k_pos = torch.cat([torch.arange(k0, ctx, device=device), q_pos])
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return mask


def gather_kv(
    pool: torch.Tensor, batch: AttnBatch, b: int, length: int, k0: int = 0
) -> torch.Tensor:
    """Positions [k0, length) of request `b` from a paged pool `[P, S, H, D]` → `[L, H, D]`."""
    ps = batch.page_size
    pos = torch.arange(k0, length, device=pool.device)
    pages = batch.block_table[b, pos // ps].long()
    return pool[pages, pos % ps]


def torch_ref_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, S, Hkv, D]
    v_pool: torch.Tensor,  # [P, S, Hkv, D]
    batch: AttnBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_pool.shape[2]
    for b in range(batch.batch_size):
        q0, q1 = int(batch.cu_q[b]), int(batch.cu_q[b + 1])
        if q1 == q0:
            continue
        length = batch.ctx_lens[b] + (q1 - q0)
        k0 = first_key(batch, b, sliding_window)
        k = gather_kv(k_pool, batch, b, length, k0).to(acc_dtype)  # [L, Hkv, D]
        v = gather_kv(v_pool, batch, b, length, k0).to(acc_dtype)
        k = k.repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        qb = q[q0:q1].to(acc_dtype)  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qb, k) * scale  # [Hq, n, L]
        mask = visible_mask(batch, b, sliding_window, k0)  # [n, L]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out
