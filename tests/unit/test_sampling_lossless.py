"""Sampling losslessness: with speculation (DDTree, budget 8) the joint distribution of the first
three generated tokens equals plain autoregressive sampling — a χ² goodness-of-fit test against
the exact distribution computed from transformers' logits with an independent numpy sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.types import SamplingParams
from tests.fakes import RandomDDTreeDrafter
from tests.helpers import hf_config

VOCAB, PROMPT, SAMPLES = 12, [3, 7, 1, 9, 4], 20_000


def _dist(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float) -> np.ndarray:
    """Independent reference of the sampling rule: temperature, top-k, then nucleus."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _exact_joint(hf, params: SamplingParams) -> np.ndarray:  # [V, V, V]
    rule = (params.temperature, params.top_k, params.top_p)
    seqs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits.double().numpy()  # [V*V, len, V]
    n = len(PROMPT)
    p1 = _dist(logits[0, n - 1], *rule)
    joint = np.zeros((VOCAB,) * 3)
    for i, (a, b) in enumerate((a, b) for a in range(VOCAB) for b in range(VOCAB)):
        joint[a, b] = p1[a] * _dist(logits[i, n], *rule)[b] * _dist(logits[i, n + 1], *rule)
    return joint


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() * counts.sum()
    counts = counts.ravel()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    import transformers

    torch.manual_seed(12)
    hf = transformers.Qwen3ForCausalLM(hf_config(
        "qwen3-gqa4-yarn", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        initializer_range=0.5)).eval()
    path = tmp_path_factory.mktemp("tinyvocab")
    hf.save_pretrained(path)
    return path, hf


@pytest.mark.parametrize("rule", [dict(temperature=1.0),
                                  dict(temperature=0.7, top_k=6, top_p=0.9)])
def test_speculative_sampling_matches_exact_distribution(tiny_vocab_model, make_engine, rule):
    path, hf = tiny_vocab_model
    engine = make_engine(path, page_size=16, max_draft_tokens=8, max_num_seqs=1024,
                         max_num_batched_tokens=8192, num_pages=4096)
    engine.set_drafter(RandomDDTreeDrafter(VOCAB, depth=3, seed=9))
    depths: list[int] = []
    engine.on_step = lambda rid, step: depths.append(step.accepted_depth)
    params = [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **rule)
              for i in range(SAMPLES)]
    got: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPT, p, budget=8)
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    counts = np.zeros((VOCAB,) * 3)
    for toks in got.values():
        counts[tuple(toks)] += 1
    exact = _exact_joint(hf, params[0])
    assert counts.sum() == SAMPLES
    assert _chi2_pvalue(counts, exact) > 1e-3
    # the trees really were used: many steps accepted draft tokens, some accepted two
    assert np.mean(np.array(depths) > 0) > 0.3 and max(depths) == 2
    # and the test has power: the same samples reject a slightly different temperature
    off = _exact_joint(hf, SamplingParams(max_tokens=3, **{**rule, "temperature":
                                                            rule["temperature"] * 1.15}))
    assert _chi2_pvalue(counts, off) < 1e-3
