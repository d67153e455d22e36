"""Warm-up shapes for `attention.prefill`: chunks on random K/V that build cuDNN's plans and
compile the merge kernel before a server takes requests — the regular chunks' per-shape plans
and one chunk of every ragged plan class (`ragged_shapes`) — and the random chunks themselves
(`random_chunks`, also the engine warm-up's causal chunks through the tree kernel).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.attention import prefill
from specserve.attention.base import AttnBatch


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device | str, page_size: int = 16, chunk: int | None = None,
            max_len: int | None = None) -> bool:
    """Chunks on random K/V (not the model's pool): compiles the merge kernel and initialises
    cuDNN's attention (seconds on the H200's first call, else paid by the first long prompt;
    BENCHMARKS.md, "Figures formerly in source comments"). With `chunk` and `max_len` (the
    engine's prefill chunk and longest context) also every regular chunk of a max_len prompt,
    so their per-shape plans (`per_shape_plan`) are built here rather than by the first long
    prompt, and a chunk of every ragged plan class (`ragged_shapes`), whose plans the chunks
    cut beside decoding requests would otherwise build inside those requests' steps. False
    when the backend never takes a chunk of this model (dtype / head_dim)."""

    def flop(n: int, prefix: int) -> float:
        return 4 * num_heads * head_dim * n * (n / 2 + prefix)

    shapes = [(1024, 9216)]  # ≥ MIN_FLOP from 8 heads of 128
    if chunk is not None and max_len is not None:  # the chunks cuDNN would take, if regular
        shapes += [(chunk, k * chunk) for k in range(max_len // chunk) if flop(chunk, k * chunk)
                   >= prefill.MIN_FLOP and prefill.per_shape_plan(chunk, k * chunk)]
        shapes += ragged_shapes(chunk, max_len, flop)
    chunks = random_chunks(shapes, num_heads, num_kv_heads, head_dim, dtype, device, page_size)
    for (n, prefix), (q, k, v, batch) in zip(shapes, chunks, strict=True):
        plan = prefill.plan_prefill(q, batch, None,
                                    min_flop=min(flop(n, prefix), prefill.MIN_FLOP))
        if plan is None:
            return False
        batch.memo[prefill.plan_key(q, None)] = plan
        prefill.prefill_attention(q, k, v, batch, head_dim ** -0.5)
    return True


def ragged_shapes(chunk: int, max_len: int, flop) -> list[tuple[int, int]]:
    """(new tokens, prefix) of one chunk per ragged plan class cuDNN can meet beside the
    regular chunks: its calls' lengths rounded up to powers of two — the chunk's (≤ `chunk`)
    and the prefix's (0: at the prompt's start), within `max_len` — where the chunk's attention
    `flop(n, prefix)` reaches MIN_FLOP. A class's chunk is its longest within `max_len`."""
    out = []
    for c2 in _powers_to(chunk):
        for p2 in [0, *_powers_to(max_len)]:
            n = min(c2, chunk, max_len - (p2 // 2 + 1 if p2 else 0))
            p = min(p2, max_len - n)
            if prefill.regular_chunk(n, p):  # a dense plan (per_shape_plan), not a ragged one
                n -= 1
            if n > c2 // 2 and (p > p2 // 2 or p2 == 0) and flop(n, p) >= prefill.MIN_FLOP:
                out.append((n, p))
    return out


def _powers_to(x: int) -> list[int]:
    """1, 2, 4, … up to the first power of two ≥ x."""
    return [1 << i for i in range(max(x - 1, 0).bit_length() + 1)]


def random_chunks(shapes, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str, page_size: int):
    """For warm-ups: random K/V pools and q (seed 0, not the model's) big enough for every
    chunk of `shapes` — (new tokens, prefix) pairs — then, per chunk, (q [n, Hq, D], k_pool,
    v_pool, its one-request causal batch over the pools' first pages)."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(0)
    pages = -(-max(c + p for c, p in shapes) // page_size)
    k, v = (torch.randn(pages, page_size, num_kv_heads, head_dim, generator=gen, device=device,
                        dtype=dtype) for _ in range(2))
    q = torch.randn(max(c for c, _ in shapes), num_heads, head_dim, generator=gen, device=device,
                    dtype=dtype)
    for n, prefix in shapes:
        batch = AttnBatch.build([n], [prefix], [list(range(pages))],
                                np.arange(prefix, prefix + n), page_size, None, device=device)
        yield q[:n], k, v, batch
