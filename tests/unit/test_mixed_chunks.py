"""Prefill chunks beside decoding requests, cut by cost (engine/chunk_cost.py): the cost is a
chunk's FLOPs counted from the transformers model's own weights (its attention weighted by the
measured rate κ), the chunk the largest within the token budget's cost, κ numpy's least-squares
fit of the forwards' seconds, and every request's tokens still transformers' greedy ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specserve.engine.chunk_cost import MIN_SAMPLES, MIN_SHARE, AttentionRate, ChunkCost, _keys
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
        for weight in (0.3, 2.7):
            fits = [n for n in range(most + 1)
                    if n + weight * (_flops_cost(hf, n, start) - n) <= budget + 1e-9]
            assert cost.tokens_within(start, budget, most, weight) == max(fits)
    with pytest.raises(ValueError):
        ChunkCost(0.0, ((None, 1),))


def test_attention_rate_is_numpys_weighted_least_squares():
    rng = np.random.default_rng(3)
    rows = rng.integers(40, 9000, size=23).astype(float)
    attention = rng.uniform(0, 4e4, size=23) * rng.uniform(0.1, 1, size=23)
    seconds = 0.011 + 2.3e-5 * rows + 6.1e-5 * attention + rng.normal(0, 2e-4, size=23)
    rate = AttentionRate(decay=0.93)
    for i, (r, a, t) in enumerate(zip(rows, attention, seconds, strict=True)):
        rate.observe(r, a, t)
        assert (rate.fit() is None) == (i + 1 < MIN_SAMPLES)
    w = np.sqrt(0.93 ** np.arange(22, -1, -1))  # the latest sample weighs 1
    x = np.stack([np.ones(23), rows, attention], 1)
    oracle = np.linalg.lstsq(x * w[:, None], seconds * w, rcond=None)[0]
    np.testing.assert_allclose(rate.fit(), oracle, rtol=1e-6)
    assert rate.weight == pytest.approx(oracle[2] / oracle[1], rel=1e-6)
    assert 2.0 < rate.weight < 3.3  # 6.1 / 2.3 = 2.65, within the noise


def test_attention_rate_skips_a_lone_spike_not_two():
    rng = np.random.default_rng(5)
    rate = AttentionRate()
    for _ in range(30):
        r, a = rng.uniform(100, 9000), rng.uniform(0, 5e4)
        rate.observe(r, a, 0.01 + 2e-5 * r + 5e-5 * a)
    assert rate.weight == pytest.approx(2.5, rel=1e-6)
    fit = rate.fit()
    rate.observe(4000.0, 2e4, 3 * (0.01 + 2e-5 * 4000 + 5e-5 * 2e4))  # a plan built: skipped
    assert (rate.samples, rate.forwards) == (30, 31) and np.array_equal(rate.fit(), fit)
    rate.observe(4000.0, 2e4, 3 * (0.01 + 2e-5 * 4000 + 5e-5 * 2e4))  # again: booked
    assert (rate.samples, rate.forwards) == (31, 32) and not np.array_equal(rate.fit(), fit)


def test_attention_rate_waits_until_the_samples_tell_the_terms_apart():
    rate = AttentionRate()
    for _ in range(40):  # one shape again and again: rows and attention move together
        rate.observe(8192.0, 3000.0, 0.25)
    assert rate.fit() is None and rate.weight == 1.0
    rate = AttentionRate()
    for r, a in [(100.0, 10.0), (5000.0, 9e4), (300.0, 5e4), (8000.0, 200.0)] * 3:
        rate.observe(r, a, 1e-5 * r + 1e-3 * a)  # κ = 100: clamped
    assert rate.weight == 8.0
    rate = AttentionRate()
    for r, a in [(100.0, 10.0), (5000.0, 9e4), (300.0, 5e4)] * 4:
        rate.observe(r, a, 1e-3 * r - 1e-6 * a + 0.5)  # β < 0: no κ from that
    assert rate.fit() is not None and rate.fit()[2] < 0 and rate.weight == 1.0


class _Fixed:
    """A rate that does not move (the cut with a known κ ≠ 1)."""

    weight, forwards = 3.0, 0

    def observe(self, rows, attention, seconds):
        assert rows >= 1 and attention >= 0 and seconds > 0
        self.forwards += 1


def _schedules(engine):
    """Wrap the engine's scheduler: every step's [(request id, start, tokens)], and the κ it
    was cut with."""
    seen, schedule = [], engine.scheduler.schedule

    def record():
        weight = engine.scheduler.attention_weight
        out = schedule()
        seen.append([(s.seq.request_id, s.start, s.num_tokens, weight) for s in out])
        return out

    engine.scheduler.schedule = record
    return seen


@pytest.mark.parametrize("mode", ["cost", "fixed", "flops", "tokens"])
def test_chunks_beside_decodes_are_cut_to_the_budgets_cost(checkpoint_cache, make_engine, mode):
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    short, long_ = random_prompts(2, hf.config.vocab_size, [11, 470], seed=7)
    budget = 128
    engine = make_engine(path, page_size=4, max_num_batched_tokens=budget,
                         mixed_chunks="cost" if mode == "fixed" else mode)
    if mode == "fixed":
        engine.scheduler.rate = _Fixed()
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
    chunks = [(step, start, n, k) for step in seen for rid, start, n, k in step
              if rid == "b" and n > 1]
    mixed = [(start, n, k) for step, start, n, k in chunks if any(r == "a" for r, *_ in step)]
    assert len(mixed) >= 3  # "b" prefilled beside "a"'s decoding
    for start, n, k in mixed:
        left = budget - 1
        if mode == "tokens":
            assert n == min(left, len(long_) - start)
            continue
        assert k == {"fixed": 3.0, "flops": 1.0}.get(mode, k)
        fits = [m for m in range(1, left + 1)
                if m + k * (_flops_cost(hf, m, start) - m) <= left + 1e-9]
        assert n == min(max(max(fits), budget // MIN_SHARE), len(long_) - start), (start, n)
    if mode in ("cost", "fixed"):  # every forward with a chunk was booked
        prompt = {"a": len(short), "b": len(long_)}
        assert engine.scheduler.rate.forwards == sum(
            any(start < prompt[rid] for rid, start, *_ in step) for step in seen)
    if mode == "flops":
        sizes = [n for start, n, _ in mixed if start + n < len(long_)]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
        alone = [(start, n) for step, start, n, _ in chunks if len(step) == 1]  # "a" is done
        assert alone and all(n == min(budget, len(long_) - start) for start, n in alone)
