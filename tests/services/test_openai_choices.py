"""Several choices in one HTTP request (`n`, a batch of prompts), through the gateway in front
of fake verifiers: a verifier request per choice, each choice's text and index, usage counting
each prompt once; a choice that fails fails the response and cancels the others."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from specserve.v1 import verifier_pb2
from tests.services.test_gateway_service import (
    FakeVerifier,
    model_dir,  # noqa: F401 (fixture)
)
from tests.services.test_openai_http import _call, _error, _gateway

pytestmark = pytest.mark.timeout(60)


class PerRequest(FakeVerifier):
    """Streams tokens 40 + k, 41 + k (k: the choice, from the request id's "-k"), then a final;
    with `fail`, that choice aborts after its first token and the others run until cancelled."""

    def __init__(self, fail: int | None = None) -> None:
        super().__init__()
        self.fail, self.cancelled = fail, []

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        k = int(request.request_id.rsplit("-", 1)[1]) if request.request_id.count("-") > 1 \
            else 0
        context.add_done_callback(lambda _c: self.cancelled.append(k))
        yield verifier_pb2.VerifyEvent(token_ids=[40 + k], commit_len=1)
        if self.fail is not None:
            if k == self.fail:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "choice failed")
            await asyncio.sleep(30)
        yield verifier_pb2.VerifyEvent(token_ids=[41 + k], commit_len=1)
        yield verifier_pb2.VerifyEvent(final=verifier_pb2.VerifyFinal(
            finish_reason=2, usage={"prompt_tokens": len(request.prompt_ids),
                                    "completion_tokens": 2}))


async def _run(tmp_path, model_dir, fake, body, stream):  # noqa: F811
    server, gateway, port_file = await _gateway(tmp_path, model_dir, fake)
    try:
        async with gateway:
            return await _call(int(port_file.read_text()), "/v1/completions",
                               {**body, "stream": stream})
    finally:
        await server.stop(None)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_of_a_batch_of_prompts(model_dir, tmp_path, stream):  # noqa: F811
    fake = PerRequest()
    body = {"prompt": ["hello", [5, 6, 7]], "max_tokens": 2, "n": 2,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    status, _, raw = await _run(tmp_path, model_dir, fake, body, stream)
    assert status == 200, raw
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        usage = events[-1]["usage"]
        texts = {}
        for e in events[:-1]:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1, 2, 3]
    else:
        body = json.loads(raw)
        usage = body["usage"]
        texts = {c["index"]: c["text"] for c in body["choices"]}
    assert len(texts) == 4 and len(set(texts.values())) == 4  # each choice its own tokens
    hello = {len(r.prompt_ids) for r in fake.requests if list(r.prompt_ids) != [5, 6, 7]}
    assert len(hello) == 1 and len(fake.requests) == 4
    assert usage == {"prompt_tokens": hello.pop() + 3, "completion_tokens": 8,
                     "total_tokens": usage["prompt_tokens"] + 8}  # each prompt counted once


@pytest.mark.asyncio
async def test_a_failed_choice_fails_the_response_and_cancels_the_others(model_dir,  # noqa: F811
                                                                        tmp_path):
    fake = PerRequest(fail=1)
    status, _, raw = await _run(tmp_path, model_dir, fake, {"prompt": "hello", "n": 3}, False)
    assert status == 400 and _error(raw)["message"] == "choice failed (prompt 0, choice 1)"
    for _ in range(100):
        if sorted(fake.cancelled) == [0, 1, 2]:
            break
        await asyncio.sleep(0.02)
    assert sorted(fake.cancelled) == [0, 1, 2]  # every verifier call ended


@pytest.mark.asyncio
async def test_the_choices_of_one_prompt_encode_it_once(model_dir, tmp_path,  # noqa: F811
                                                        monkeypatch):
    from services.gateway.prompt_encoder import PromptEncoder

    texts, encode = [], PromptEncoder.encode

    async def counted(self, text, add_special_tokens=False):
        texts.append(text)
        return await encode(self, text, add_special_tokens)

    monkeypatch.setattr(PromptEncoder, "encode", counted)
    fake = PerRequest()
    status, _, raw = await _run(tmp_path, model_dir, fake, {"prompt": ["hello there", "bye"],
                                                            "max_tokens": 2, "n": 3}, False)
    assert status == 200, raw
    assert sorted(texts) == ["bye", "hello there"] and len(fake.requests) == 6
