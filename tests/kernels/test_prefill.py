"""The prefill backend (specserve/attention/prefill.py) against the torch reference backend.

A mixed causal batch — two long chunks (one at context 0, one over an unaligned prefix), a short
chunk and a decode token that stay in the tree kernel — over shuffled pages, the pool's unused
pages poisoned with NaN. CPU: torch's CPU flash op + the merge kernel in the Triton interpreter;
GPU: cuDNN in bf16 at the Qwen3-8B attention shape.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve.attention.base import AttnBatch  # noqa: E402
from specserve.attention.prefill import (  # noqa: E402
    plan_key,
    plan_prefill,
    prefill_attention,
)
from specserve.attention.prefill_warmup import ragged_shapes, warm_up  # noqa: E402
from specserve.attention.torch_ref import torch_ref_attention  # noqa: E402
from specserve.spec.tree import verify_layout  # noqa: E402
from tests.helpers import random_tree  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _scenario(q_lens, ctx_lens, hq, hkv, d, page, dtype, device, seed=0, masks=None):
    rng = np.random.default_rng(seed)
    need = [-(-(c + n) // page) for n, c in zip(q_lens, ctx_lens, strict=True)]
    perm = rng.permutation(sum(need) + 5).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    gen = torch.Generator().manual_seed(seed)
    shape = (len(perm), page, hkv, d)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    used = torch.tensor([p for t in tables for p in t])
    k_pool[used] = torch.randn(len(used), page, hkv, d, generator=gen).to(dtype)
    v_pool[used] = torch.randn(len(used), page, hkv, d, generator=gen).to(dtype)
    positions = np.concatenate([np.arange(c, c + n) for n, c in zip(q_lens, ctx_lens,
                                                                     strict=True)])
    batch = AttnBatch.build(q_lens, ctx_lens, tables, positions, page, masks, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    return q.to(device), k_pool.to(device), v_pool.to(device), batch


@pytest.mark.skipif(ON_GPU, reason="the CPU twin (Triton interpreter); the GPU test covers CUDA")
def test_mixed_causal_batch_equals_reference():
    q_lens, ctx = (41, 1, 37, 13), (0, 29, 53, 6)
    q, k, v, batch = _scenario(q_lens, ctx, 6, 2, 16, 4, torch.float32, "cpu")
    # attention FLOPs 4·Hq·D·n·(n/2 + ctx): 3.2e5, 1.1e4, 1.0e6, 6.2e4 -> the first and third
    plan = plan_prefill(q, batch, None, min_flop=2e5)
    assert [(c.r0, c.r1, c.ctx) for c in plan.chunks] == [(0, 41, 0), (42, 79, 53)]
    assert plan.rest.q_lens == (1, 13) and plan.rest.ctx_lens == (29, 6)
    assert plan.rest_rows.tolist() == [41] + list(range(79, 92))
    batch.memo[plan_key(q, None)] = plan  # as the backend memoises it
    got = prefill_attention(q, k, v, batch, 0.3)
    want = torch_ref_attention(q, k, v, batch, 0.3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="the CPU twin (Triton interpreter); the GPU test covers CUDA")
def test_chunk_beside_verify_trees_equals_reference():
    """A prefill chunk in the same forward as two verify trees (the batch has a tree mask; the
    chunk's rows are marked causal): the chunk takes the library path, the trees (their masks
    carried into the sub-batch) and a causal decode row the tree kernel."""
    rng = np.random.default_rng(5)
    trees = [verify_layout(random_tree(rng, 6), 1, 30).mask, None,
             verify_layout(random_tree(rng, 11), 1, 9).mask, None]
    q_lens, ctx = (7, 45, 12, 1), (30, 17, 9, 21)
    q, k, v, batch = _scenario(q_lens, ctx, 6, 2, 16, 4, torch.float32, "cpu", seed=2,
                               masks=trees)
    assert batch.causal == (False, True, False, True)
    plan = plan_prefill(q, batch, None, min_flop=2e5)  # only the 45-row chunk qualifies
    assert [(c.r0, c.r1, c.ctx) for c in plan.chunks] == [(7, 52, 17)]
    assert plan.rest.causal == (False, False, True) and plan.rest.tree_mask.shape[0] == 20
    batch.memo[plan_key(q, None)] = plan
    got = prefill_attention(q, k, v, batch, 0.3)
    torch.testing.assert_close(got, torch_ref_attention(q, k, v, batch, 0.3), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="the CPU twin (Triton interpreter); the GPU test covers CUDA")
def test_long_chunk_beside_trees_gets_a_causal_call_of_its_own():
    """A causal chunk too small for the library but ≥ SPLIT_ROWS rows, beside verify trees:
    the tree kernel takes it in a sub-batch without the mask (causal mode), the trees and a
    short chunk in another; the result equals the reference."""
    from specserve.attention.prefill import SPLIT_ROWS

    rng = np.random.default_rng(11)
    trees = [verify_layout(random_tree(rng, 9), 1, 40).mask, None, None,
             verify_layout(random_tree(rng, 5), 1, 3).mask]
    q_lens, ctx = (10, SPLIT_ROWS + 7, SPLIT_ROWS - 1, 6), (40, 13, 5, 3)
    q, k, v, batch = _scenario(q_lens, ctx, 6, 2, 16, 4, torch.float32, "cpu", seed=4,
                               masks=trees)
    plan = plan_prefill(q, batch, None)  # the default threshold: no chunk for the library
    assert plan.chunks == () and plan.causal_rest.tree_mask is None
    assert plan.causal_rest.q_lens == (SPLIT_ROWS + 7,) and plan.causal_rest.ctx_lens == (13,)
    assert plan.causal_rows.tolist() == list(range(10, 10 + SPLIT_ROWS + 7))
    assert plan.rest.q_lens == (10, SPLIT_ROWS - 1, 6)
    assert plan.rest.causal == (False, True, False)
    batch.memo[plan_key(q, None)] = plan
    got = prefill_attention(q, k, v, batch, 0.3)
    torch.testing.assert_close(got, torch_ref_attention(q, k, v, batch, 0.3), rtol=1e-4,
                               atol=1e-5)
    without_trees = _scenario(q_lens[1:3], ctx[1:3], 6, 2, 16, 4, torch.float32, "cpu")
    assert plan_prefill(without_trees[0], without_trees[3], None) is None  # nothing to split


@pytest.mark.skipif(ON_GPU, reason="the CPU twin (Triton interpreter); the GPU test covers CUDA")
def test_library_failure_falls_back_to_the_tree_kernel(monkeypatch, caplog):
    import specserve.attention.prefill as prefill

    def broken(*args):
        raise RuntimeError("cuDNN Frontend error: no valid execution plan")

    monkeypatch.setattr(prefill, "_library_attention", broken)
    monkeypatch.setitem(prefill._LIBRARY, "failed", None)
    q, k, v, batch = _scenario((41, 5), (0, 9), 6, 2, 16, 4, torch.float32, "cpu")
    batch.memo[plan_key(q, None)] = plan_prefill(q, batch, None, min_flop=2e5)
    want = torch_ref_attention(q, k, v, batch, 0.3)
    with caplog.at_level("WARNING"):
        got = prefill_attention(q, k, v, batch, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert "no valid execution plan" in prefill._LIBRARY["failed"] and "tree kernel" in caplog.text
    calls = []
    monkeypatch.setattr(prefill, "_library_attention", lambda *a: calls.append(a))
    prefill_attention(q, k, v, batch, 0.3)  # later batches: no second try
    assert calls == []


def test_what_stays_in_the_tree_kernel():
    q, _, _, batch = _scenario((600,), (7,), 4, 2, 16, 4, torch.float32, "cpu")
    work = 4 * 4 * 16 * 600 * (300 + 7)
    assert plan_prefill(q, batch, None, min_flop=work) is not None
    assert plan_prefill(q, batch, None, min_flop=work + 1) is None  # too little work
    assert plan_prefill(q, batch, None) is None  # ... for the default threshold
    assert plan_prefill(q, batch, 64, min_flop=0) is None  # a sliding window
    assert plan_prefill(q.double(), batch, None, min_flop=0) is None  # a dtype cuDNN lacks
    tree = AttnBatch.build((600,), (7,), [list(range(154))], np.arange(7, 607), 4,
                           [np.ones((600, 19), np.uint32)])
    assert plan_prefill(q, tree, None, min_flop=0) is None  # a tree request never
    unmarked = dataclasses.replace(tree, causal=None)  # a tree mask nobody labelled
    assert plan_prefill(q, unmarked, None, min_flop=0) is None


def test_warm_up_runs_a_chunk_only_where_the_backend_would():
    device = "cuda" if ON_GPU else "cpu"
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    assert warm_up(4, 2, 16, dtype, device, page_size=4)
    assert not warm_up(4, 2, 16, torch.float64, device)  # no library op for it
    assert not warm_up(4, 2, 256, dtype, device)  # head_dim above cuDNN's 128


def test_per_shape_plans_for_regular_chunks_within_the_budget(monkeypatch):
    import specserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "_per_shape", set())
    monkeypatch.setattr(prefill, "DENSE_PLANS_MAX", 3)
    assert prefill.per_shape_plan(2048, 4096) and prefill.per_shape_plan(4096, 0)
    assert not prefill.per_shape_plan(2048, 1000)  # a prefix of no whole number of chunks
    assert not prefill.per_shape_plan(3000, 0)  # not a power of two
    assert not prefill.per_shape_plan(1024, 2048)  # below 2048 rows
    assert prefill.per_shape_plan(2048, 0)  # the third: the budget is spent
    assert not prefill.per_shape_plan(2048, 2048)
    assert prefill.per_shape_plan(2048, 4096)  # ... but a planned shape stays planned
    assert prefill._per_shape == {(2048, 4096), (4096, 0), (2048, 0)}


@pytest.mark.skipif(ON_GPU, reason="the CPU twin (Triton interpreter); the GPU test covers CUDA")
def test_regular_chunks_through_the_per_shape_layout_equal_reference(monkeypatch):
    """Two regular chunks (head-major q, cuDNN's per-shape plans on a GPU) and an irregular one
    (the ragged layout) in one batch, over shuffled pages."""
    import specserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "_per_shape", set())
    q_lens, ctx = (2048, 2200, 2048), (4096, 1000, 0)
    q, k, v, batch = _scenario(q_lens, ctx, 2, 1, 16, 16, torch.float32, "cpu", seed=4)
    batch.memo[plan_key(q, None)] = plan = plan_prefill(q, batch, None, min_flop=0)
    assert len(plan.chunks) == 3
    got = prefill_attention(q, k, v, batch, 0.25)
    assert prefill._per_shape == {(2048, 4096), (2048, 0)}
    torch.testing.assert_close(got, torch_ref_attention(q, k, v, batch, 0.25), rtol=1e-4,
                               atol=1e-5)


def test_warm_up_plans_every_regular_chunk_of_the_longest_prompt(monkeypatch):
    import specserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "_per_shape", set())
    monkeypatch.setattr(prefill, "MIN_FLOP", 5e8)  # 2 heads of 16: 2.7e8 FLOP at prefix 0
    device = "cuda" if ON_GPU else "cpu"
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    assert warm_up(2, 1, 16, dtype, device, chunk=2048, max_len=7000)
    assert prefill._per_shape == {(2048, 2048), (2048, 4096)}  # not the tree kernel's chunk
    monkeypatch.setattr(prefill, "_per_shape", set())
    assert warm_up(2, 1, 16, dtype, device, chunk=3000, max_len=7000)  # no regular chunk
    assert prefill._per_shape == set()


def _class(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()  # cuDNN's ragged plans: lengths rounded up


@pytest.mark.parametrize("chunk, max_len", [(300, 1500), (256, 999), (37, 2048)])
def test_ragged_shapes_cover_every_plan_class_a_chunk_can_meet(chunk, max_len):
    """Brute force over every chunk (n ≤ chunk rows over a prefix p, n + p ≤ max_len) the
    backend takes on the ragged path: the classes of its calls — the chunk over itself, the
    chunk over its prefix — are those of `ragged_shapes`' chunks, one chunk each."""

    def flop(n, p):
        return 4 * 2 * 16 * n * (n / 2 + p)

    least = flop(24, 150)
    import specserve.attention.prefill as prefill

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill, "MIN_FLOP", least)
        got = ragged_shapes(chunk, max_len, flop)
    want_causal, want_prefix = set(), set()
    for n in range(1, chunk + 1):
        for p in range(0, max_len - n + 1):
            if flop(n, p) >= least:
                want_causal.add(_class(n))
                if p:
                    want_prefix.add((_class(n), _class(p)))
    assert {_class(n) for n, _ in got} == want_causal
    assert {(_class(n), _class(p)) for n, p in got if p} == want_prefix
    assert len({(_class(n), p and _class(p)) for n, p in got}) == len(got)
    assert all(n <= chunk and n + p <= max_len and flop(n, p) >= least for n, p in got)


def test_warm_up_calls_the_library_for_every_ragged_class(monkeypatch):
    import specserve.attention.prefill as prefill

    monkeypatch.setattr(prefill, "_per_shape", set())
    monkeypatch.setattr(prefill, "MIN_FLOP", 5e8)
    calls, real = [], prefill._library_attention

    def spy(q, k, v, causal, scale):
        calls.append((q.shape[2], k.shape[2], causal))
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(prefill, "_library_attention", spy)
    device = "cuda" if ON_GPU else "cpu"
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    assert warm_up(2, 1, 16, dtype, device, chunk=3000, max_len=7000)
    shapes = ragged_shapes(3000, 7000, lambda n, p: 4 * 2 * 16 * n * (n / 2 + p))
    assert len(shapes) >= 5
    for n, p in shapes:
        assert (n, n, True) in calls and (not p or (n, p, False) in calls), (n, p)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_chunks_equal_reference_on_gpu(dtype):
    q_lens, ctx = (1000, 3, 517, 77), (0, 900, 4133, 60)
    q, k, v, batch = _scenario(q_lens, ctx, 32, 8, 128, 16, dtype, "cuda", seed=3)
    plan = plan_prefill(q, batch, None, min_flop=5e9)  # small shapes: a low threshold
    assert len(plan.chunks) == 2 and plan.rest.q_lens == (3, 77)
    batch.memo[plan_key(q, None)] = plan
    got = prefill_attention(q, k, v, batch, 128**-0.5).float()
    want = torch_ref_attention(q.float(), k.float(), v.float(), batch, 128**-0.5)
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-2


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_cudnn_chunk_beside_verify_trees_on_gpu():
    import specserve.attention.prefill as prefill

    rng = np.random.default_rng(8)
    trees = [verify_layout(random_tree(rng, 16), 1, 3000).mask, None,
             verify_layout(random_tree(rng, 64), 1, 700).mask]
    q_lens, ctx = (17, 2048, 65), (3000, 4096, 700)  # the chunk: 0.17 TFLOP
    q, k, v, batch = _scenario(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=9,
                               masks=trees)
    assert plan_prefill(q, batch, None).rest.q_lens == (17, 65)  # the default threshold
    got = prefill_attention(q, k, v, batch, 128**-0.5).float()
    assert (2048, 4096) in prefill._per_shape  # a regular chunk: cuDNN's per-shape plans
    want = torch_ref_attention(q.float(), k.float(), v.float(), batch, 128**-0.5)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-2


def test_cuda_backend_opts_into_ragged_plans_unless_told(monkeypatch):
    """Importing the backend sets nothing; choosing it for CUDA sets
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (before any cuDNN call) and keeps a value already set."""
    from specserve.attention import backend_for

    monkeypatch.delenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", raising=False)
    assert backend_for("cpu") is torch_ref_attention
    assert "TORCH_CUDNN_SDPA_AVOID_RECOMPILE" not in os.environ
    assert backend_for("cuda") is prefill_attention
    assert os.environ["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] == "1"
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "0")
    backend_for("cuda")
    assert os.environ["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] == "0"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_causal_call_beside_verify_trees_on_gpu():
    """A 2000-row chunk below MIN_FLOP beside verify trees: compiled, its causal call of its own
    and the trees' call together equal the reference."""
    rng = np.random.default_rng(12)
    trees = [verify_layout(random_tree(rng, 16), 1, 900).mask, None,
             verify_layout(random_tree(rng, 15), 1, 70).mask]
    q_lens, ctx = (17, 2000, 16), (900, 0, 70)
    q, k, v, batch = _scenario(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=13,
                               masks=trees)
    plan = plan_prefill(q, batch, None)
    assert plan.chunks == () and plan.causal_rest.q_lens == (2000,)
    got = prefill_attention(q, k, v, batch, 128**-0.5).float()
    want = torch_ref_attention(q.float(), k.float(), v.float(), batch, 128**-0.5)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-2
