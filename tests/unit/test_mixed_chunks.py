"""Prefill chunks beside decoding requests, cut by cost (engine/chunk_cost.py): the cost is a
chunk's FLOPs counted from the transformers model's own weights, the chunk the largest within
the token budget's cost, and every request's tokens still transformers' greedy ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve.engine.chunk_cost import MIN_SHARE, ChunkCost, _keys
from specserve.models.config import load_config
from specserve.types import SamplingParams
from tests.helpers import hf_greedy, random_prompts


def _flops_cost(hf, n: int, start: int) -> float:
    """A chunk's FLOPs over a context-0 token's, from the model's Linear weights (brute force
    over positions: a token at p attends p + 1 keys, at most its layer's sliding window, 4·Hq·D
    FLOPs each)."""
    cfg, layers = hf.config, hf.model.layers
    weights = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim
    window = [cfg.sliding_window if kind == "sliding_attention" else None
              for kind in (cfg.layer_types or ["full_attention"] * len(layers))]
    attention = sum(per_key * (p + 1 if w is None else min(p + 1, w))
                    for w in window for p in range(start, start + n))
    return n + attention / (2 * weights)


def test_keys_match_brute_force_with_windows():
    for n, start, window in itertools.product([1, 2, 9, 130], [0, 1, 7, 63, 64, 65, 500],
                                              [None, 1, 5, 64, 300]):
        brute = sum(p + 1 if window is None else min(p + 1, window)
                    for p in range(start, start + n))
        assert _keys(n, start, window) == brute, (n, start, window)


@pytest.mark.parametrize("windows", [{}, dict(use_sliding_window=True, sliding_window=37,
                                                max_window_layers=1)])
def test_cost_counts_the_models_flops(checkpoint_cache, windows):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn", **windows)
    if windows:
        assert hf.config.layer_types.count("sliding_attention") == 2
    cost = ChunkCost.of(load_config(path))
    for n, start in [(1, 0), (17, 0), (40, 133), (211, 300)]:
        assert cost(n, start) == pytest.approx(_flops_cost(hf, n, start), rel=1e-12)
    for start, budget, most in [(0, 64.0, 64), (150, 64.0, 64), (400, 37.5, 100), (9, 0.5, 8)]:
        fits = [n for n in range(most + 1) if _flops_cost(hf, n, start) <= budget + 1e-9]
        assert cost.tokens_within(start, budget, most) == max(fits)
    with pytest.raises(ValueError):
        ChunkCost(0.0, ((None, 1),))


def _schedules(engine):
    """Wrap the engine's scheduler: every step's [(request id, start, tokens)]."""
    seen, schedule = [], engine.scheduler.schedule

    def record():
        out = schedule()
        seen.append([(s.seq.request_id, s.start, s.num_tokens) for s in out])
        return out

    engine.scheduler.schedule = record
    return seen


@pytest.mark.parametrize("mode", ["cost", "tokens"])
def test_chunks_beside_decodes_are_cut_to_the_budgets_cost(checkpoint_cache, make_engine, mode):
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    short, long_ = random_prompts(2, hf.config.vocab_size, [11, 470], seed=7)
    budget = 128
    engine = make_engine(path, page_size=4, max_num_batched_tokens=budget, mixed_chunks=mode)
    seen = _schedules(engine)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = {"a": [], "b": []}
    engine.add_request("a", short, params)
    for _ in range(2):  # "a" is decoding when "b" arrives
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.add_request("b", long_, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got["a"] == hf_greedy(hf, short, 6) and got["b"] == hf_greedy(hf, long_, 5)
    chunks = [(step, start, n) for step in seen for rid, start, n in step
              if rid == "b" and n > 1]
    mixed = [(start, n) for step, start, n in chunks if any(r == "a" for r, *_ in step)]
    assert len(mixed) >= 3  # "b" prefilled beside "a"'s decoding
    for start, n in mixed:
        left = budget - 1
        if mode == "tokens":
            assert n == min(left, len(long_) - start)
            continue
        fits = [m for m in range(1, left + 1) if _flops_cost(hf, m, start) <= left + 1e-9]
        assert n == min(max(max(fits), budget // MIN_SHARE), len(long_) - start), (start, n)
    if mode == "cost":
        sizes = [n for start, n in mixed if start + n < len(long_)]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
        alone = [(start, n) for step, start, n in chunks if len(step) == 1]  # "a" is done
        assert alone and all(n == min(budget, len(long_) - start) for start, n in alone)
