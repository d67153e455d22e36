"""Long causal prefill chunks through a library flash-attention kernel; the rest of the batch
through the tree kernel. The CUDA attention backend (`prefill_attention`).

A chunk of C new tokens over a P-token prefix is two attention calls whose results merge by their
log-sum-exps (`specserve.kernels.tree_attention.combine.merge_pair`): the chunk over itself
under the causal mask, and the chunk over its prefix with no mask. Their K/V are the request's pages
gathered into one contiguous buffer per pool and layer (one `index_select`: (P + C)·Hkv·D
elements, small beside the attention itself), passed as strided views — no transposes. On
CUDA the calls are cuDNN's fused attention (torch's `_scaled_dot_product_cudnn_attention`, the op
behind SDPA's cuDNN backend, which also returns the LSE; grouped-query heads natively), well
ahead of our kernel on a long chunk (`bench/diag_sdpa.py`; BENCHMARKS.md, "Prefill attention
through cuDNN, DFlash drafter CUDA graphs") — the tree kernel runs a causal chunk's tail in
32-key bitmask tiles and its prefix below the matmul rate (Triton 3.6: no wgmma / softmax
overlap). On the CPU the
same plan runs on torch's CPU flash op (tests: against the torch reference).

Which requests: causal ones (the whole batch when tree_mask is None, else those `batch.causal`
marks — a prefill chunk riding in a forward with other requests' verify trees), no sliding
window, attention work ≥ MIN_FLOP, bf16/fp16 with head_dim ≤ 128 on CUDA. Everything else —
trees, decodes, short chunks, the drafter's windowed layers — goes through
`specserve.kernels.tree_attention.tree_attention` (as a sub-batch of the requests left when
some were taken; their tree-mask rows with them); a causal chunk of ≥ SPLIT_ROWS rows left
beside verify trees goes there in a sub-batch of its own without the mask (causal mode). The
plan is made once per batch (memoised in
`batch.memo`) and contains no host sync; steps replayed from CUDA graphs never qualify. If the
library op raises (no cuDNN fused attention on this GPU / build), the batch and every later one
go to the tree kernel, with one warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import AttnBatch, to_device

# A chunk goes to cuDNN when its attention is ≥ this many FLOPs (4·Hq·D·C·(C/2 + P)): below it
# the call's fixed cost (with the ragged path, below) loses to the tree kernel (H200,
# bench/diag_sdpa.py: BENCHMARKS.md, "Prefill attention through cuDNN, DFlash drafter CUDA
# graphs", and "Figures formerly in source comments").
MIN_FLOP = 1.5e11
SPLIT_ROWS = 64  # see PrefillPlan.causal_rest
# cuDNN builds an execution plan per shape, slowly, at each new (chunk, prefix) length
# (bench/diag_sdpa.py --first-calls: BENCHMARKS.md, "cuDNN plans per shape" in the section
# above), i.e. on almost every request of a serving workload.
# torch's opt-in ragged path keys its plans on the lengths rounded up to powers of two (a few
# dozen plans for any workload, each slower than a plan of its own shape); torch reads the
# variable once, at its first cuDNN attention call (`use_ragged_plans` sets it before that), and
# takes that path only when q, k, v and out are all BSHD-contiguous.
# So a call still gets a plan of its own shape by passing q head-major (one copy of q, cheap
# beside the call). We do that for the regular shapes of chunked prefill — a power-of-two chunk of
# ≥ 2048 rows over a whole number of such chunks — which recur at every long prompt, are few
# (one per chunk of the longest context) and run faster on a plan of their own (BENCHMARKS.md,
# "Prefill: per-shape cuDNN plans for the regular chunks"); at most DENSE_PLANS_MAX of them, the
# rest stay ragged.
DENSE_PLANS_MAX = 64  # chunk shapes (two plans each: the chunk's causal call, its prefix call)
_per_shape: set[tuple[int, int]] = set()  # (rows, prefix) of the chunks planned per shape so far
_DTYPES = {"cuda": (torch.bfloat16, torch.float16), "cpu": (torch.float32, torch.bfloat16)}
# The library op's first failure (a GPU or torch build without cuDNN fused attention): recorded
# here, logged once, and every later batch goes to the tree kernel.
_LIBRARY: dict[str, str | None] = {"failed": None}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Chunk:
    r0: int  # first row of the request in the flat batch
    r1: int
    ctx: int  # prefix tokens
    pages: torch.Tensor  # [n_pages] int32: the block-table row, prefix + chunk


@dataclass(frozen=True)
class PrefillPlan:
    chunks: tuple[_Chunk, ...]
    rest: AttnBatch | None  # the other requests as a batch of their own
    rest_rows: torch.Tensor | None  # [T_rest] int64: their rows in the flat batch
    # causal chunks of ≥ SPLIT_ROWS rows left to the tree kernel in a batch with verify trees:
    # a call of their own without the mask, whose tail is a triangle instead of a square of
    # 32-key mask tiles (a 4k chunk beside trees: BENCHMARKS.md, "A burst of requests")
    causal_rest: AttnBatch | None = None
    causal_rows: torch.Tensor | None = None


def plan_prefill(q: torch.Tensor, batch: AttnBatch, sliding_window: int | None,
                 min_flop: float = MIN_FLOP) -> PrefillPlan | None:
    """The batch's split between the library kernel and the tree kernel; None when no request
    qualifies (then the tree kernel takes the whole batch, unchanged)."""
    hq, d = q.shape[1], q.shape[-1]
    causal = (True,) * batch.batch_size if batch.tree_mask is None else batch.causal
    if (causal is None or sliding_window is not None or d > 128 or d % 8
            or q.dtype not in _DTYPES.get(q.device.type, ())):
        return None
    take = [b for b, (n, c) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True))
            if causal[b] and 4 * hq * d * n * (n / 2 + c) >= min_flop]
    left = [b for b in range(batch.batch_size) if b not in take]
    alone = [] if batch.tree_mask is None else \
        [b for b in left if causal[b] and batch.q_lens[b] >= SPLIT_ROWS]
    others = [b for b in left if b not in alone]
    if not take and not (alone and others):
        return None
    cu = np.concatenate([[0], np.cumsum(batch.q_lens)]).astype(np.int64)
    ps = batch.page_size
    chunks = tuple(_Chunk(int(cu[b]), int(cu[b + 1]), batch.ctx_lens[b],
                          batch.block_table[b, : -(-(batch.ctx_lens[b] + batch.q_lens[b]) // ps)])
                   for b in take)
    rest, rest_rows = _sub_batch(batch, others, cu, causal, q.device)
    causal_rest, causal_rows = _sub_batch(batch, alone, cu, None, q.device)
    return PrefillPlan(chunks, rest, rest_rows, causal_rest, causal_rows)


def _sub_batch(batch: AttnBatch, take: list[int], cu: np.ndarray, causal, device
               ) -> tuple[AttnBatch | None, torch.Tensor | None]:
    """Requests `take` of `batch` as a batch of their own and their rows in the flat batch;
    with their tree-mask rows unless `causal` is None (then all causal, no mask)."""
    if not take:
        return None, None
    q_lens = tuple(batch.q_lens[b] for b in take)
    rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in take])
    cu_sub = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    idx, rows_t, cu_t = to_device([np.asarray(take, np.int64), rows, cu_sub], device)
    masked = batch.tree_mask is not None and causal is not None
    sub = AttnBatch(
        q_lens=q_lens, ctx_lens=tuple(batch.ctx_lens[b] for b in take), cu_q=cu_t,
        ctx_lens_t=batch.ctx_lens_t.index_select(0, idx),
        block_table=batch.block_table.index_select(0, idx),
        slot_mapping=batch.slot_mapping.index_select(0, rows_t),
        positions=batch.positions.index_select(0, rows_t), page_size=batch.page_size,
        tree_mask=batch.tree_mask.index_select(0, rows_t) if masked else None,
        causal=tuple(causal[b] for b in take) if masked else None)
    return sub, rows_t


def plan_key(q: torch.Tensor, sliding_window: int | None) -> tuple:
    """The `batch.memo` key of a batch's plan (one per dtype, head_dim and window)."""
    return ("prefill_plan", q.dtype, q.shape[-1], sliding_window)


def use_ragged_plans() -> None:
    """Opt this process into cuDNN's ragged-path plans (TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1, see
    above) unless the environment already says otherwise. torch reads the variable at its first
    cuDNN attention call, so this runs before it: when the CUDA backend is chosen
    (`attention.backend_for`) and again, for direct callers, before each library call."""
    os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")


def _library_attention(q, k, v, causal: bool, scale: float):
    """(out, lse) of q `[1, Hq, n, D]` over k/v `[1, Hkv, L, D]` (strided views): cuDNN on
    CUDA, torch's CPU flash op on the CPU; lse `[1, Hq, n]` in natural log."""
    if q.is_cuda:
        use_ragged_plans()
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    return r[0], r[1]


def per_shape_plan(n: int, ctx: int) -> bool:
    """Whether a chunk of `n` rows over `ctx` prefix tokens gets cuDNN plans of its own shape
    (its two calls; see DENSE_PLANS_MAX): the regular shapes of chunked prefill, while the
    budget lasts."""
    if (n, ctx) in _per_shape:
        return True
    if regular_chunk(n, ctx) and len(_per_shape) < DENSE_PLANS_MAX:
        _per_shape.add((n, ctx))
        return True
    return False


def regular_chunk(n: int, ctx: int) -> bool:
    """A chunk of chunked prefill's regular shapes: a power of two of ≥ 2048 rows over a whole
    number of such chunks."""
    return n >= 2048 and n & (n - 1) == 0 and ctx % n == 0


def _one_batch_stride(t: torch.Tensor) -> torch.Tensor:
    """`t [1, H, L, D]` with the stride of its size-1 batch axis fixed (any value is valid
    there): cuDNN's plan key holds the strides, so the chunk's causal call over the tail of a
    (P + C)-token buffer keys on C alone, not on P."""
    return t.as_strided(t.shape, (t.shape[1] * t.shape[2] * t.shape[3], *t.stride()[1:]),
                        t.storage_offset())


def _chunk_attention(q, k_pool, v_pool, c: _Chunk, scale: float, out) -> None:
    """One chunk's rows `q [C, Hq, D]` into `out [C, Hq, D]`."""
    from specserve.kernels.tree_attention.combine import merge_pair

    hkv, d, n = k_pool.shape[2], k_pool.shape[3], c.r1 - c.r0
    k = k_pool.index_select(0, c.pages).view(-1, hkv, d)[: c.ctx + n]  # [P + C, Hkv, D]
    v = v_pool.index_select(0, c.pages).view(-1, hkv, d)[: c.ctx + n]
    kt, vt = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]  # [1, Hkv, P + C, D] views
    qt = q.permute(1, 0, 2)[None]  # [1, Hq, C, D]: a BSHD-contiguous view (ragged plans)
    if per_shape_plan(n, c.ctx):
        qt = qt.contiguous()  # head-major: cuDNN plans this exact shape
    k_new, v_new = (_one_batch_stride(t[:, :, c.ctx:]) for t in (kt, vt))
    o_new, l_new = _library_attention(qt, k_new, v_new, True, scale)
    if c.ctx == 0:
        out.copy_(o_new[0].transpose(0, 1))
        return
    o_pre, l_pre = _library_attention(qt, kt[:, :, : c.ctx], vt[:, :, : c.ctx], False, scale)
    merge_pair(o_new[0].transpose(0, 1), l_new[0].transpose(0, 1),
               o_pre[0].transpose(0, 1), l_pre[0].transpose(0, 1), out)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, page_size, Hkv, D] (new tokens' K already written)
    v_pool: torch.Tensor,
    batch: AttnBatch,
    scale: float,
    sliding_window: int | None = None,
    **tree_kwargs,  # num_splits / max_ctx_len for the tree kernel (CUDA graphs)
) -> torch.Tensor:  # [T, Hq, D]
    """The attention backend: qualifying prefill chunks through the library kernel, the rest
    (or everything, when none qualifies) through the tree kernel. Same semantics as
    `specserve.attention.torch_ref.torch_ref_attention`."""
    from specserve.kernels.tree_attention import check_inputs, tree_attention

    key = plan_key(q, sliding_window)
    if key not in batch.memo:
        batch.memo[key] = plan_prefill(q, batch, sliding_window)
    plan = batch.memo[key]
    if plan is None or _LIBRARY["failed"] is not None:
        return tree_attention(q, k_pool, v_pool, batch, scale, sliding_window, **tree_kwargs)
    check_inputs(q, k_pool, v_pool, batch, sliding_window, None)
    out = torch.empty_like(q)
    try:
        for c in plan.chunks:
            _chunk_attention(q[c.r0 : c.r1], k_pool, v_pool, c, scale, out[c.r0 : c.r1])
    except torch.OutOfMemoryError:  # memory, not the library: the caller's to handle
        raise
    except RuntimeError as e:  # no usable cuDNN attention here (GPU, build, version)
        _LIBRARY["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        log.warning("cuDNN attention failed (%s); prefill chunks use the tree kernel from now "
                    "on", _LIBRARY["failed"])
        return tree_attention(q, k_pool, v_pool, batch, scale, sliding_window, **tree_kwargs)
    for sub, rows in ((plan.rest, plan.rest_rows), (plan.causal_rest, plan.causal_rows)):
        if sub is not None:
            out.index_copy_(0, rows, tree_attention(q.index_select(0, rows), k_pool, v_pool,
                                                    sub, scale, None, **tree_kwargs))
    return out
