"""A request the verifier ends at a stop id (EOS or a `stop_token_ids` id: its STOP final comes
in the event of the last step, as the real verifier sends it): the gateway counts the id and
gives its token and logprob, but leaves its text out — vLLM's default (no
include_stop_str_in_output) — streamed or not, with or without stop strings; a request ended by
its length keeps every token's text."""

from __future__ import annotations

import json

import pytest

from specserve.tokenizer import Tokenizer
from specserve.v1 import common_pb2, verifier_pb2
from tests.services.test_gateway_service import (
    FakeVerifier,
    model_dir,  # noqa: F401 (fixture)
)
from tests.services.test_openai_choices import _run

pytestmark = pytest.mark.timeout(60)
TOKENS = ((71, 104), (33, 72, 105))  # two steps; the last token ends the request


class EndsAt(FakeVerifier):
    """Streams TOKENS as two steps; the final, `reason`, rides on the last step's event."""

    def __init__(self, reason: int) -> None:
        super().__init__()
        self.reason = reason

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        yield verifier_pb2.VerifyEvent(token_ids=TOKENS[0], commit_len=2)
        yield verifier_pb2.VerifyEvent(token_ids=TOKENS[1], commit_len=3, final=verifier_pb2.
                                       VerifyFinal(finish_reason=self.reason, usage=common_pb2.
                                                   Usage(prompt_tokens=len(request.prompt_ids),
                                                         completion_tokens=5)))


def _text(raw: bytes, stream: bool) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a completions answer."""
    if not stream:
        body = json.loads(raw)
        return body["choices"][0]["text"], body["choices"][0]["finish_reason"], \
            body["usage"]["completion_tokens"]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    reason = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    return text, reason, events[-1]["usage"]["completion_tokens"]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [None, ["never in it"]])
@pytest.mark.parametrize("include", [False, True])
async def test_the_stop_id_s_text_is_left_out(model_dir, tmp_path, stream, stop,  # noqa: F811
                                              include):
    """... unless the request says include_stop_str_in_output (then every token's text)."""
    tok = Tokenizer.from_dir(model_dir)
    ids = [t for step in TOKENS for t in step]
    body = {"prompt": "hi", "max_tokens": 9, "stop_token_ids": [ids[-1]],
            "stream_options": {"include_usage": True} if stream else None,
            "include_stop_str_in_output": include, **({"stop": stop} if stop else {})}
    body = {k: v for k, v in body.items() if v is not None}
    at_stop = ids if include else ids[:-1]
    for reason, shown, finish in ((common_pb2.FINISH_REASON_STOP, at_stop, "stop"),
                                  (common_pb2.FINISH_REASON_LENGTH, ids, "length")):
        status, _, raw = await _run(tmp_path, model_dir, EndsAt(reason), body, stream)
        assert status == 200, raw
        assert _text(raw, stream) == (tok.decode(shown), finish, 5)
    assert tok.decode(ids[:-1]) != tok.decode(ids)
