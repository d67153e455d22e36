"""Admission by need and preemption (engine/scheduler.py): one request whose max_tokens is
about the whole KV pool no longer starves the others — they are admitted with what they need
now, finish first, and a request preempted when the pool runs out is recomputed with its output
unchanged (greedy and seeded sampling, with speculation); the waiting queue is bounded."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.engine import Engine
from specserve.errors import CapacityExhausted
from specserve.types import SamplingParams
from tests.helpers import AheadDrafter, ScoredAheadDrafter, random_prompts

PAGE = 8


def _engine(path, num_pages: int, max_waiting: int | None = None, drafter=NgramDrafter,
            max_num_seqs: int = 64) -> Engine:
    engine = Engine(EngineConfig(str(path), page_size=PAGE, num_pages=num_pages,
                                 max_draft_tokens=8, max_num_batched_tokens=48,
                                 max_waiting=max_waiting, max_num_seqs=max_num_seqs,
                                 adaptive=drafter is ScoredAheadDrafter))
    engine.set_drafter(drafter())
    return engine


def _requests(vocab: int):
    prompts = random_prompts(9, vocab, [21, 9, 14, 25, 6, 17, 11, 23, 13], seed=31)
    prompts = [p * 2 for p in prompts]  # some repetition: the n-gram drafter gets accepted
    out = [("big", prompts[0], SamplingParams(max_tokens=300, ignore_eos=True), 6)]
    for i, p in enumerate(prompts[1:], 1):
        seed = 100 + i if i % 3 == 0 else None
        params = SamplingParams(max_tokens=18 + 5 * i, temperature=0.8 if seed else 0.0,
                                seed=seed, ignore_eos=True)
        out.append((f"s{i}", p, params, (0, 4, 8)[i % 3]))
    return out


def _alone(path, req) -> list[int]:
    engine = _engine(path, num_pages=512)
    rid, prompt, params, budget = req
    engine.add_request(rid, prompt, params, budget)
    tokens = []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("drafter", [NgramDrafter, AheadDrafter, ScoredAheadDrafter])
def test_a_pool_sized_request_does_not_starve_the_rest(checkpoint_cache, drafter):
    """Also with the next drafts sent ahead (AheadDrafter): a preempted request's draft in
    flight is dropped, and its recomputed output is still the same; and with adaptive
    speculation on top (ScoredAheadDrafter), where the greedy requests' outputs are."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    reqs = _requests(hf.config.vocab_size)
    want = {r[0]: _alone(path, r) for r in reqs}
    # the big one alone needs (42 + 300 + 9) / 8 = 44 pages of the 56
    engine = _engine(path, num_pages=56, drafter=drafter)
    for req in reqs:
        engine.add_request(*req)
    got, finished = {r[0]: [] for r in reqs}, []
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append(out.request_id)
        assert engine.blocks.num_used_pages <= engine.blocks.num_reserved_pages <= 56
    if drafter is ScoredAheadDrafter:  # other trees: sampled tokens may differ, greedy not
        got, want = ({r[0]: d[r[0]] for r in reqs if not r[2].temperature} for d in (got, want))
    assert got == want
    assert finished[-1] == "big" and len(finished) == len(reqs)
    assert engine.scheduler.num_preempted > 0  # the pool ran out on the way
    assert engine.blocks.num_used_pages == engine.blocks.num_reserved_pages == 0
    if drafter is AheadDrafter:
        assert sum(kind == "ahead" for kind, _ in engine.drafter.calls) > 50


def test_the_waiting_queue_is_bounded(checkpoint_cache):
    """max_num_seqs 2, max_waiting 2: four requests arriving between two steps are taken (the
    next step starts two of them), the fifth is refused until one of them finishes."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    engine = _engine(path, num_pages=64, max_waiting=2, max_num_seqs=2)
    prompts = random_prompts(6, hf.config.vocab_size, [7, 12, 5, 9, 6, 8], seed=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params)
    with pytest.raises(CapacityExhausted, match="queue is full: 2 requests are waiting"):
        engine.add_request("r4", prompts[4], params)
    assert "r4" not in engine.requests
    engine.step()  # two are admitted, two wait: still full
    with pytest.raises(CapacityExhausted, match="queue is full: 2 requests are waiting"):
        engine.add_request("r4", prompts[4], params)
    while len(engine.scheduler.waiting) == 2:
        engine.step()
    engine.add_request("r4", prompts[4], params)  # one started: room again
    while engine.has_unfinished:
        engine.step()
    assert engine.blocks.num_used_pages == engine.blocks.num_reserved_pages == 0
