"""OpenAI request bodies → validated gateway requests (what is taken, what is refused with which
status and param), and the response shapes built from a finished generation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from services.gateway import openai_responses as out
from services.gateway.convert import GatewayFinal
from services.gateway.openai_api import ApiError, parse
from specserve.chat_template import ChatTemplate
from specserve.demo import default_pair
from specserve.models.generation_config import GenerationDefaults
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FinishReason, SamplingParams

MODEL = "tiny-model"


@dataclass
class SimpleStep:
    token_ids: tuple
    logprobs: tuple
    prompt_logprobs: tuple = ()
    prompt_ids: tuple = ()


@dataclass
class SimpleChunk:
    text: str
    step: SimpleStep
TEMPLATE = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _completion(**body):
    return parse({"model": MODEL, "prompt": "Hi there", **body}, False, MODEL, None)


def _chat(**body):
    return parse({"model": MODEL, "messages": [{"role": "user", "content": "Hey"}], **body},
                 True, MODEL, TEMPLATE)


def test_a_completion_takes_every_supported_parameter():
    api = _completion(max_tokens=7, temperature=0.7, top_p=0.9, top_k=13, seed=5,
                      stop=["\n\n", "END"], budget=9, drafter="ngram", ignore_eos=True,
                      stream=True, stream_options={"include_usage": True,
                                                   "include_obfuscation": False}, user="x",
                      safety_identifier="u1", prompt_cache_key="k", prompt_cache_retention="24h")
    r = api.request
    assert (r.text, r.token_ids, r.drafter, r.budget) == ("Hi there", None, "ngram", 9)
    assert r.params == SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=13,
                                      seed=5, stop=("\n\n", "END"), ignore_eos=True)
    assert api.stream and api.include_usage and not api.chat
    assert api.id.startswith("cmpl-") and api.id.endswith(r.request_id)


def test_prompt_forms_and_defaults():
    assert _completion(prompt=[[5, 17, 3]]).request.token_ids == (5, 17, 3)
    assert _completion(prompt=["one"]).request.text == "one"
    plain = _completion().request
    assert plain.params == SamplingParams(max_tokens=SamplingParams().max_tokens)
    assert (plain.drafter, plain.budget) == (None, None)
    # unset sampling values: the model's generation_config; top_k -1 / 0: no cut
    d = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    p = parse({"prompt": "x"}, False, MODEL, None, d).request.params
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    p = parse({"prompt": "x", "top_k": -1, "temperature": 0}, False, MODEL, None, d)
    assert (p.request.params.top_k, p.request.params.temperature) == (None, 0.0)


def test_chat_renders_the_template_and_prefers_max_completion_tokens():
    api = _chat(max_tokens=3, max_completion_tokens=11, stop="\n")
    assert api.request.text == "<user>Hey<assistant>" and api.chat
    assert api.request.params.max_tokens == 11 and api.request.params.stop == ("\n",)
    assert _chat(max_tokens=4).request.params.max_tokens == 4
    assert api.id.startswith("chatcmpl-")


@pytest.mark.parametrize("body, status, param", [
    ({"n": 100}, 400, "n"), ({"logprobs": 21}, 400, "logprobs"), ({"suffix": "x"}, 400, "suffix"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"), ({"best_of": 3}, 400, "best_of"),
    ({"model": "gpt-4o"}, 404, "model"), ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", 3]}, 400, "prompt"), ({"prompt": [1, True]}, 400, "prompt"),
    ({"max_tokens": "9"}, 400, "max_tokens"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": -1}, 400, "temperature"), ({"top_p": 1.5}, 400, "top_p"),
    ({"stop": [3]}, 400, "stop"), ({"stream_options": {"include_usage": True}}, 400,
                                   "stream_options"),
    ({"drafter": "eagle"}, 400, "drafter"), ({"budget": -2}, 400, "budget"),
    ({"stream": "yes"}, 400, "stream"), ({"seed": 1.5}, 400, "seed"),
    # vLLM's extensions that would change the output, unless neutral; unknown fields
    ({"repetition_penalty": 2.0}, 400, "repetition_penalty"), ({"min_p": 0.9}, 400, "min_p"),
    ({"guided_json": {"type": "object"}}, 400, "guided_json"), ({"min_tokens": 5}, 400,
                                                                  "min_tokens"),
    ({"logprobs": True}, 400, "logprobs"), ({"structured_outputs": {"regex": "a"}}, 400,
                                         "structured_outputs"),
    ({"temprature": 0.5}, 400, "temprature"), ({"model": 123}, 400, "model"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),
    ({"stop_token_ids": [1, "2"]}, 400, "stop_token_ids"),
    ({"skip_special_tokens": 0}, 400, "skip_special_tokens"),
    ({"add_special_tokens": "no"}, 400, "add_special_tokens"),
    ({"stream": True, "stream_options": {"include_obfuscation": 1}}, 400,
     "include_obfuscation"),
])
def test_what_is_refused(body, status, param):
    with pytest.raises(ApiError) as e:
        _completion(**body)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body()["error"]["message"] == e.value.message
    assert e.value.body()["error"]["type"] == ("not_found_error" if status == 404 else
                                               "invalid_request_error")


def test_neutral_values_and_bookkeeping_fields_are_taken():
    """A client that sends vLLM's or OpenAI's defaults explicitly is served as without them."""
    plain = _completion().request
    api = _completion(repetition_penalty=1.0, min_p=0, logprobs=None, n=1, echo=False,
                      include_stop_str_in_output=False, skip_special_tokens=True,
                      user="u", metadata={"k": "v"}, store=False, request_id="mine")
    assert (api.request.params, api.request.keep_special_tokens) == (plain.params, False)
    chat = _chat(logprobs=False, tool_choice="none", parallel_tool_calls=True)
    assert chat.request.params == _chat().request.params


def test_logprobs_of_completions_and_chat():
    assert _completion(logprobs=0).request.params.logprobs == 0
    assert _completion(logprobs=5).request.params.logprobs == 5
    assert _completion().request.params.logprobs is None
    assert _chat(logprobs=True).request.params.logprobs == 0
    assert _chat(logprobs=True, top_logprobs=4).request.params.logprobs == 4
    assert _chat(logprobs=False, top_logprobs=0).request.params.logprobs is None
    for body, message, param in (
            ({"top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be", "top_logprobs"),
            ({"logprobs": 3}, "logprobs must be bool", "logprobs")):
        with pytest.raises(ApiError) as e:
            _chat(**body)
        assert e.value.message.startswith(message) and e.value.param == param


def test_logprobs_objects():
    from specserve.tokenizer import Tokenizer
    from specserve.types import TokenLogprob

    tok = Tokenizer.from_dir(default_pair()[0])
    ids = tok.encode("The cat é")  # "é" is two byte-level tokens
    lps = [TokenLogprob(-0.5 - k, (i, 7), (-0.25, -2.0)) for k, i in enumerate(ids)]
    comp = out.logprobs(_completion(logprobs=2), tok, ids, lps)
    assert comp["tokens"] == ["The", " c", "at", " ", "\ufffd", "\ufffd"]
    assert comp["token_logprobs"] == [-0.5, -1.5, -2.5, -3.5, -4.5, -5.5]
    # offsets index the text "The cat é": both halves of "é" start where it does
    assert comp["text_offset"] == [0, 3, 5, 7, 8, 8]
    offsets = out.TextOffsets(tok, keep_special=False)  # one choice's, over two chunks
    first = out.logprobs(_completion(logprobs=0), tok, ids[:5], lps[:5], offsets)
    rest = out.logprobs(_completion(logprobs=0), tok, [ids[5], 0, ids[1]],
                        [lps[5], lps[0], lps[1]], offsets)  # EOS (0) is not in the text
    assert first["text_offset"] + rest["text_offset"] == [0, 3, 5, 7, 8, 8, 9, 9]
    assert out.TextOffsets(tok, keep_special=True).take([0, ids[0]]) == [0, 13]
    # a lone lead byte (171: b"\xee") that the next token does not continue: "CS\ufffd nothing"
    assert out.TextOffsets(tok, False).take([2171, 171, 3595, 2420]) == [0, 2, 3, 11]
    assert comp["top_logprobs"][1] == {" c": -1.5, tok.decode([7]): -2.0}
    chat = out.logprobs(_chat(logprobs=True, top_logprobs=2), tok, ids, lps)["content"]
    assert [c["token"] for c in chat][:3] == ["The", " c", "at"]
    assert bytes(chat[4]["bytes"] + chat[5]["bytes"]).decode() == "é"
    assert chat[0]["top_logprobs"] == [{"token": "The", "logprob": -0.25, "bytes": list(b"The")},
                                       {"token": tok.decode([7]), "logprob": -2.0,
                                        "bytes": list(tok.token_bytes(7))}]
    assert out.logprobs(_completion(), tok, ids, lps) is None


def test_echo_and_prompt_logprobs():
    scored = _completion(echo=True, max_tokens=0, logprobs=2)
    assert scored.echo and scored.score_only and scored.prompt_logprobs is None
    assert (scored.request.params.max_tokens, scored.request.params.prompt_logprobs) == (1, 2)
    echoed = _completion(echo=True, max_tokens=5)
    assert echoed.echo and not echoed.score_only and echoed.request.params.prompt_logprobs is None
    vllm = _completion(prompt_logprobs=3)
    assert vllm.prompt_logprobs == vllm.request.params.prompt_logprobs == 3
    both = _completion(echo=True, logprobs=1, prompt_logprobs=0)  # the larger N is computed
    assert (both.prompt_logprobs, both.request.params.prompt_logprobs) == (0, 1)
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21},
                                                             "prompt_logprobs")):
        with pytest.raises(ApiError) as e:
            _completion(**body)
        assert e.value.param == param
    for body in ({"echo": True}, {"prompt_logprobs": 1}):  # not chat's
        with pytest.raises(ApiError) as e:
            _chat(**body)
        assert e.value.param == next(iter(body))


def test_an_echoed_prompts_text_and_logprobs():
    from specserve.tokenizer import Tokenizer
    from specserve.types import TokenLogprob

    tok = Tokenizer.from_dir(default_pair()[0])
    prompt = tok.encode("The cat")  # The, " c", "at"
    first = SimpleStep((2028,), (TokenLogprob(-0.5, (2028,), (-0.5,)),),
                       tuple(TokenLogprob(-1.0 - k, (t,), (-1.0 - k,)) for k, t in
                             enumerate(prompt[1:])), tuple(prompt))
    api = _completion(prompt="The cat", echo=True, logprobs=1, prompt_logprobs=1)
    deltas = out.Deltas(api, tok)
    text, lp, extra = deltas(0, SimpleChunk(" The", first))
    assert text == "The cat The" and "logprobs" not in extra  # the prompt's go first in lp
    assert lp["tokens"] == ["The", " c", "at", "The"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5] and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 3, 5, 7]
    assert extra["prompt_logprobs"][0] is None
    assert extra["prompt_logprobs"][1] == {str(prompt[1]): {"logprob": -1.0,
                                                            "decoded_token": " c"}}
    second = SimpleStep((285, 282), (TokenLogprob(-0.1, (285,), (-0.1,)),
                                     TokenLogprob(-0.2, (282,), (-0.2,))))
    text, lp, extra = deltas(0, SimpleChunk(" cat", second))  # no prompt part again
    # offsets run on from the tokens before: "The" " c" "at" "The" (2028) are 10 characters
    assert (text, extra, lp["tokens"], lp["text_offset"]) == (" cat", {}, [" c", "at"], [10, 12])
    cut = out.prompt_part(_completion(prompt="The cat", echo=True, logprobs=0,
                                      prompt_logprobs=0), tok, 0, first,
                          out.TextOffsets(tok, False))[1]
    assert cut["logprobs"]["top_logprobs"][1] == {" c": -1.0}  # the chosen only: N = 0
    assert cut["prompt_logprobs"][1] == {str(prompt[1]): {"logprob": -1.0,
                                                          "decoded_token": " c"}}
    scored = _completion(prompt="The cat", echo=True, max_tokens=0, logprobs=1)
    text, lp, extra = out.Deltas(scored, tok)(0, SimpleChunk(" The", first))
    assert (text, extra) == ("The cat", {})  # the prompt only: its logprobs, none generated
    assert lp["tokens"] == ["The", " c", "at"] and lp["token_logprobs"] == [None, -1.0, -2.0]
    body = out.whole(scored, MODEL, [text], [_final()], [lp])
    assert body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_and_kept_special_tokens():
    r = _completion(stop_token_ids=[5, 17], skip_special_tokens=False).request
    assert (r.params.stop_token_ids, r.keep_special_tokens) == ((5, 17), True)


def test_refusals_quote_the_value_as_json():
    with pytest.raises(ApiError) as e:
        _completion(repetition_penalty=2, tools=None)
    assert e.value.message == "repetition_penalty=2 is not supported by specserve (leave it unset)"
    with pytest.raises(ApiError) as e:
        _chat(tools=[{"type": "function", "function": {"name": "f", "strict": True}}])
    assert e.value.message.startswith('tools=[{"type": "function", "function": {"name": "f", ')
    assert "…" in e.value.message and "True" not in e.value.message


def test_chat_without_a_template_or_with_bad_messages():
    with pytest.raises(ApiError, match="no chat template"):
        parse({"messages": [{"role": "user", "content": "x"}]}, True, MODEL, None)
    with pytest.raises(ApiError, match="role"):
        _chat(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(ApiError, match="JSON object"):
        parse([1, 2], False, MODEL, None)


def _final(reason=FinishReason.LENGTH) -> GatewayFinal:
    stats = RequestSpecStats(steps=4, draft_tokens=32, accepted_tokens=9, committed_tokens=13,
                             commit_len_hist=Counter({4: 2, 2: 1, 3: 1}),
                             accepted_per_position=Counter({1: 4, 2: 3, 3: 2}),
                             fallbacks=Counter({"drafter_timeout": 1}), prefill_s=0.25)
    return GatewayFinal(reason, 17, 14, stats, 0.01, "r1", 0.3, 0.9)


def test_response_shapes():
    api, final = _completion(), _final()
    body = out.whole(api, MODEL, ["text!"], [final], [None])
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "text": "text!"}]
    assert body["usage"] == {"prompt_tokens": 17, "completion_tokens": 14, "total_tokens": 31}
    spec = body["speculative_decoding"]
    assert spec["mean_acceptance_length"] == pytest.approx(13 / 4)
    assert spec["acceptance_length_histogram"] == {"2": 1, "3": 1, "4": 2}
    assert spec["accepted_per_position"] == {"1": 4, "2": 3, "3": 2}
    assert spec["fallbacks"] == {"drafter_timeout": 1} and spec["phases_s"]["prefill"] == 0.25
    chat = _chat(stream=True, stream_options={"include_usage": True})
    first = out.chunk(chat, MODEL, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = out.chunk(chat, MODEL, "", _final(FinishReason.STOP))
    assert last["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                  "delta": {}}
    assert "speculative_decoding" in last
    assert out.usage_chunk(chat, MODEL, [final])["choices"] == []
    assert out.whole(_chat(), MODEL, ["ok"], [final], [None])["choices"][0]["message"] == {
        "role": "assistant", "content": "ok"}


def test_several_choices():
    """n per prompt and a batch of prompts: a request per choice, seeds apart, usage counting
    each prompt once."""
    api = _completion(prompt=["a b", [5, 6, 7]], n=3, seed=2**64 - 2, temperature=0.8)
    assert api.n == 3 and len(api.requests) == 6
    assert [r.text for r in api.requests] == ["a b"] * 3 + [None] * 3
    assert api.requests[4].token_ids == (5, 6, 7)
    assert [r.params.seed for r in api.requests] == [2**64 - 2, 2**64 - 1, 0] * 2
    assert len({r.request_id for r in api.requests}) == 6
    assert all(r.request_id.startswith(api.id + "-") for r in api.requests)
    one = _completion()
    assert one.request.request_id == one.id
    finals = [_final()] * 6
    body = out.whole(api, MODEL, [f"t{k}" for k in range(6)], finals, [None] * 6)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"] == {"prompt_tokens": 34, "completion_tokens": 84, "total_tokens": 118}
    assert "speculative_decoding" in body["choices"][5] and "speculative_decoding" not in body
    for bad in ({"n": 0}, {"n": 65}, {"n": 2, "best_of": 3}, {"prompt": ["a", ""]}):
        with pytest.raises(ApiError) as e:
            _completion(**bad)
        assert e.value.param in ("n", "best_of", "prompt")


def test_a_top_p_below_float32_s_least_is_sent_as_it_and_top_k_s_range_is_in_http_words():
    """top_p 1e-46 is a valid (tiny) nucleus: the wire's float32 would make it 0, which the
    verifier refuses ("got 0.0", a value the client never sent); it travels as the least
    positive float32 — still the top token alone. top_k past int32: a 400 in the API's words
    (0 / -1 for no cut), not the core's "or None"."""
    from services.cli.wire import generate_request
    from services.common.convert import sampling_from_pb, sampling_to_pb

    p = _completion(top_p=1e-46, temperature=1.0).request.params
    assert p.top_p == 1e-46
    assert sampling_from_pb(sampling_to_pb(p)).top_p > 0
    assert generate_request("x", p).sampling.top_p > 0
    with pytest.raises(ApiError) as e:
        _completion(top_k=2**31)
    assert e.value.param == "top_k" and "0 / -1 for no cut" in str(e.value)
    assert "None" not in str(e.value)


def test_a_response_rendered_piece_by_piece_is_the_same_json():
    """out.render (long lists a slice at a time, so that other threads get the GIL between
    the pieces) gives what json.loads reads back as the object, int keys as strings."""
    import json

    body = {"id": "x", "choices": [{"index": k, "text": "é\u2028", "prompt_logprobs": [None] + [
        {7 + i: {"logprob": -0.5 * i, "decoded_token": "a"}} for i in range(700)]}
        for k in range(3)], "usage": {"prompt_tokens": 701}, "flags": [True, None, 1.5]}
    assert json.loads(out.render(body)) == json.loads(json.dumps(body))
    assert out.render([]) == "[]" and out.render({}) == "{}"
