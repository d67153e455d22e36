"""Failure isolation in the engine: a request whose sampling, commit or forward input raises ends
alone with `error` (ABORT, pages and drafter state freed, no KV copies for it); the 8 requests it
was batched with give exactly what they give without it."""

from __future__ import annotations

import numpy as np
import pytest

import specserve.engine.postprocess as engine_module
from specserve.drafters.base import Drafter
from specserve.spec.tree import DraftTree
from specserve.types import FinishReason, SamplingParams
from tests.fakes import RandomTreeDrafter
from tests.helpers import random_prompts

LENGTHS = [23, 6, 41, 13, 30, 3, 52, 17, 9]  # the last prompt is the bad request's
PAGE = 4
BAD = SamplingParams(max_tokens=40, temperature=0.8, top_k=30, seed=99, ignore_eos=True)


class Injected(RuntimeError):
    pass


class OracleDrafter(Drafter):
    """Trees of a wrong depth-1 token, then the target's true continuation (`answers`: request
    id -> its tokens) as a chain beside it: accepted paths sit off rows 1..k, so every accepted
    tree needs KV copies."""

    needs_context = False

    def __init__(self, answers: dict[str, list[int]], prompt_lens: dict[str, int]) -> None:
        self.answers, self.prompt_lens = answers, prompt_lens
        self.released: list[str] = []

    def draft(self, requests):
        return [self._tree(r) for r in requests]

    def _tree(self, r) -> DraftTree:
        done = len(r.history) - self.prompt_lens[r.request_id]  # tokens generated so far
        true = self.answers[r.request_id][done : done + min(r.budget - 1, r.max_depth)]
        wrong = 1 if true and true[0] == 0 else 0
        parents = [0, 0, *range(2, len(true) + 1)][: len(true) + 1]
        return DraftTree(np.array([wrong, *true], dtype=np.int64),
                         np.array(parents, dtype=np.int32),
                         np.array([1, *range(1, len(true) + 1)], dtype=np.int32))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


@pytest.fixture(scope="module")
def case(checkpoint_cache):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    prompts = random_prompts(9, hf.config.vocab_size, LENGTHS, seed=44)
    victims = [(f"v{i}", prompts[i], _params(i), (0, 3, 8)[i % 3]) for i in range(8)]
    return path, hf.config.vocab_size, victims, ("bad", prompts[8], BAD, 8)


def _params(i: int) -> SamplingParams:
    if i % 3 == 1:  # seeded sampling: one draw per committed token, so still exact
        return SamplingParams(max_tokens=17 + i, temperature=0.9, top_p=0.9, seed=i,
                              ignore_eos=True)
    return SamplingParams(max_tokens=9 + 4 * i, ignore_eos=True)


def _engine(make_engine, case, answers):
    """An engine whose drafter knows every request's answer (a 29-token budget: prefill chunks
    ride beside other requests' verify trees)."""
    path, _, victims, bad = case
    engine = make_engine(path, page_size=PAGE, max_draft_tokens=8, max_num_batched_tokens=29)
    engine.set_drafter(OracleDrafter(answers, {r[0]: len(r[1]) for r in [*victims, bad]}))
    return engine


def _add(engine, requests) -> None:
    for rid, prompt, params, budget in requests:
        engine.add_request(rid, prompt, params, budget)


def _drain(engine, rids) -> tuple[dict[str, list[int]], dict]:
    """Step until done: each request's tokens and its final output."""
    got, finals = {rid: [] for rid in rids}, {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id not in finals  # nothing after the final output
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return got, finals


def _run(engine, requests) -> tuple[dict[str, list[int]], dict]:
    _add(engine, requests)
    return _drain(engine, [r[0] for r in requests])


def _plain_run(case, requests) -> dict[str, list[int]]:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    engine = Engine(EngineConfig(str(case[0]), page_size=PAGE, max_draft_tokens=8,
                                 max_num_batched_tokens=29, poison_kv=True))
    engine.set_drafter(RandomTreeDrafter(case[1], seed=6))
    got, _ = _run(engine, requests)
    assert [len(got[r[0]]) for r in requests] == [r[2].max_tokens for r in requests]
    return got


@pytest.fixture(scope="module")
def reference(case) -> dict[str, list[int]]:
    """The victims' tokens from a run without the bad request."""
    return _plain_run(case, case[2])


@pytest.fixture(scope="module")
def answers(case, reference) -> dict[str, list[int]]:
    """Every request's tokens, the bad one's from a run of its own without failures."""
    return reference | _plain_run(case, [case[3]])


def _check_copies_stay_in_live_pages(engine) -> list[int]:
    """Wrap `copy_slots`: every slot it touches is in a page of a request still running."""
    original, calls = engine.runner.kv.copy_slots, []

    def copy_slots(src, dst):
        live = {pg for rid in engine.requests if rid in engine.blocks
                for pg in engine.blocks.page_table(rid)}
        assert all(slot // PAGE in live for slot in [*src, *dst])
        calls.append(len(src))
        original(src, dst)

    engine.runner.kv.copy_slots = copy_slots
    return calls


def _assert_isolated(engine, got, finals, reference, failed_at: int | None = None) -> None:
    bad = finals["bad"]
    assert isinstance(bad.error, Injected) and bad.finished
    assert bad.finish_reason is FinishReason.ABORT and bad.new_token_ids == []
    if failed_at is not None:  # the tokens committed before the failure went out
        assert len(got["bad"]) == failed_at
    assert "bad" in engine.drafter.released and "bad" not in engine.requests
    assert {rid: got[rid] for rid in reference} == reference
    assert all(finals[rid].error is None for rid in reference)
    assert engine.blocks.num_used_pages == 0 and engine.blocks.num_reserved_pages == 0


def _raise_on_call(n: int, original):
    """`original(logits, ..., params, ...)`, raising Injected on the n-th call for BAD."""
    calls = [0]

    def wrapped(*args):
        if any(a is BAD for a in args):
            calls[0] += 1
            if calls[0] == n:
                raise Injected(f"injected on call {n}")
        return original(*args)

    return wrapped


@pytest.mark.parametrize("where", ["prefill-sample", "accept", "commit"])
def test_failing_request_ends_alone(case, reference, answers, make_engine, monkeypatch, where):
    _, _, victims, bad = case
    engine = _engine(make_engine, case, answers)
    copies = _check_copies_stay_in_live_pages(engine)
    if where == "prefill-sample":  # the token sampled at the end of its prompt
        monkeypatch.setattr(engine_module, "sample_rows",
                            _raise_on_call(1, engine_module.sample_rows))
    elif where == "accept":  # its third tree's accept walk
        monkeypatch.setattr(engine_module, "accept", _raise_on_call(3, engine_module.accept))
    requests = [*victims[:5], bad, *victims[5:]]
    _add(engine, requests)
    if where == "commit":  # its 6th token's append, after its tree's KV copies were planned
        seq, appended = engine.requests["bad"], []

        def append(token):
            appended.append(token)
            if len(appended) == 6:
                raise Injected("injected in commit")
            return type(seq).append(seq, token)

        seq.append = append
    got, finals = _drain(engine, [r[0] for r in requests])
    _assert_isolated(engine, got, finals, reference, 0 if where == "prefill-sample" else None)
    if where != "prefill-sample":  # what it committed before the failing step went out
        assert 0 < len(got["bad"]) < (6 if where == "commit" else BAD.max_tokens)
        assert got["bad"] == answers["bad"][: len(got["bad"])]
    assert sum(copies) > 0  # trees were accepted and compacted around the failure


@pytest.mark.parametrize("temperature", [1e-38, 1e-44])  # 1e-44: near float32 subnormal min
def test_tiny_temperature_is_greedy_beside_victims(case, reference, answers, make_engine,
                                                   temperature):
    _, _, victims, (rid, prompt, _, budget) = case
    greedy, _ = _run(_engine(make_engine, case, answers),
                     [(rid, prompt, SamplingParams(max_tokens=30, ignore_eos=True), budget)])
    tiny = SamplingParams(max_tokens=30, temperature=temperature, ignore_eos=True)
    got, finals = _run(_engine(make_engine, case, answers),
                       [*victims[:3], (rid, prompt, tiny, budget), *victims[3:]])
    assert got.pop(rid) == greedy[rid] and finals[rid].error is None
    assert got == reference


def _forward_raising(engine, monkeypatch, fails):
    """Make the runner's forward raise Injected whenever `fails(input)` for one of its inputs."""
    original, calls = engine.runner.forward, []

    def forward(inputs, logit_rows, taps=False):
        calls.append([x.request_id for x in inputs])
        if any(fails(x) for x in inputs):
            raise Injected(f"injected forward over {len(inputs)} inputs")
        return original(inputs, logit_rows, taps=taps)

    monkeypatch.setattr(engine.runner, "forward", forward)
    return calls


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_forward_failing_for_one_input_ends_it_alone(case, reference, answers, make_engine,
                                                     monkeypatch, phase):
    _, _, victims, bad = case
    engine = _engine(make_engine, case, answers)

    def fails(x) -> bool:  # a tree's root sits at the prompt's end or later; chunks before it
        return x.request_id == "bad" and (phase == "prefill" or x.ctx_len >= len(bad[1]))

    calls = _forward_raising(engine, monkeypatch, fails)
    got, finals = _run(engine, [*victims[:4], bad, *victims[4:]])
    _assert_isolated(engine, got, finals, reference, 0 if phase == "prefill" else 1)
    probes = [c for c in calls if len(c) == 1 and c != ["bad"]]
    assert ["bad"] in calls and probes  # the failed batch was re-run one input at a time


def test_forward_failing_alone_ends_the_request_and_batch_only_failure_raises(
        case, answers, make_engine, monkeypatch):
    _, _, victims, bad = case
    engine = _engine(make_engine, case, answers)
    _forward_raising(engine, monkeypatch, lambda x: x.request_id == "bad")
    got, finals = _run(engine, [bad])  # alone in its forward: it ends with the error
    assert isinstance(finals["bad"].error, Injected) and got["bad"] == []
    # a forward that fails over several inputs but over none alone is nobody's: step-wide
    calls = _forward_raising(engine, monkeypatch, lambda x: len(calls[-1]) > 1)
    _add(engine, victims[:3])
    with pytest.raises(Injected):
        engine.step()
    assert len(calls[0]) > 1 and calls[1:] == [[rid] for rid in calls[0]]
    assert sorted(engine.requests) == ["v0", "v1", "v2"]  # nobody was singled out
    # a forward that fails whatever it runs: every request ends with the error, pages freed
    _forward_raising(engine, monkeypatch, lambda x: True)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert sorted(o.request_id for o in outs) == ["v0", "v1", "v2"]
    assert all(isinstance(o.error, Injected) and o.finished for o in outs)
    assert not engine.requests and not engine.has_unfinished
    assert engine.blocks.num_used_pages == 0
