"""Sampling at tiny temperatures: finite distributions, greedy below GREEDY_TEMPERATURE, and the
exact softmax(z / T) above it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.sampling import make_generator, probs_for, sample_rows
from specserve.types import GREEDY_TEMPERATURE, SamplingParams

ROWS, VOCAB = 7, 211


def _logits(seed: int) -> torch.Tensor:
    """Random logits of scale ~30 whose rows each hold a few near-ties of the max (a few 1e-3
    below it), so a temperature of 1e-3 leaves several tokens with real mass."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 30  # [ROWS, V]
    top = logits.max(dim=-1, keepdim=True).values  # [ROWS, 1]
    near = torch.randint(0, VOCAB, (ROWS, 4), generator=g)  # [ROWS, 4]
    gaps = torch.rand(ROWS, 4, generator=g) * 3e-3  # [ROWS, 4]
    return logits.scatter(-1, near, top - gaps)


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, GREEDY_TEMPERATURE, 1e-3])
def test_tiny_temperature_is_finite_and_greedy_below_the_threshold(temperature):
    logits = _logits(seed=5)
    params = SamplingParams(temperature=temperature, seed=3)
    probs = probs_for(logits, params)  # [ROWS, V]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(ROWS), atol=1e-6, rtol=0)
    argmax = logits.argmax(dim=-1)  # [ROWS]
    assert params.greedy == (temperature < GREEDY_TEMPERATURE)
    if params.greedy:
        assert make_generator(params, "cpu") is None
        assert sample_rows(logits, params, None) == argmax.tolist()
        if temperature == 1e-38:  # the limit itself: all mass on the argmax
            assert torch.equal(probs, torch.nn.functional.one_hot(argmax, VOCAB).float())
        return
    z = logits.double().numpy() / temperature  # [ROWS, V] the float64 reference
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs.numpy(), ref, atol=1e-6, rtol=0)
    if temperature == 1e-3:  # really a distribution, not a one-hot
        assert ((ref > 1e-3).sum(-1) >= 2).all()
    drawn = sample_rows(logits, params, make_generator(params, "cpu"))
    assert all(ref[r, t] > 0 for r, t in enumerate(drawn))


def test_top_k_top_p_at_small_temperature_match_the_reference():
    logits = _logits(seed=11)
    params = SamplingParams(temperature=2e-3, top_k=3, top_p=0.8)
    probs = probs_for(logits, params).double().numpy()  # [ROWS, V]
    z = logits.double().numpy() / params.temperature
    for row, p in zip(z, probs, strict=True):
        z_k = np.where(row >= np.sort(row)[-params.top_k], row, -np.inf)
        ref = np.exp(z_k - z_k.max())
        ref /= ref.sum()
        order = np.argsort(-ref, kind="stable")
        keep = order[(np.cumsum(ref[order]) - ref[order]) < params.top_p]
        ref = np.where(np.isin(np.arange(VOCAB), keep), ref, 0.0)
        np.testing.assert_allclose(p, ref / ref.sum(), atol=1e-6, rtol=0)
