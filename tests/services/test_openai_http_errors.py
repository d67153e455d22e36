"""The OpenAI HTTP front's refusals and ends that used to be a plain-text 500, a cut stream or a
traceback: out-of-range numbers, lone surrogates, integers too long to parse and values the
wire cannot carry are 400s naming the body's field (chat's `max_completion_tokens` and
`messages` included), as are the pipeline's and the verifier's INVALID_ARGUMENTs; a client gone
while sending its body is logged quietly; a cancelled handler closes its generation cleanly;
and at shutdown, once the grace is over, open requests get a 503 error object (a stream: an
error event, then `[DONE]`). The front runs in process on a scripted pipeline, except for the
shutdown, which stops a served gateway in front of an endless fake verifier."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.gateway import openai_api
from services.gateway.convert import GatewayFinal
from services.gateway.openai_http import OpenAIFront
from services.gateway.pipeline import GenerationFailed, TextChunk
from specserve.chat_template import ChatTemplate
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FinishReason
from tests.services.test_gateway_service import model_dir  # noqa: F401 (fixture)
from tests.services.test_openai_http import BODY, Endless, _call, _error, _gateway, _request

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny"
TEMPLATE = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
WATCHED = ("uvicorn.error", "asyncio", "specserve")  # the loggers of the HTTP front's failures
HANG = object()  # in a script: the generation waits until cancelled
FINAL = GatewayFinal(FinishReason.LENGTH, 2, 1, RequestSpecStats(), 0.0, "r", 0.1, 0.2)


class ScriptedPipeline:
    """What OpenAIFront uses of the pipeline; `run` plays `script` (an exception is raised)."""

    defaults = metrics = tokenizer = None

    def __init__(self, *script) -> None:
        self.script, self.requests, self.ended, self.hanging = script, [], False, None

    def start_span(self, carrier):
        return trace.INVALID_SPAN  # not recording

    async def run(self, parse, span, timeout_s, api, on_done=None):
        self.requests.append(parse())
        try:
            for item in self.script:
                if isinstance(item, BaseException):
                    raise item
                if item is HANG:
                    self.hanging.set()
                    await asyncio.Future()
                yield item
        finally:
            self.ended = True


async def _asgi(pipeline, path: str, body, cut: bool = False, headers: dict | None = None,
                stall: bool = False, **front):
    """(status, body bytes) of one POST to the front's app in process; `cut`: the client goes
    away after half its body; `stall`: it sends half and then nothing; `headers`: filled with
    the response's; `front`: OpenAIFront's keyword arguments."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    half = {"type": "http.request", "body": raw[:len(raw) // 2], "more_body": True}
    inbox = [half, {"type": "http.disconnect"}] if cut else [half] if stall else \
        [{"type": "http.request", "body": raw, "more_body": False}]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    status, out = [], []

    async def receive():
        return inbox.pop(0) if inbox else await asyncio.Future()  # then: until cancelled

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
            if headers is not None:
                headers.update((k.decode(), v.decode()) for k, v in message["headers"])
        else:
            out.append(message.get("body", b""))

    await OpenAIFront(pipeline, MODEL, TEMPLATE, **front).app()(scope, receive, send)
    return status[0], b"".join(out)


def _events(raw: bytes) -> list:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat, body, param", [
    (False, {"max_tokens": 2**31}, "max_tokens"), (False, {"max_tokens": 2**64}, "max_tokens"),
    (True, {"max_completion_tokens": 2**40}, "max_completion_tokens"),
    (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (True, {"max_tokens": 0}, "max_tokens"), (False, {"top_k": 10**12}, "top_k"),
    (False, {"top_k": -5}, "top_k"), (True, {"seed": -1}, "seed"),
    (False, {"seed": 2**64}, "seed"), (True, {"seed": 2**64}, "seed"),
    (False, {"temperature": 1e300}, "temperature"),
    (False, {"temperature": 10**400}, "temperature"), (False, {"temperature": -1}, "temperature"),
    (False, {"top_p": 1.5}, "top_p"), (False, {"stop": ["a", ""]}, "stop"),
    (True, {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    (False, {"prompt": "\ud800 hi"}, "prompt"),
    (True, {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages"),
    (False, {"stop": ["\ud800"]}, "stop"),
])
async def test_a_bad_value_is_a_400_naming_the_bodys_field(chat, body, param, stream):
    pipeline = ScriptedPipeline()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, raw = await _asgi(pipeline, path, {**(CHAT if chat else {"prompt": "hi"}), **body,
                                               "stream": stream})
    assert status == 400, raw
    err = _error(raw)
    assert (err["param"], err["type"]) == (param, "invalid_request_error")
    if param != "messages":
        assert err["message"].startswith(param), err  # the body's name, not SamplingParams'
    assert "inf" not in err["message"]  # 1e300 is not turned into float32's inf first
    assert pipeline.requests == []


@pytest.mark.asyncio
@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    (b'{"prompt": [1, -' + b"7" * 5000 + b"]}", "prompt"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
])
async def test_an_integer_too_long_or_json_too_deep_is_a_400(raw, param):
    status, body = await _asgi(ScriptedPipeline(), "/v1/completions", raw)
    assert status == 400 and _error(body)["param"] == param, body


@pytest.mark.asyncio
async def test_a_value_the_wire_cannot_carry_is_a_400_not_a_500(monkeypatch):
    def out_of_range(request, prompt_ids):
        raise ValueError("Value out of range: 2147483648")

    monkeypatch.setattr(openai_api, "verify_request_to_pb", out_of_range)
    status, raw = await _asgi(ScriptedPipeline(), "/v1/completions", {"prompt": "hi"})
    err = _error(raw)
    assert status == 400 and err["type"] == "invalid_request_error"
    assert "Value out of range" in err["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize("chat, message, param", [
    (False, "3 stop strings; at most 2 are allowed (--max-stop-strings)", "stop"),
    (False, "token id 99999 is not in the vocabulary of 4096", "prompt"),
    (True, "This model's maximum context length is 64 tokens. However, you requested 5040 "
           "tokens (40 in the prompt, 5000 in max_tokens). Please reduce the length of the "
           "prompt or max_tokens.", "max_completion_tokens"),  # what to lower
    (True, "This model's maximum context length is 32 tokens. However, the prompt has 40 "
           "tokens, and one at least must be left for the output.", "messages"),
    (False, "budget must be in [0, 16] (the engine's max_draft_tokens), got 99", "budget"),
    (False, "request id 'x' is already in use", None),
    (False, "stop_token_ids out of vocabulary [0, 4096): [99999]", "stop_token_ids"),
])
async def test_the_pipelines_and_verifiers_invalid_argument_names_the_field(chat, message,
                                                                            param):
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", BODY)
    failed = GenerationFailed(grpc.StatusCode.INVALID_ARGUMENT, message)
    status, raw = await _asgi(ScriptedPipeline(failed), path, body)
    assert status == 400 and _error(raw)["param"] == param
    status, raw = await _asgi(ScriptedPipeline(TextChunk("a", None), failed), path,
                              {**body, "stream": True})  # mid-stream: the error event
    events = _events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["param"] == param


@pytest.mark.asyncio
async def test_a_context_error_is_openais_and_names_the_bodys_field():
    """Code `context_length_exceeded` and OpenAI's words (client libraries match them), the
    field as the body named it (chat's max_completion_tokens)."""
    failed = GenerationFailed(grpc.StatusCode.INVALID_ARGUMENT,
                              "This model's maximum context length is 64 tokens. However, you "
                              "requested 70 tokens (40 in the prompt, 30 in max_tokens).")
    status, raw = await _asgi(ScriptedPipeline(failed), "/v1/chat/completions",
                              {**CHAT, "max_completion_tokens": 30})
    err = _error(raw)
    assert status == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "max_completion_tokens" and "30 in max_completion_tokens" in \
        err["message"]
    status, raw = await _asgi(ScriptedPipeline(GenerationFailed(
        grpc.StatusCode.INVALID_ARGUMENT, "3 stop strings; at most 2")), "/v1/completions", BODY)
    assert status == 400 and _error(raw)["code"] == "invalid_argument"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
async def test_a_body_that_stops_coming_is_a_408_within_the_deadline(path):
    """A client that sends half its body and then nothing held its connection for ever."""
    pipeline = ScriptedPipeline(FINAL)
    status, raw = await asyncio.wait_for(_asgi(pipeline, path, {**BODY, "pad": "x" * 5000},
                                               stall=True, body_timeout_s=0.2), 10)
    assert status == 408 and "not received whole within 0.2 s" in _error(raw)["message"]
    assert pipeline.requests == []


@pytest.mark.asyncio
async def test_a_deadline_tells_the_openai_client_not_to_retry():
    headers = {}
    status, raw = await _asgi(ScriptedPipeline(GenerationFailed(
        grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")), "/v1/completions", BODY,
        headers=headers)
    assert status == 504 and headers["x-should-retry"] == "false"
    headers.clear()
    status, _ = await _asgi(ScriptedPipeline(GenerationFailed(
        grpc.StatusCode.UNAVAILABLE, "down")), "/v1/completions", BODY, headers=headers)
    assert status == 503 and "x-should-retry" not in headers  # worth another try


@pytest.mark.asyncio
async def test_line_separators_in_a_stream_are_escaped():
    """U+2028, U+2029 and U+0085 are legal unescaped in JSON but split an event for a reader
    that splits lines as Python's str.splitlines does."""
    text = "a\u2028b\x85c\u2029d"
    status, raw = await _asgi(ScriptedPipeline(TextChunk(text, None), FINAL), "/v1/completions",
                              {**BODY, "stream": True})
    lines = [x for x in raw.decode().splitlines() if x]
    assert status == 200 and all(x.startswith("data: ") for x in lines), lines
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


@pytest.mark.asyncio
async def test_a_client_gone_while_sending_its_body_is_logged_quietly(caplog):
    pipeline = ScriptedPipeline()
    with caplog.at_level(logging.INFO):
        status, _ = await _asgi(pipeline, "/v1/completions", {"prompt": "x" * 1000}, cut=True)
    assert status == 499 and pipeline.requests == []
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "disconnected while sending" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is None


@pytest.mark.asyncio
async def test_a_cancelled_handler_closes_its_generation_cleanly():
    """uvicorn cancels a handler still running past the shutdown's grace: the cancel goes
    through (no "aclose(): asynchronous generator is already running")."""
    pipeline = ScriptedPipeline(TextChunk("a", None), HANG, FINAL)
    pipeline.hanging = asyncio.Event()
    handler = asyncio.ensure_future(_asgi(pipeline, "/v1/completions", BODY))
    await pipeline.hanging.wait()
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert pipeline.ended


def _stream(port: int, body: dict, started: threading.Event) -> tuple[int, bytes]:
    """A streamed request read to its end; `started` is set at its first event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json"})
    resp, lines = conn.getresponse(), []
    while line := resp.readline():
        lines.append(line)
        if line.startswith(b"data: "):
            started.set()
    conn.close()
    return resp.status, b"".join(lines)


@pytest.mark.asyncio
async def test_shutdown_answers_open_requests_with_503(model_dir, tmp_path):  # noqa: F811
    fake, errors, catch = Endless(), [], logging.Handler(logging.ERROR)
    catch.emit = errors.append
    server, gateway, port_file = await _gateway(tmp_path, model_dir, fake)
    long = {**BODY, "max_tokens": 10_000}
    try:
        async with gateway:  # its grace: 0.2 s
            port = int(port_file.read_text())
            status, _, raw = await _call(port, "/v1/completions", {**BODY, "max_tokens": 2**31})
            assert status == 400 and _error(raw)["param"] == "max_tokens"
            for name in WATCHED:
                logging.getLogger(name).addHandler(catch)
            started, loop = threading.Event(), asyncio.get_running_loop()
            # futures, not tasks: the gateway's exit checks that it left no task behind
            stream = loop.run_in_executor(None, _stream, port, {**long, "stream": True},
                                          started)
            whole = loop.run_in_executor(None, _request, port, "/v1/completions", long)
            while len(fake.requests) < 2 or not started.is_set():
                await asyncio.sleep(0.01)
        status, _, raw = await whole
        assert status == 503 and _error(raw) == {
            "message": "the gateway is shutting down", "type": "service_unavailable",
            "param": None, "code": "unavailable"}
        status, raw = await stream
        events = _events(raw)
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"] == "the gateway is shutting down"
        assert all("choices" in json.loads(e) for e in events[:-2])
        assert [r.getMessage() for r in errors] == []  # no traceback, no forced cancel
    finally:
        for name in WATCHED:
            logging.getLogger(name).removeHandler(catch)
        await server.stop(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("path, status, kind", [
    ("/v1/embeddings", 404, "not_found_error"), ("/v1/models", 405, "invalid_request_error")])
async def test_an_unknown_route_or_method_answers_an_openai_error(path, status, kind):
    got, raw = await _asgi(ScriptedPipeline(), path, BODY)  # a POST
    assert got == status
    error = _error(raw)
    assert error["type"] == kind and error["message"].startswith(f"POST {path}: ")


@pytest.mark.asyncio
async def test_a_refused_request_is_traced_with_its_error():
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pipeline = ScriptedPipeline()
    pipeline.start_span = lambda carrier: provider.get_tracer("t").start_span("generate")
    status, _ = await _asgi(pipeline, "/v1/completions", {**BODY, "temperature": -1})
    (span,) = exporter.get_finished_spans()
    assert status == 400 and span.status.status_code is StatusCode.ERROR
    assert span.status.description.startswith("HTTP 400: temperature must be in [0, ")


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_ride_on_each_chunk_and_the_whole_response(stream):
    from services.gateway.convert import Step
    from specserve.demo import default_pair
    from specserve.tokenizer import Tokenizer
    from specserve.types import TokenLogprob

    lp = [TokenLogprob(-0.1 * k, (t,), (-0.1 * k,)) for k, t in ((1, 2028), (2, 285), (3, 282))]
    steps = [TextChunk("The", Step((2028,), 1, 0, logprobs=tuple(lp[:1]))),
             TextChunk(" cat", Step((285, 282), 2, 1, logprobs=tuple(lp[1:])))]
    pipeline = ScriptedPipeline(*steps, FINAL)
    pipeline.tokenizer = Tokenizer.from_dir(default_pair()[0])
    status, raw = await _asgi(pipeline, "/v1/completions",
                              {**BODY, "logprobs": 1, "stream": stream})
    assert status == 200
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        assert [lp["tokens"] for lp in lps] == [["The"], [" c", "at"]]
        assert [lp["text_offset"] for lp in lps] == [[0], [3, 5]]
    else:
        lp = json.loads(raw)["choices"][0]["logprobs"]
        assert lp["tokens"] == ["The", " c", "at"] and lp["token_logprobs"] == \
            pytest.approx([-0.1, -0.2, -0.3])
