"""The engine: continuous batching with chunked prefill gives what each request gives alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specserve.errors import InvalidRequest
from specserve.types import FinishReason, SamplingParams
from tests.helpers import random_prompts, run_together

LENGTHS = [37, 5, 61, 18, 44, 2, 29, 53]


def _run_alone(engine, prompts, params_list):
    return [engine.generate([p], params)[0] for p, params in zip(prompts, params_list, strict=True)]


def _run_together(engine, prompts, params_list):
    return run_together(engine, prompts, params_list)


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_chunked_prefill_equals_alone(checkpoint_cache, make_engine, page_size):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    prompts = random_prompts(8, hf.config.vocab_size, LENGTHS, seed=21)
    params = [SamplingParams(max_tokens=24 + 3 * i, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=30, temperature=0.8, top_k=50, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i in range(8)]
    alone = _run_alone(make_engine(path, page_size=page_size, max_num_batched_tokens=4096),
                       prompts, params)
    # chunk (token budget) 13 < every long prompt: prefill is spread over many steps
    engine = make_engine(path, page_size=page_size, max_num_batched_tokens=13, max_num_seqs=5)
    together, steps = _run_together(engine, prompts, params)
    assert together == alone
    assert [len(t) for t in together] == [p.max_tokens for p in params]
    assert steps > sum(LENGTHS) // 13  # prefill really was chunked


def test_seeded_sampling_is_reproducible_and_seed_dependent(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("llama-gqa4-llama3")
    engine = make_engine(path)
    prompt = random_prompts(1, hf.config.vocab_size, [11], seed=2)[0]
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], p)
    c = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=1.0, seed=8,
                                                  ignore_eos=True))[0]
    assert a == b and a != c


def test_stop_token_and_max_tokens(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    engine = make_engine(path)
    prompt = random_prompts(1, hf.config.vocab_size, [9], seed=4)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = full[12]
    first = full.index(stop)
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == full[: first + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].num_output_tokens == first + 1


def test_max_tokens_beyond_the_context_is_invalid(checkpoint_cache, make_engine):
    """prompt + max_tokens must fit the model's context: one token over is refused (nothing
    queued), exactly at it the request runs to max_tokens."""
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    engine = make_engine(path, max_model_len=40)
    prompt = random_prompts(1, hf.config.vocab_size, [33], seed=4)[0]
    for max_tokens in (8, 100):
        message = (rf"maximum context length is 40 tokens\. However, you requested "
                   rf"{33 + max_tokens} tokens \(33 in the prompt, {max_tokens} in max_tokens\)")
        with pytest.raises(InvalidRequest, match=message):
            engine.add_request("c", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert not engine.has_unfinished and "c" not in engine.requests
    engine.add_request("c", prompt, SamplingParams(max_tokens=7, ignore_eos=True))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 7
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_warm_up_fits_a_short_context(checkpoint_cache, make_engine):
    """The warm-up request (53 tokens of trees for max_draft_tokens 20) fits a 30-token context."""
    from specserve.engine.warmup import warm_up_engine

    path, _ = checkpoint_cache("qwen3-gqa1-tied")
    engine = make_engine(path, max_model_len=30, max_draft_tokens=20)
    steps = []
    engine.on_step = lambda rid, s: steps.append(s)
    warm_up_engine(engine)
    assert steps and not engine.has_unfinished and not engine.requests


BAD_INPUTS = [
    ([], {}, "prompt is empty"),
    ([i % 200 for i in range(600)], {}, "prompt has 600 tokens"),
    ([1, 2, 211], {}, r"out of vocabulary \[0, 211\): \[211\]"),
    ([1, -3], {}, "out of vocabulary"),
    (np.array([5, 211, 7], dtype=np.int64), {}, r"out of vocabulary \[0, 211\): \[211\]"),
    ([1.7, 2.2, 3.9], {}, "prompt token ids must be integers, got 1.7"),  # not truncated
    ([4, True, False], {}, "must be integers, got True"),
    (["1", "2"], {}, "must be integers, got '1'"),
]
BAD_PARAMS = [  # (kwargs, message, the param the error names); the wire's ranges included
    (dict(max_tokens=0), r"max_tokens must be an integer in \[1, 2147483647\]", "max_tokens"),
    (dict(max_tokens=-4), "max_tokens", "max_tokens"),
    (dict(max_tokens=2**31), "got 2147483648", "max_tokens"),
    (dict(temperature=-0.1), "temperature must be in", "temperature"),
    (dict(temperature=1e300), "got 1e[+]?300", "temperature"),
    (dict(temperature=float("nan")), "temperature", "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]", "top_p"),
    (dict(top_p=1.5), "top_p", "top_p"),
    (dict(top_k=0), r"top_k must be an integer in \[1, 2147483647\]", "top_k"),
    (dict(top_k=10**12), "top_k", "top_k"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*64\)", "seed"),
    (dict(seed=2**64), "seed", "seed"),
    (dict(stop=("",)), "stop strings must be non-empty", "stop"),
    (dict(stop_token_ids=(3, 2**63)), "stop_token_ids", "stop_token_ids"),
    (dict(max_tokens=True), "max_tokens must be an integer", "max_tokens"),  # bools are not
    (dict(seed=False), "seed must be an integer", "seed"),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'", "temperature"),
    (dict(ignore_eos="no"), "ignore_eos must be a bool, got 'no'", "ignore_eos"),
]


def test_bad_input_rejected_others_unaffected(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_num_batched_tokens=16)
    good = random_prompts(3, hf.config.vocab_size, [20, 7, 31], seed=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [engine.generate([p], params)[0] for p in good]
    for i, p in enumerate(good):
        engine.add_request(f"g{i}", p, params)
    engine.step()  # the good requests are mid-prefill when the bad ones arrive
    for prompt, _, msg in BAD_INPUTS:
        with pytest.raises(InvalidRequest, match=msg):
            engine.add_request(f"bad{len(prompt)}", prompt, params)
    for kwargs, msg, param in BAD_PARAMS:
        with pytest.raises(InvalidRequest, match=msg) as err:
            SamplingParams(**kwargs)
        assert err.value.param == param
    assert SamplingParams(max_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**64 - 1,
                          temperature=3.4e38, stop_token_ids=(2**63 - 1,)).seed == 2**64 - 1
    with pytest.raises(InvalidRequest, match=r"stop_token_ids out of vocabulary \[0, 211\): "
                       r"\[211, 4000\]") as err:
        engine.add_request("s", good[0], replace(params, stop_token_ids=(5, 211, 4000)))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("g0", good[0], params)
    for rid, msg in (("", "non-empty string"), (123, "non-empty string, got 123"),
                     ("x" * 257, "request id of 257 characters; at most 256")):
        with pytest.raises(InvalidRequest, match=msg):
            engine.add_request(rid, good[0], params)
    for budget in (2.5, True, -1):
        with pytest.raises(InvalidRequest, match="budget must be in"):
            engine.add_request("b", good[0], params, budget=budget)
    with pytest.raises(InvalidRequest, match="needs a tokenizer"):
        engine.add_request("t", "hello", params)
    got = {f"g{i}": [] for i in range(3)}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[f"g{i}"] for i in range(3)] == expected


def test_out_of_pages_queues_or_rejects(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    # 6 pages of 16 slots: each request below needs 2 pages to start (30 prompt tokens) and 3 by
    # its end (+ 12 new tokens): 3 start, then growing past 32 tokens preempts the newest, which
    # is recomputed later with its output unchanged
    engine = make_engine(path, page_size=16, num_pages=6)
    prompts = random_prompts(5, hf.config.vocab_size, [30], seed=9)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [engine.generate([p], params)[0] for p in prompts]
    with pytest.raises(InvalidRequest, match="needs 7 KV pages .* can never run"):
        engine.add_request("huge", list(range(100)), params)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    first = engine.step()
    assert len(engine.scheduler.running) == 3 and len(engine.scheduler.waiting) == 2
    assert engine.blocks.num_reserved_pages == 6
    got = {f"q{i}": [] for i in range(5)}
    for out in first:
        got[out.request_id].extend(out.new_token_ids)
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            assert engine.blocks.num_used_pages <= 6
    assert [got[f"q{i}"] for i in range(5)] == alone
    assert engine.scheduler.num_preempted > 0


def test_abort_frees_pages_at_once(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    engine = make_engine(path, page_size=4)
    engine.add_request("a", random_prompts(1, hf.config.vocab_size, [23])[0],
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.num_used_pages == 6
    assert engine.abort("a") and not engine.abort("a")
    assert engine.blocks.num_used_pages == 0 and not engine.has_unfinished


def test_next_step_full_counts_slots_and_prompt_tokens(checkpoint_cache, make_engine):
    """The waiting requests fill the next step once their prompts reach its token budget, or
    their number its free request slots (where the verifier's admission window stops)."""
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b, c, d = random_prompts(4, hf.config.vocab_size, [17, 22, 3, 5], seed=4)
    engine = make_engine(path, page_size=4, max_num_batched_tokens=40, max_num_seqs=3)
    sched = engine.scheduler
    assert not sched.next_step_full  # nothing waits
    engine.add_request("a", a, params)
    engine.add_request("b", b, params)
    assert not sched.next_step_full  # 39 of 40 tokens, 2 of 3 slots
    engine.add_request("c", c, params)
    assert sched.next_step_full  # 42 tokens
    while engine.has_unfinished:
        engine.step()
    slots = make_engine(path, page_size=4, max_num_batched_tokens=40, max_num_seqs=2)
    slots.add_request("c", c, params)
    assert not slots.scheduler.next_step_full
    slots.add_request("d", d, params)
    assert slots.scheduler.next_step_full  # 8 tokens, but both slots
    while slots.has_unfinished:
        slots.step()


def test_has_prompt_work_until_the_last_chunk_is_computed(checkpoint_cache, make_engine):
    """A step carries prompt tokens while a request waits or one running is still prefilling
    (a prompt longer than the token budget spans steps); pure decode steps do not."""
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    (prompt,) = random_prompts(1, hf.config.vocab_size, [53], seed=11)
    engine = make_engine(path, page_size=4, max_num_batched_tokens=24, max_num_seqs=2)
    sched = engine.scheduler
    assert not sched.has_prompt_work  # nothing at all
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    seen = [sched.has_prompt_work]
    while engine.has_unfinished:
        engine.step()
        seen.append(sched.has_prompt_work)
    # waiting; 24 of 53 prompt tokens, 48 of 53 (running, in prefill); then decode only
    assert seen[:3] == [True, True, True] and not any(seen[3:]) and len(seen) > 4, seen


def test_a_request_waiting_for_a_slot_or_pages_is_no_prompt_work(checkpoint_cache,
                                                                 make_engine):
    """A request that cannot be admitted does not make the running requests' decode steps
    prompt steps (under --threads auto those take every core: beside a drafter and any other
    load on the host they ran 12-15 x slower while a request waited)."""
    path, hf = checkpoint_cache("qwen3-gqa1-tied")
    prompts = random_prompts(3, hf.config.vocab_size, [9, 11, 13], seed=12)
    engine = make_engine(path, page_size=4, max_num_seqs=1)
    sched = engine.scheduler
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # a's prompt: it decodes from here
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))
    waited = []
    while "a" in {s.request_id for s in sched.running}:
        waited.append(sched.has_prompt_work)  # b waits for the one slot
        engine.step()
    assert waited and not any(waited), waited
    assert sched.has_prompt_work  # a is gone: b is admitted by the next step
    while engine.has_unfinished:
        engine.step()
    small = make_engine(path, page_size=4, max_num_seqs=2, num_pages=6)  # 24 slots
    small.add_request("c", prompts[2], SamplingParams(max_tokens=3, ignore_eos=True))
    small.step()  # c holds 4 pages: 2 are left
    small.add_request("d", prompts[2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert not small.scheduler.blocks.can_reserve(len(prompts[2]))  # d waits for pages
    assert not small.scheduler.has_prompt_work
    while small.has_unfinished:
        small.step()
