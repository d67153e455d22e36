"""Reference attention backend in plain torch: gather each request's pages, mask, softmax.

Obviously right and slow; the CPU backend and the oracle for the Triton kernel. Requests of
one shape (new tokens, prefix; no window) run as one batched call: the same gather, mask and
softmax with a leading request dim, so a step of many short requests is not a Python loop.
Math is done in float32 (float64 if the inputs are float64) whatever the input dtype. One
shortcut more: a causal chunk under a sliding window runs in tiles of TILE query rows, each
over the keys its rows can see, so a long prefill chunk costs O(rows × (window + TILE)), not
O(rows²).
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttnBatch

TILE = 512  # query rows per tile of a causal windowed chunk
GROUP_SCORES = 1 << 22  # most scores (heads × rows × keys) of one batched call of a group


def first_key(batch: AttnBatch, b: int, sliding_window: int | None,
              rows: tuple[int, int] | None = None) -> int:
    """First prefix position any new token of request `b` (of its `rows` [r0, r1), default
    all) can see (0 without a window).

    Prefix positions below it may live in freed pages (a drafter's sliding layers): never read.
    """
    r0, r1 = rows or (0, batch.q_lens[b])
    if sliding_window is None or r1 == r0:
        return 0
    q0 = int(batch.cu_q[b])
    lowest = int(batch.positions[q0 + r0 : q0 + r1].min())
    return min(max(0, lowest - sliding_window + 1), batch.ctx_lens[b])


def visible_mask(
    batch: AttnBatch, b: int, sliding_window: int | None, k0: int = 0,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:  # [r1 - r0, ctx_len - k0 + new keys] bool
    """Which keys (prefix positions [k0, ctx), then new tokens) each new token of `b` (of its
    `rows` [r0, r1), default all) sees. New keys: all q_len, or (causal) the first r1."""
    q0, n = int(batch.cu_q[b]), batch.q_lens[b]
    r0, r1 = rows or (0, n)
    ctx, device = batch.ctx_lens[b], batch.cu_q.device
    mine = torch.arange(r0, r1, device=device)
    if batch.tree_mask is None:
        keys = torch.arange(r1, device=device)
        new = keys[None, :] <= mine[:, None]
    else:
        keys = torch.arange(n, device=device)
        words = batch.tree_mask[q0 + r0 : q0 + r1, keys // 32]  # word holding bit j for row i
        new = ((words >> (keys % 32)[None, :]) & 1).bool()
    mask = torch.cat([torch.ones(r1 - r0, ctx - k0, dtype=torch.bool, device=device), new], 1)
    if sliding_window is not None:
        q_pos = batch.positions[q0 + r0 : q0 + r1]
        k_pos = torch.cat([torch.arange(k0, ctx, device=device),
                           batch.positions[q0 : q0 + keys.shape[0]]])
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return mask


def row_tiles(batch: AttnBatch, b: int, sliding_window: int | None) -> list[tuple[int, int]]:
    """Query-row ranges of request `b`: TILE-row tiles for a causal windowed chunk, else one."""
    n = batch.q_lens[b]
    if sliding_window is None or batch.tree_mask is not None or n <= TILE:
        return [(0, n)]
    return [(r, min(r + TILE, n)) for r in range(0, n, TILE)]


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
    for group in same_shapes(batch, sliding_window, q.shape[1]):
        b = group[0]
        if batch.q_lens[b] == 0:
            continue
        if len(group) > 1:
            _group_attention(q, k_pool, v_pool, batch, group, scale, out, acc_dtype)
            continue
        for rows in row_tiles(batch, b, sliding_window):
            _rows_attention(q, k_pool, v_pool, batch, b, rows, scale, sliding_window, out,
                            acc_dtype)
    return out


def same_shapes(batch: AttnBatch, sliding_window: int | None, heads: int) -> list[list[int]]:
    """Request indices in groups that each run as one batched call: requests of one shape (new
    tokens, prefix), at most GROUP_SCORES scores (heads × rows × keys) a group; under a
    window every request alone."""
    if sliding_window is not None:
        return [[b] for b in range(batch.batch_size)]
    groups: dict[tuple[int, int], list[int]] = {}
    full = []
    for b, (n, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        group = groups.setdefault((n, ctx), [])
        group.append(b)
        if (len(group) + 1) * heads * n * (ctx + n) > GROUP_SCORES:
            full.append(groups.pop((n, ctx)))
    return full + list(groups.values())


def _rows_attention(q, k_pool, v_pool, batch: AttnBatch, b: int, rows: tuple[int, int],
                    scale: float, sliding_window: int | None, out: torch.Tensor,
                    acc_dtype: torch.dtype) -> None:
    """Rows [r0, r1) of request `b` → `out`: gather its keys, mask, softmax."""
    (r0, r1), q0, hq, hkv = rows, int(batch.cu_q[b]), q.shape[1], k_pool.shape[2]
    new_keys = r1 if batch.tree_mask is None else batch.q_lens[b]
    k0 = first_key(batch, b, sliding_window, rows)
    length = batch.ctx_lens[b] + new_keys
    k = gather_kv(k_pool, batch, b, length, k0).to(acc_dtype)  # [L, Hkv, D]
    v = gather_kv(v_pool, batch, b, length, k0).to(acc_dtype)
    k = k.repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(hq // hkv, dim=1)
    qb = q[q0 + r0 : q0 + r1].to(acc_dtype)  # [n, Hq, D]
    scores = torch.einsum("nhd,lhd->hnl", qb, k) * scale  # [Hq, n, L]
    mask = visible_mask(batch, b, sliding_window, k0, rows)  # [n, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out[q0 + r0 : q0 + r1] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


def _group_attention(q, k_pool, v_pool, batch: AttnBatch, group: list[int], scale: float,
                     out: torch.Tensor, acc_dtype: torch.dtype) -> None:
    """Requests `group`, each of n new tokens over a prefix of ctx (no window), in one call:
    the same gather, mask and softmax as `_rows_attention`, with a leading request dim G."""
    device, ps = q.device, batch.page_size
    n, ctx = batch.q_lens[group[0]], batch.ctx_lens[group[0]]
    hq, hkv = q.shape[1], k_pool.shape[2]
    bs = torch.tensor(group, device=device)
    pos = torch.arange(ctx + n, device=device)
    pages = batch.block_table[bs][:, pos // ps].long()  # [G, L]
    k = k_pool[pages, pos % ps].to(acc_dtype).repeat_interleave(hq // hkv, dim=2)  # [G, L, Hq, D]
    v = v_pool[pages, pos % ps].to(acc_dtype).repeat_interleave(hq // hkv, dim=2)
    keys = torch.arange(n, device=device)
    rows = batch.cu_q[bs].long()[:, None] + keys[None, :]  # [G, n] flat row of each new token
    if batch.tree_mask is None:
        new = (keys[None, :] <= keys[:, None]).expand(len(group), n, n)
    else:
        words = batch.tree_mask[rows[:, :, None], (keys // 32)[None, None, :]]  # [G, n, n]
        new = ((words >> (keys % 32)[None, None, :]) & 1).bool()
    prefix = torch.ones(len(group), n, ctx, dtype=torch.bool, device=device)
    mask = torch.cat([prefix, new], 2)  # [G, n, L]
    scores = torch.einsum("gnhd,glhd->ghnl", q[rows].to(acc_dtype), k) * scale  # [G, Hq, n, L]
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out[rows] = torch.einsum("ghnl,glhd->gnhd", probs, v).to(q.dtype)
