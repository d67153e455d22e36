"""Speculative decoding in the engine is lossless whatever the drafter proposes."""

from __future__ import annotations

import pytest

from specserve.drafters.ngram import NgramDrafter
from specserve.spec.metrics import StepRecord
from specserve.types import SamplingParams
from tests.fakes import FailingDrafter, RandomDDTreeDrafter, RandomTreeDrafter
from tests.helpers import hf_greedy, random_prompts

LENGTHS = [19, 4, 33, 11, 27, 7, 41, 15]
NEW = 128


@pytest.fixture(scope="module")
def greedy_case(checkpoint_cache):
    """8 prompts, each with a repeated stretch (so n-gram lookup can hit), and HF's greedy."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    prompts = random_prompts(8, hf.config.vocab_size, LENGTHS, seed=31)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    return path, hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def _run(engine, prompts, params, budget):
    steps: list[tuple[str, StepRecord]] = []
    engine.on_step = lambda rid, s: steps.append((rid, s))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, budget)
    got = {f"r{i}": [] for i in range(len(prompts))}
    stats = {}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.stats is not None:
                stats[out.request_id] = out.stats.request
    return [got[f"r{i}"] for i in range(len(prompts))], steps, stats


def _check_accounting(outputs, steps, stats):
    for i, out in enumerate(outputs):
        rid = f"r{i}"
        mine = [s for r, s in steps if r == rid]
        # the first token comes from prefill; every other token from a speculative step
        assert sum(s.commit_len for s in mine) == len(out) - 1
        assert stats[rid].committed_tokens == len(out) - 1
        assert stats[rid].accepted_tokens == sum(s.accepted_depth for s in mine)
        for s in mine:
            assert s.commit_len == s.accepted_depth + 1 or s.cut


DRAFTERS = {
    "ddtree-1": (lambda v: RandomDDTreeDrafter(v, seed=1), 1),
    "ddtree-4": (lambda v: RandomDDTreeDrafter(v, seed=2), 4),
    "ddtree-16": (lambda v: RandomDDTreeDrafter(v, depth=6, seed=3), 16),
    "ddtree-64": (lambda v: RandomDDTreeDrafter(v, depth=15, seed=4), 64),
    "ngram": (lambda v: NgramDrafter(), 12),
    "random-trees": (lambda v: RandomTreeDrafter(v, seed=5), 24),
}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_lossless(greedy_case, make_engine, drafter, page_size):
    path, hf, prompts, expected = greedy_case
    make, budget = DRAFTERS[drafter]
    engine = make_engine(path, page_size=page_size, max_draft_tokens=64,
                         max_num_batched_tokens=64)
    engine.set_drafter(make(hf.config.vocab_size))
    outputs, steps, stats = _run(engine, prompts, SamplingParams(max_tokens=NEW,
                                                                 ignore_eos=True), budget)
    assert outputs == expected
    _check_accounting(outputs, steps, stats)
    if drafter == "ngram":  # prompt lookup really accepted tokens on these repetitive outputs
        assert sum(s.accepted_depth for _, s in steps) > NEW


def test_autoregressive_engine_equals_hf(greedy_case, make_engine):
    path, _, prompts, expected = greedy_case
    engine = make_engine(path, page_size=16)
    assert engine.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True)) == expected


def test_stop_token_cuts_a_step(greedy_case, make_engine):
    path, hf, prompts, expected = greedy_case
    engine = make_engine(path, page_size=16, max_draft_tokens=16)
    engine.set_drafter(NgramDrafter())
    stop = expected[0][40]
    cut_at = expected[0].index(stop, 1) if stop in expected[0][1:] else 0
    outputs, steps, stats = _run(engine, prompts[:1], SamplingParams(
        max_tokens=NEW, stop_token_ids=(stop,)), 16)
    assert outputs[0] == expected[0][: cut_at + 1]
    _check_accounting(outputs, steps, stats)


def test_max_tokens_cut_and_seeded_sampling_matches_ar(greedy_case, make_engine):
    path, hf, prompts, _ = greedy_case
    params = [SamplingParams(max_tokens=37 + i, temperature=0.9, top_k=40, top_p=0.95,
                             seed=i, ignore_eos=True) for i in range(4)]
    ar = make_engine(path)
    ar_out = [ar.generate([p], q)[0] for p, q in zip(prompts, params, strict=False)]
    engine = make_engine(path, max_draft_tokens=16)
    engine.set_drafter(NgramDrafter())
    spec_out = [engine.generate([p], q, budget=16)[0]
                for p, q in zip(prompts, params, strict=False)]
    # one draw per committed token: the same generator gives the same samples
    assert spec_out == ar_out
    assert [len(o) for o in spec_out] == [37, 38, 39, 40]


def test_failing_drafter_degrades_to_autoregressive(greedy_case, make_engine):
    path, _, prompts, expected = greedy_case
    engine = make_engine(path, max_draft_tokens=8)
    engine.set_drafter(FailingDrafter())
    outputs, steps, _ = _run(engine, prompts[:3], SamplingParams(max_tokens=20,
                                                                 ignore_eos=True), 8)
    assert outputs == [e[:20] for e in expected[:3]]
    assert all(s.commit_len == 1 and "drafter exploded" in s.fallback for _, s in steps)


def test_drafter_is_released_and_budget_validated(greedy_case, make_engine):
    path, hf, prompts, _ = greedy_case
    engine = make_engine(path, max_draft_tokens=8)
    drafter = RandomTreeDrafter(hf.config.vocab_size)
    engine.set_drafter(drafter)
    engine.generate(prompts[:2], SamplingParams(max_tokens=5, ignore_eos=True), budget=8)
    engine.add_request("x", prompts[0], SamplingParams(max_tokens=50), budget=8)
    engine.step()
    engine.abort("x")
    assert len(drafter.released) == 3 and drafter.released[-1] == "x"
    with pytest.raises(ValueError, match="budget must be in"):
        engine.add_request("y", prompts[0], SamplingParams(), budget=9)


def test_greedy_walks_read_the_steps_one_argmax_beside_sampled_requests(
        greedy_case, make_engine, monkeypatch):
    """The step's forward takes one argmax of its logits rows to the host; each greedy tree's
    accept walk reads its rows of it (equal to its rows' own argmax), while a sampled request
    in the same steps still samples: the greedy outputs are transformers', the sampled one is
    plain decoding's with the same seed."""
    import specserve.engine.postprocess as post

    path, hf, prompts, expected = greedy_case
    seen, real = [], post.accept

    def spy(logits, tree, params, generator, argmax=None):
        if params.greedy:
            seen.append(argmax == logits.argmax(-1).tolist())
        return real(logits, tree, params, generator, argmax)

    monkeypatch.setattr(post, "accept", spy)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=3, ignore_eos=True)
    want = make_engine(path).generate([prompts[1]], sampled)[0]
    engine = make_engine(path, max_draft_tokens=16)
    engine.set_drafter(RandomDDTreeDrafter(hf.config.vocab_size, depth=6, seed=7))
    for i, q in enumerate((greedy, sampled, greedy)):
        engine.add_request(f"r{i}", prompts[i], q, 16)
    got = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert got["r0"] == expected[0][:24] and got["r2"] == expected[2][:24]
    assert got["r1"] == want and len(seen) > 20 and all(seen)
