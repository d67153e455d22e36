"""The gateway's OpenAI HTTP front in process (`serve`, loopback, HTTP port 0) in front of fake
verifiers: each failure answers with its HTTP status and an OpenAI error object (400, 401, 404,
413, 429, 503, 504), an error after the stream started is a `data: {"error": …}` event before
`[DONE]`, /health follows the verifier, the token guards /v1/* but not /health, and a client
that disconnects — mid-stream or before a whole response — cancels the verifier call."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import grpc
import pytest

from services.common.security import Security
from specserve.v1 import verifier_pb2
from tests.services.test_gateway_service import (
    FakeVerifier,
    free_port,
    model_dir,  # noqa: F401 (fixture)
    running_gateway,
    start_verifier,
)

pytestmark = pytest.mark.timeout(60)
BODY = {"prompt": "hello", "max_tokens": 3}


class Aborting(FakeVerifier):
    """Streams `before` tokens, then aborts with `code`."""

    def __init__(self, code: grpc.StatusCode, before: int = 0) -> None:
        super().__init__()
        self.code, self.before = code, before

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        for t in range(self.before):
            yield verifier_pb2.VerifyEvent(token_ids=[40 + t], commit_len=1)
        await context.abort(self.code, f"fake {self.code.name}")


class Endless(FakeVerifier):
    """Streams a token every 50 ms until cancelled; `cancelled` is set when the call ends."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # noqa: N802
        context.add_done_callback(lambda _ctx: self.cancelled.set())
        self.requests.append(request)
        while True:
            await asyncio.sleep(0.05)
            yield verifier_pb2.VerifyEvent(token_ids=[72], commit_len=1)


def _request(port: int, path: str, body=None, headers=None, method: str = "POST"):
    """(status, headers, body bytes) of one HTTP request (blocking: run it in a thread)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    try:
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


async def _call(port, path, body=None, headers=None, method="POST"):
    return await asyncio.to_thread(_request, port, path, body, headers, method)


def _error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def _gateway(tmp_path, model_dir, fake, **config):  # noqa: F811
    """An async context: the gateway in front of `fake` (None: no verifier); yields the port."""
    vport, server = free_port(), None
    if fake is not None:
        server, vport, _ = await start_verifier(fake)
    port_file = tmp_path / f"http-{time.monotonic_ns()}.port"
    return server, running_gateway(tmp_path, model=str(model_dir),
                                   verifier=f"127.0.0.1:{vport}", http_port=0,
                                   http_port_file=str(port_file), health_period_s=0.1,
                                   **config), port_file


@pytest.mark.asyncio
@pytest.mark.parametrize("code, status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                          (grpc.StatusCode.INVALID_ARGUMENT, 400),
                                          (grpc.StatusCode.UNAVAILABLE, 503)])
async def test_verifier_errors_keep_their_status(model_dir, tmp_path, code, status):  # noqa: F811
    server, gateway, port_file = await _gateway(tmp_path, model_dir, Aborting(code))
    try:
        async with gateway:
            port = int(port_file.read_text())
            for stream in (False, True):  # before the first token: a status, streaming or not
                got, _, raw = await _call(port, "/v1/completions", {**BODY, "stream": stream})
                assert got == status
                err = _error(raw)
                assert err["code"] == code.name.lower()
                assert ("verifier unavailable" if status == 503 else "fake") in err["message"]
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_no_verifier_deadline_and_mid_stream_errors(model_dir, tmp_path):  # noqa: F811
    _, gateway, port_file = await _gateway(tmp_path, model_dir, None)
    async with gateway:
        port = int(port_file.read_text())
        assert (await _call(port, "/health", method="GET"))[0] == 503
        status, _, raw = await _call(port, "/v1/completions", BODY)
        assert status == 503 and _error(raw)["message"] == "verifier unavailable"
    server, gateway, port_file = await _gateway(tmp_path, model_dir,
                                                FakeVerifier(delay_s=2.0),
                                                request_timeout_s=0.3)
    try:
        async with gateway:
            port = int(port_file.read_text())
            status, _, raw = await _call(port, "/v1/completions", BODY)
            assert status == 504 and _error(raw)["code"] == "deadline_exceeded"
    finally:
        await server.stop(0)
    server, gateway, port_file = await _gateway(
        tmp_path, model_dir, Aborting(grpc.StatusCode.INTERNAL, before=2))
    try:
        async with gateway:
            port = int(port_file.read_text())
            status, headers, raw = await _call(port, "/v1/completions", {**BODY, "stream": True})
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "[DONE]"
            assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["I", "J"]
            assert json.loads(events[2])["error"]["message"] == "fake INTERNAL"
            assert len(events) == 4
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_bad_requests_auth_and_health(model_dir, tmp_path):  # noqa: F811
    fake = FakeVerifier()
    server, gateway, port_file = await _gateway(
        tmp_path, model_dir, fake, security=Security(token="s3cret"), max_message_bytes=4096)
    try:
        async with gateway:
            port = int(port_file.read_text())
            ok = {"authorization": "Bearer s3cret"}
            deadline = time.monotonic() + 5
            while (await _call(port, "/health", method="GET"))[0] != 200:  # open, no token
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "bearer nope"},
                            {"authorization": "s3cret"}, {"authorization": "Basic s3cret"}):
                status, _, raw = await _call(port, "/v1/completions", BODY, headers)
                assert status == 401 and _error(raw)["type"] == "authentication_error"
            assert (await _call(port, "/v1/models", headers={}, method="GET"))[0] == 401
            status, _, raw = await _call(port, "/v1/models", headers=ok, method="GET")
            assert status == 200 and json.loads(raw)["data"][0]["id"] == model_dir.name
            lower = {"authorization": "bearer s3cret"}  # RFC 7235: the scheme in any case
            assert (await _call(port, "/v1/models", headers=lower, method="GET"))[0] == 200
            cases = [(b"{not json", 400), ({"prompt": "x" * 5000}, 413),
                     ({**BODY, "n": 65}, 400), ({**BODY, "model": "other"}, 404),
                     ({"messages": [{"role": "user", "content": "x"}]}, 400)]
            for body, want in cases:
                chat = isinstance(body, dict) and "messages" in body
                path = "/v1/chat/completions" if chat else "/v1/completions"
                status, _, raw = await _call(port, path, body, ok)
                assert status == want, raw
                _error(raw)
            assert fake.requests == []  # none of them reached the verifier
            status, _, raw = await _call(port, "/v1/completions", BODY, ok)
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    finally:
        await server.stop(0)


def _read_then_drop(port: int, stream: bool, started) -> bytes:
    """Send a generation, read the first SSE event (stream) or wait until the verifier has it
    (`started()`), then close the socket."""
    body = json.dumps({**BODY, "max_tokens": 10_000, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while stream and b"data: " not in got:
            got += s.recv(4096)
        while not started():
            time.sleep(0.01)
        return got


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_disconnect_cancels_the_verifier_call(model_dir, tmp_path,  # noqa: F811
                                                             stream):
    fake = Endless()
    server, gateway, port_file = await _gateway(tmp_path, model_dir, fake)
    try:
        async with gateway:
            port = int(port_file.read_text())
            got = await asyncio.to_thread(_read_then_drop, port, stream,
                                          lambda: bool(fake.requests))
            assert (b"200 OK" in got) == stream
            await asyncio.wait_for(fake.cancelled.wait(), 5.0)
            assert len(fake.requests) == 1
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_https_with_the_grpc_ports_certificate(model_dir, tmp_path):  # noqa: F811
    import ssl

    from tests.tls import make_pki

    pki = make_pki(tmp_path / "pki", ("gateway",))
    server, gateway, port_file = await _gateway(
        tmp_path, model_dir, FakeVerifier(), security=Security(
            tls_cert=str(pki["gateway"]), tls_key=str(pki["gateway-key"]), token="t"))
    trusted = ssl.create_default_context(cafile=str(pki["ca"]))

    def https(path: str, body=None):
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=trusted)
        conn.request("POST" if body else "GET", path, json.dumps(body) if body else None,
                     {"authorization": "Bearer t", "content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()

    try:
        async with gateway:
            port = int(port_file.read_text())
            deadline = time.monotonic() + 5
            while (await asyncio.to_thread(https, "/health"))[0] != 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            status, raw = await asyncio.to_thread(https, "/v1/completions", BODY)
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
            with pytest.raises((http.client.HTTPException, OSError)):  # plaintext: refused
                await _call(port, "/health", method="GET")
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_completed_requests_are_counted_ok(model_dir, tmp_path):  # noqa: F811
    """The HTTP front stops reading at the final (streamed or not): still OK, not CANCELLED."""
    import re
    import urllib.request

    from tests.services.test_gateway_service import FakeVerifier

    metrics_port = free_port()
    server, gateway, port_file = await _gateway(tmp_path, model_dir, FakeVerifier(),
                                                metrics_port=metrics_port)
    try:
        async with gateway:
            port = int(port_file.read_text())
            for stream in (False, True, True):
                got, _, raw = await _call(port, "/v1/completions", {**BODY, "stream": stream})
                assert got == 200, raw
            deadline = time.monotonic() + 5
            while True:
                page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                              timeout=5).read().decode()
                counts = dict(re.findall(r'^specserve_gateway_requests_total\{api="openai",'
                                         r'code="(\w+)"\} (\S+)$', page, re.M))
                if sum(map(float, counts.values())) >= 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert counts == {"OK": "3.0"}
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_cors_answers_the_allowed_origins_only(model_dir, tmp_path):  # noqa: F811
    """--allowed-origins: a browser's preflight from an allowed origin gets CORS headers (the
    bearer token may be sent, the trace id header read), one from another origin none; without
    the flag no origin gets any."""
    from services.gateway.config import origins

    assert origins(" http://localhost:3000/ ,*") == ("http://localhost:3000", "*")
    for bad in ("localhost:3000", "ftp://x", "http://x/path", "http://"):
        with pytest.raises(ValueError, match="is not an origin"):
            origins(bad)
    ok, evil = "http://localhost:3000", "http://evil.example"
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    for allowed in (("http://localhost:3000",), ()):
        server, gateway, port_file = await _gateway(tmp_path, model_dir, FakeVerifier(),
                                                    allowed_origins=allowed)
        try:
            async with gateway:
                port = int(port_file.read_text())
                status, head, _ = await _call(port, "/v1/completions", None,
                                              {"origin": ok, **preflight}, "OPTIONS")
                head = {k.lower(): v for k, v in head.items()}
                if allowed:
                    assert status == 200 and head["access-control-allow-origin"] == ok
                    assert "authorization" in head["access-control-allow-headers"].lower()
                else:
                    assert status == 405 and "access-control-allow-origin" not in head
                status, head, _ = await _call(port, "/v1/completions", None,
                                              {"origin": evil, **preflight}, "OPTIONS")
                assert "access-control-allow-origin" not in {k.lower() for k in head}
                status, head, raw = await _call(port, "/v1/completions", BODY, {"origin": ok})
                head = {k.lower(): v for k, v in head.items()}
                assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
                assert head.get("access-control-allow-origin") == (ok if allowed else None)
                if allowed:
                    assert "x-specserve-trace-id" in head["access-control-expose-headers"]
        finally:
            await server.stop(0)


@pytest.mark.asyncio
async def test_a_logprobs_response_is_built_off_the_event_loop():
    """Thousands of logprob entries a choice: built and rendered in a thread, so that every
    other stream and /health go on meanwhile; a request without logprobs stays on the loop."""
    import threading
    from types import SimpleNamespace

    from services.gateway.openai_http import _built
    from specserve.types import SamplingParams

    def api(**params):
        return SimpleNamespace(requests=[SimpleNamespace(params=SamplingParams(**params))])

    loop_thread = threading.get_ident()
    for params, off in (({"logprobs": 5}, True), ({"prompt_logprobs": 0}, True), ({}, False)):
        ident = await _built(api(**params), threading.get_ident)
        assert (ident != loop_thread) is off, params
