"""Stop strings in the in-process engine with speculation: a step that accepts several tokens
ends the request at the token whose text completes the stop string — its token ids, count and
logprobs are those of transformers' greedy tokens cut there, whatever the drafter and budget
(as the gateway cuts them), and the text leaves the stop string out."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
from specserve.demo import default_pair
from specserve.drafters.dflash import DFlashDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.engine import Engine
from specserve.models.dflash import load_dflash
from specserve.tokenizer import Tokenizer
from specserve.types import FinishReason, SamplingParams

TARGET, DRAFTER = default_pair()
pytestmark = pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")
PROMPT = "The cat sat on the mat. The cat sat on the mat. The dog sat on the log. The"


@pytest.fixture(scope="module")
def oracle():
    """transformers' greedy continuation of PROMPT, and the tokenizer."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    tok = Tokenizer.from_dir(TARGET)
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=True)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist(), tok


def _cut(tokens: list[int], tok: Tokenizer, stop: str) -> list[int]:
    """The tokens up to the first whose text completes `stop`."""
    return next(tokens[:k] for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))


def _engine(kind: str) -> Engine:
    engine = Engine(EngineConfig(TARGET, max_draft_tokens=16))
    if kind == "dflash":
        engine.set_drafter(DFlashDrafter(load_dflash(DRAFTER, TARGET), num_pages=256))
    elif kind == "ngram":
        engine.set_drafter(NgramDrafter())
    return engine


@pytest.mark.parametrize("stop", [" sat", "log. The c", "on t"])
@pytest.mark.parametrize("kind, budget", [("none", 0), ("ngram", 15), ("dflash", 15)])
def test_a_stop_string_ends_the_request_at_its_token(oracle, stop, kind, budget):
    greedy, tok = oracle
    want = _cut(greedy, tok, stop)
    engine = _engine(kind)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=40, stop=(stop,), logprobs=0),
                       budget=budget)
    ids, text, logprobs, outs = [], "", 0, []
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.new_token_ids
            text += out.text_delta
            logprobs += len(out.logprobs)
            outs.append(out)
    assert ids == want and logprobs == len(want) and outs[-1].num_output_tokens == len(want)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert text == tok.decode(want)[: tok.decode(want).index(stop)]
    if kind != "none":  # the check is about a step that accepted tokens past the stop
        assert any(len(o.new_token_ids) > 1 for o in outs), "no step accepted several tokens"


@pytest.mark.parametrize("kind, budget", [("none", 0), ("dflash", 15)])
def test_a_stop_token_id_is_counted_and_left_out_of_the_text(oracle, kind, budget):
    """`stop_token_ids`: the request ends at the id (its token and count kept), and the id's
    text is not in the text — vLLM's default (no include_stop_str_in_output)."""
    greedy, tok = oracle
    k = next(i for i in range(3, len(greedy)) if tok.decode(greedy[i:i + 1]).strip()
             and greedy[i] not in greedy[:i])  # a token with text, first seen here
    engine = _engine(kind)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=40, stop_token_ids=(greedy[k],)),
                       budget=budget)
    ids, text, outs = [], "", []
    while engine.has_unfinished:
        for out in engine.step():
            ids, text = ids + out.new_token_ids, text + out.text_delta
            outs.append(out)
    assert ids == greedy[:k + 1] and outs[-1].num_output_tokens == k + 1
    assert outs[-1].finish_reason is FinishReason.STOP
    assert text == tok.decode(greedy[:k]) != tok.decode(greedy[:k + 1])


@pytest.mark.parametrize("kind, budget", [("none", 0), ("ngram", 15)])
def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_id(oracle, kind,
                                                                          budget):
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string (not a
    character past it), or keeps the ending stop id's text; the tokens are the same as
    without it."""
    greedy, tok = oracle
    stop = "log. The c"
    want = _cut(greedy, tok, stop)
    text = tok.decode(want)
    for params, ids_want, text_want in (
            (SamplingParams(max_tokens=40, stop=(stop,), include_stop_str_in_output=True),
             want, text[: text.index(stop) + len(stop)]),
            (SamplingParams(max_tokens=40, stop_token_ids=(greedy[5],),
                            include_stop_str_in_output=True),
             greedy[:greedy.index(greedy[5]) + 1],
             tok.decode(greedy[:greedy.index(greedy[5]) + 1]))):
        engine = _engine(kind)
        engine.add_request("r", PROMPT, params, budget=budget)
        ids, got = [], ""
        while engine.has_unfinished:
            for out in engine.step():
                ids, got = ids + out.new_token_ids, got + out.text_delta
        assert ids == ids_want and got == text_want
