"""Generated tokens' logprobs (SamplingParams.logprobs) against transformers.

The demo pair on predictable text commits several tokens a step (DFlash trees, and the token
sampled at the end of the prompt), so each token's logprob must come from the logits row that
chose it: the oracle is transformers' forward over prompt + generated tokens, log-softmax at
the position before each one, greedy and sampled, with the top alternatives and their order.
"""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
from specserve.demo import default_pair
from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.engine import Engine
from specserve.errors import InvalidRequest
from specserve.models.dflash import load_dflash
from specserve.types import SamplingParams

TARGET, DRAFTER = default_pair()
pytestmark = pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")
PROMPT = "The cat sat on the mat. The dog sat on the log. " * 3 + "The cat"


def _run(params: SamplingParams, device: str = "cpu", dtype: str = "float32"):
    cfg = EngineConfig(TARGET, max_draft_tokens=16, device=device, dtype=dtype)
    engine = Engine(cfg)
    engine.set_drafter(DFlashDrafter(load_dflash(DRAFTER, TARGET, cfg.dtype, cfg.device),
                                     num_pages=256))
    engine.add_request("r", PROMPT, params, budget=15)
    tokens, logprobs, steps = [], [], 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs
            steps += 1
    return engine, tokens, logprobs, steps


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0, temperature=0.9, seed=11)],
    ids=["greedy", "sampled"])
def test_each_tokens_logprob_is_the_targets(hf, params):
    engine, tokens, got, steps = _run(params)
    assert len(got) == len(tokens) == 30 and steps < 20  # several tokens a step
    prompt = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    want = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)  # [30, V]
    chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t.logprob for t in got]), chosen, atol=2e-4)
    for k, t in enumerate(got):
        assert len(t.top_ids) == len(t.top_logprobs) == params.logprobs
        if t.top_ids:
            values, ids = want[k].topk(params.logprobs)
            assert list(t.top_ids) == ids.tolist()
            assert torch.allclose(torch.tensor(t.top_logprobs), values, atol=2e-4)
    if params.greedy:  # greedy picks the most likely token
        assert all(t.top_ids[0] == tok for t, tok in zip(got, tokens, strict=True))


def test_without_logprobs_none_are_computed():
    engine = Engine(EngineConfig(TARGET))
    engine.add_request("r", "The cat", SamplingParams(max_tokens=3))
    outs = [o for _ in range(5) if engine.has_unfinished for o in engine.step()]
    assert outs and all(o.logprobs is None for o in outs)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(InvalidRequest, match="logprobs"):
            SamplingParams(logprobs=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_in_bfloat16(hf):
    """CUDA graphs, fused kernels, bf16 logits: each logprob within bf16's error of
    transformers' (float32) on the same tokens; greedy's choice is the most likely token."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2)
    engine, tokens, got, steps = _run(params, "cuda", "bfloat16")
    assert len(got) == 30 and steps < 20
    prompt = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    want = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t.logprob for t in got]), chosen, atol=0.15)
    assert all(t.top_ids[0] == tok for t, tok in zip(got, tokens, strict=True))


@pytest.mark.parametrize("chunk", [7, 512], ids=["chunked", "one_chunk"])
def test_prompt_logprobs_are_the_targets(hf, chunk):
    """Each prompt token after the first, under the row before it — through prefill chunks of
    7 tokens (several chunks, a step each) or one — with its 2 best alternatives; they come
    with the first token only."""
    engine = Engine(EngineConfig(TARGET, max_num_batched_tokens=chunk))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2))
    outs = [o for _ in range(40) if engine.has_unfinished for o in engine.step()]
    got = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    prompt = engine.tokenizer.encode(PROMPT)
    assert len(got) == len(prompt) - 1
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    chosen = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t.logprob for t in got]), chosen, atol=2e-4)
    values, ids = want.topk(2, dim=-1)
    assert [list(t.top_ids) for t in got] == ids.tolist()
    assert torch.allclose(torch.tensor([t.top_logprobs for t in got]), values, atol=2e-4)


def test_prompt_logprobs_chunks_share_a_bounded_number_of_rows(monkeypatch):
    """However many ask, a step gives prompt-logprob chunks PROMPT_LOGPROB_ROWS rows in all (so
    their logits stay bounded), and a request that did not ask is not held back."""
    import specserve.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_ROWS", 16)
    engine = Engine(EngineConfig(TARGET, max_num_batched_tokens=256))
    for rid, n in (("a", 0), ("b", 1), ("c", None)):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=n))
    seen, schedule = [], engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append({w.seq.request_id: w.num_tokens for w in out if w.seq.in_prefill})
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    firsts = {o.request_id: o for _ in range(60) if engine.has_unfinished
              for o in engine.step() if o.prompt_logprobs is not None}
    prompt = engine.tokenizer.encode(PROMPT)
    assert all(step.get("a", 0) + step.get("b", 0) <= 16 for step in seen), seen
    assert seen[0] == {"a": 16, "c": len(prompt)}  # b waits for rows; c for nothing
    assert [len(firsts[r].prompt_logprobs) for r in "ab"] == [len(prompt) - 1] * 2
    assert [t.logprob for t in firsts["a"].prompt_logprobs] == pytest.approx(
        [t.logprob for t in firsts["b"].prompt_logprobs], abs=1e-5)  # chunked differently


def _drain(engine: Engine, limit: int = 200, preempt_at: int | None = None) -> list:
    outs = []
    for i in range(limit):
        if not engine.has_unfinished:
            break
        if i == preempt_at:  # as when the KV pool runs out: recomputed later
            engine.scheduler._preempt(engine.requests["r"])
        outs += engine.step()
    return outs


def test_a_logprob_failure_ends_its_request_alone(monkeypatch):
    """A failure computing one request's prompt or token logprobs ends that request, with one
    output, and the step's other requests go on."""
    import specserve.engine.postprocess as postprocess

    real = postprocess.token_logprobs

    def boom(logits, tokens, top):
        if top == 3:
            raise RuntimeError("boom")
        return real(logits, tokens, top)

    monkeypatch.setattr(postprocess, "token_logprobs", boom)
    engine = Engine(EngineConfig(TARGET))
    engine.add_request("prompt", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=3))
    engine.add_request("token", PROMPT, SamplingParams(max_tokens=3, logprobs=3))
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=3, logprobs=1))
    outs = _drain(engine)
    for rid in ("prompt", "token"):
        (out,) = [o for o in outs if o.request_id == rid]
        assert isinstance(out.error, RuntimeError)
    good = [o for o in outs if o.request_id == "good"]
    assert sum(len(o.new_token_ids) for o in good) == 3 and good[-1].error is None
    assert engine.blocks.num_used_pages == 0


@pytest.mark.parametrize("at", [1, 3], ids=["mid_prompt", "decoding"])
def test_a_preempted_request_keeps_its_logprobs(monkeypatch, at):
    import specserve.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_ROWS", 8)

    def run(preempt_at):
        engine = Engine(EngineConfig(TARGET))
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=1,
                                                       logprobs=1))
        return _drain(engine, preempt_at=preempt_at)

    a, b = run(None), run(at)
    pa, pb = ([o.prompt_logprobs for o in x if o.prompt_logprobs is not None] for x in (a, b))
    assert len(pa) == len(pb) == 1 and len(pa[0]) == len(pb[0]) > 8
    assert [t.logprob for t in pa[0]] == pytest.approx([t.logprob for t in pb[0]], abs=1e-4)
    assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids]
    assert [t.logprob for o in a for t in o.logprobs] == \
        pytest.approx([t.logprob for o in b for t in o.logprobs], abs=1e-4)
