"""Drafting overlapped with the verifier's work (engine/overlap.py) — the next drafts sent
during the commit (`draft_ahead`), or two groups taking turns (`overlap`): every request sees
exactly the trees, acceptance and tokens of the serial loop — greedy and seeded sampling, with a
request that does not speculate, one that is aborted while its draft is in flight and one that
starts decoding late."""

from __future__ import annotations

from collections import Counter

import pytest

from specserve.config import EngineConfig
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.engine import Engine
from specserve.types import SamplingParams
from tests.helpers import AheadDrafter, ScoredAheadDrafter, random_prompts

PAGE = 8


def _requests(vocab: int):
    base = random_prompts(6, vocab, [9, 14, 5, 11, 7, 20], seed=12)
    prompts = [p * 4 for p in base]  # repetitive: the n-gram drafter gets accepted
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (37, 24, 50, 31, 45, 12)]
    params[2] = SamplingParams(max_tokens=50, temperature=0.9, top_k=40, seed=5,
                               ignore_eos=True)
    budgets = [6, 9, 4, 0, 7, 5]  # r3 does not speculate
    return [(f"r{i}", p, s, b) for i, (p, s, b) in enumerate(zip(prompts, params, budgets,
                                                                   strict=True))]


def _run(path, requests, mode: str, abort_at: int | None = None, switch_at: int | None = None,
         drafter=None, adaptive: bool = False):
    """`mode`: serial | ahead | overlap; `switch_at`: the drafter (stateless: trees from the
    history) is set at that step, the steps before draft with a synchronous one."""
    engine = Engine(EngineConfig(str(path), page_size=PAGE, max_draft_tokens=16,
                                 max_num_batched_tokens=64, overlap=mode == "overlap",
                                 draft_ahead=mode == "ahead", adaptive=adaptive))
    drafter = drafter or AheadDrafter()
    engine.set_drafter(drafter if switch_at is None else NgramDrafter())
    steps: dict[str, list[tuple[int, int, int]]] = {rid: [] for rid, *_ in requests}
    per_step: list[set[str]] = []
    engine.on_step = lambda rid, s: (steps[rid].append((s.tree_size, s.accepted_depth,
                                                        s.commit_len)), per_step[-1].add(rid))
    tokens = {rid: [] for rid, *_ in requests}
    for rid, prompt, params, budget in requests[:-1]:
        engine.add_request(rid, prompt, params, budget)
    n = 0
    while engine.has_unfinished:
        if n == 6:  # the last one arrives while the others decode
            engine.add_request(*requests[-1])
        if abort_at is not None and n == abort_at:
            engine.abort("r4")
        if n == switch_at:
            engine.set_drafter(drafter)
        per_step.append(set())
        drafter.step = n
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        n += 1
    assert engine.blocks.num_used_pages == 0
    return tokens, steps, per_step, drafter


@pytest.mark.parametrize("abort_at", [None, 9])
def test_two_groups_give_the_serial_loop_exactly(checkpoint_cache, abort_at):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    requests = _requests(hf.config.vocab_size)
    ref_tokens, ref_steps, _, _ = _run(path, requests, mode="serial", abort_at=abort_at)
    tokens, steps, per_step, drafter = _run(path, requests, mode="overlap", abort_at=abort_at)
    calls = drafter.calls
    if abort_at is None:
        assert tokens == ref_tokens and steps == ref_steps
    else:  # r4's tokens stop wherever its abort caught it; everyone else is exact
        assert {k: v for k, v in tokens.items() if k != "r4"} == \
            {k: v for k, v in ref_tokens.items() if k != "r4"}
        assert {k: v for k, v in steps.items() if k != "r4"} == \
            {k: v for k, v in ref_steps.items() if k != "r4"}
    assert max(c for s in ref_steps.values() for _, _, c in s) > 2  # drafts were accepted
    speculating = {"r0", "r1", "r2", "r4"}
    busy = [s & speculating for s in per_step if len(s & speculating) > 1]
    assert busy and all(len(s) < len(speculating) for s in busy)  # one group a step
    # the other group's draft is its next step's, sent while it sits this one out (`ahead`:
    # traces open that step's spans; sent as this step's, they ended as errors)
    ahead = [ids for kind, ids in calls if kind == "ahead"]
    assert len(ahead) > 10 and all(ids for ids in ahead)
    assert not any(kind == "submit" for kind, _ in calls)


def test_one_speculating_request_runs_serially(checkpoint_cache):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    requests = _requests(hf.config.vocab_size)[:2]
    requests = [requests[0], (requests[1][0], requests[1][1], requests[1][2], 0)]
    ref_tokens, ref_steps, _, _ = _run(path, requests, mode="serial")
    tokens, steps, _, drafter = _run(path, requests, mode="overlap")
    calls = drafter.calls
    assert tokens == ref_tokens and steps == ref_steps
    assert all(kind == "draft" for kind, _ in calls)  # nothing to overlap with


@pytest.mark.parametrize("abort_at", [None, 9])
def test_drafts_sent_ahead_give_the_serial_loop_exactly(checkpoint_cache, abort_at):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    requests = _requests(hf.config.vocab_size)
    ref_tokens, ref_steps, _, ref = _run(path, requests, mode="serial", abort_at=abort_at)
    tokens, steps, _, drafter = _run(path, requests, mode="ahead", abort_at=abort_at)
    ref_calls, calls = ref.calls, drafter.calls
    assert tokens == ref_tokens and steps == ref_steps  # the same steps: r4's abort too
    assert max(c for s in ref_steps.values() for _, _, c in s) > 2  # drafts were accepted
    assert {kind for kind, _ in ref_calls} == {"draft"}
    ahead = [ids for kind, ids in calls if kind == "ahead"]
    # every step is drafted ahead — a request's first too (sent when its prompt's last chunk
    # is done) — all speculating requests in one batch
    assert {kind for kind, _ in calls} == {"ahead"}
    assert len(ahead) > 20 and max(len(ids) for ids in ahead) == 5
    assert all("r3" not in ids for ids in ahead)  # budget 0: never drafted
    if abort_at is not None:  # r4's next draft was in flight when it was aborted
        assert "r4" in drafter.sent_ahead[abort_at - 1]
        assert all("r4" not in ids for n, ids in drafter.sent_ahead.items() if n >= abort_at)


def test_requests_decoding_when_drafts_ahead_begin_are_drafted_at_once(checkpoint_cache):
    """A drafter that drafts ahead set while requests decode: nothing was sent for them, so
    that step drafts them serially, and the steps after are sent ahead — tokens and steps as
    in the serial loop."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    requests = _requests(hf.config.vocab_size)
    ref_tokens, ref_steps, _, _ = _run(path, requests, mode="serial")
    tokens, steps, _, drafter = _run(path, requests, mode="ahead", switch_at=10)
    assert tokens == ref_tokens and steps == ref_steps
    assert drafter.calls[0][0] == "draft" and len(drafter.calls[0][1]) > 1
    assert {kind for kind, _ in drafter.calls[1:]} == {"ahead"}


@pytest.mark.parametrize("abort_at", [None, 9])
def test_adaptive_speculation_sends_the_drafts_of_held_steps_ahead(checkpoint_cache, abort_at):
    """With adaptive speculation, a step whose decision to draft holds has its drafts sent
    ahead, each for the tree its shape needs (not the client's budget); decisions draft at
    once; greedy tokens are the serial loop's, a request aborted meanwhile included."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    requests = [r for r in _requests(hf.config.vocab_size) if not r[2].temperature]
    ref_tokens, *_ = _run(path, requests, mode="serial", abort_at=abort_at)
    tokens, steps, _, drafter = _run(path, requests, mode="ahead", adaptive=True,
                                     drafter=ScoredAheadDrafter(), abort_at=abort_at)
    assert tokens == ref_tokens
    kinds = Counter(kind for kind, _ in drafter.calls)
    assert kinds["ahead"] >= 5 and kinds["draft"] >= 1
    asked = [b for kind, budgets in drafter.budgets if kind == "ahead" for b in budgets]
    assert asked and max(asked) <= 9 and min(asked) < 9  # held shapes, within the budgets
    assert max(c for s in steps.values() for _, _, c in s) > 2  # drafts were accepted
