"""The warm-up's causal chunks: every launch config a prompt chunk can reach, found by brute force
over chunk sizes and prefixes, is one the warm-up runs; its batches are valid attention inputs;
on a GPU, after it, prompt chunks of new sizes compile no new kernel variant."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specserve.attention import prefill
from specserve.attention.torch_ref import torch_ref_attention
from specserve.engine.warmup import causal_chunk_shapes, warm_up_causal_chunks
from specserve.kernels.tree_attention.configs import SHORT_CONTEXT, pick_config


def _model(heads: int, kv_heads: int, head_dim: int, windows: list[int | None]):
    types = tuple("sliding_attention" if w else "full_attention" for w in windows)
    window = next((w for w in windows if w), None)
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           num_layers=len(windows), sliding_window=window,
                           window=lambda i: window if types[i] == "sliding_attention" else None)


MODELS = {
    "demo: 4/4 heads of 64, every layer windowed": _model(4, 4, 64, [256] * 4),
    "qwen3-8b: 32/8 of 128, full": _model(32, 8, 128, [None] * 3),
    "mixed: 28/4 of 128": _model(28, 4, 128, [None, 512, None, 512, 512]),
    "64/8 of 256": _model(64, 8, 256, [None, 1024]),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("arch", [90, 120])
def test_the_shapes_reach_every_config_a_chunk_can(name, arch):
    mc = MODELS[name]
    group = mc.num_heads // mc.num_kv_heads
    windows = {mc.window(i) for i in range(mc.num_layers)}

    def picks(shapes):
        return {(pick_config(arch, mc.head_dim, n * group, 2, ctx), w) for n, ctx, w in shapes}

    reachable = picks((n, ctx, w) for n in range(1, 700, 3)
                      for ctx in (0, 1, 700, SHORT_CONTEXT, SHORT_CONTEXT + 1, 131_072)
                      for w in windows)
    shapes = causal_chunk_shapes(mc)
    assert picks(shapes) == reachable
    assert len(shapes) <= 8 * len(windows)  # a handful of calls, not a sweep


def test_the_warm_up_batches_are_valid_attention_inputs(monkeypatch):
    """Each call the warm-up makes is checked against the torch reference on its own inputs:
    finite, and equal to what the reference computes (same pages, prefix, window)."""
    mc = MODELS["mixed: 28/4 of 128"]
    calls = []

    def spy(q, k_pool, v_pool, batch, scale, sliding_window=None, **kw):
        want = torch_ref_attention(q, k_pool, v_pool, batch, scale, sliding_window)
        calls.append((q.shape[0], batch.ctx_lens[0], sliding_window, want))
        return want

    monkeypatch.setattr(prefill, "prefill_attention", spy)
    n_calls = warm_up_causal_chunks(mc, torch.float32, torch.device("cpu"), 16)
    assert n_calls == len(calls) == len(causal_chunk_shapes(mc))
    assert [(n, ctx, w) for n, ctx, w, _ in calls] == causal_chunk_shapes(mc)
    assert {ctx for _, ctx, _, _ in calls} == {0, SHORT_CONTEXT + 1}
    assert all(bool(torch.isfinite(out).all()) and out.abs().max() > 0 for *_, out in calls)


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_after_the_warm_up_prompt_chunks_compile_nothing():
    from specserve.attention.base import AttnBatch
    from specserve.kernels.tree_attention.kernel import _tree_attn_kernel

    mc, page, dev = MODELS["demo: 4/4 heads of 64, every layer windowed"], 16, torch.device("cuda")
    warm_up_causal_chunks(mc, torch.bfloat16, dev, page)
    compiled = len(_tree_attn_kernel.device_caches[torch.cuda.current_device()][0])
    gen = torch.Generator(dev).manual_seed(1)
    pages = -(-(9000 + 5000) // page)
    k, v = (torch.randn(pages, page, 4, 64, generator=gen, device=dev, dtype=torch.bfloat16)
            for _ in range(2))
    for n, ctx in [(3, 10), (50, 9000), (700, 3000), (5000, 9000), (37, 8192)]:
        q = torch.randn(n, 4, 64, generator=gen, device=dev, dtype=torch.bfloat16)
        batch = AttnBatch.build([n], [ctx], [list(range(pages))], np.arange(ctx, ctx + n), page,
                                None, device=dev)
        prefill.prefill_attention(q, k, v, batch, 0.125, 256)
    torch.cuda.synchronize()
    assert len(_tree_attn_kernel.device_caches[torch.cuda.current_device()][0]) == compiled
