"""The top-k log-probabilities of draft logits, reading the logits once (Triton).

`torch.topk` and `torch.logsumexp` over a large vocabulary (Qwen3's 151936) each read every row
with one program per row, at a small fraction of the bandwidth (BENCHMARKS.md, "Where a draft
call's tree build goes", which also says where this kernel pays: `MIN_ROWS`). Here one
program per (row, chunk of BLOCK columns) loads its chunk once and writes the chunk's max, its
sum of exp(x − max) and its own top kk (kk ≥ k rounds of max / argmax in registers, each
taking the leftmost maximum out; kk is 16 or 32, so two compiles serve every k); torch then
merges the chunks: the log-sum-exp of the row from the chunk sums, and the top k of its C·kk
candidates. Same tables as ref.py (ties aside).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 32  # the most k
ROUNDS = (16, MAX_K)  # a chunk's own top-k: the first of these ≥ k (two compiles cover every k)
BLOCK = 4096  # columns per program


@triton.jit
def _chunk_topk(x_ptr, stride_x, V, m_ptr, s_ptr, val_ptr, idx_ptr, C,
                K: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = c * BLOCK + offs
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < V,
                other=-float("inf")).to(tl.float32)  # [BLOCK]
    m = tl.max(x, axis=0)
    out = row * C + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, tl.sum(tl.exp(x - m), axis=0))
    for j in tl.static_range(K):
        i = tl.argmax(x, axis=0, tie_break_left=True)
        tl.store(val_ptr + out * K + j, tl.max(x, axis=0))
        tl.store(idx_ptr + out * K + j, c * BLOCK + i)
        x = tl.where(offs == i, -float("inf"), x)


def topk_logprobs_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ref.topk_logprobs_ref` for float32 `[R, V]` CUDA (or interpreted) logits, k <= MAX_K."""
    if logits.ndim != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [R, V] float32 tensor, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    rows, vocab = logits.shape
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"k must be in [1, {min(MAX_K, vocab)}], got {k}")
    chunks = triton.cdiv(vocab, BLOCK)
    kk = next(r for r in ROUNDS if r >= k)  # each chunk's top kk ⊇ its share of the row's top k
    dev = logits.device
    m = torch.empty(rows, chunks, dtype=torch.float32, device=dev)  # [R, C] chunk maxima
    s = torch.empty(rows, chunks, dtype=torch.float32, device=dev)  # [R, C] Σ exp(x − max)
    vals = torch.empty(rows, chunks * kk, dtype=torch.float32, device=dev)  # [R, C·kk]
    idx = torch.empty(rows, chunks * kk, dtype=torch.int32, device=dev)  # [R, C·kk]
    if rows:
        _chunk_topk[(rows, chunks)](logits, logits.stride(0), vocab, m, s, vals, idx, chunks,
                                    K=kk, BLOCK=BLOCK, num_warps=8)
    top = m.amax(dim=1, keepdim=True)  # [R, 1]
    lse = top + torch.log((s * torch.exp(m - top)).sum(dim=1, keepdim=True))  # [R, 1]
    best, at = vals.topk(k, dim=1)  # [R, k] float32, [R, k] int64
    return best - lse, idx.gather(1, at).long()
