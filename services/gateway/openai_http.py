"""The gateway's OpenAI-compatible HTTP front: a Starlette app served by uvicorn in the gateway's
own event loop, beside the gRPC server, over the same pipeline (admission, tracing, metrics).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (whole or SSE: `data: {…}`
chunks, then `data: [DONE]`), `GET /v1/models` and `/v1/models/{id}`, `POST /tokenize` and
`/detokenize` (vLLM's; services/gateway/tokenize_api.py), `GET /health` (200 while the
gateway's gRPC health is SERVING, i.e. while the verifier serves; 503 otherwise). With a token
configured, every route but `/health` needs `Authorization: Bearer TOKEN` (401 otherwise).

Errors are OpenAI error objects (an unknown route's 404 / 405 too). Before the first token they
answer with their HTTP status (400 invalid, 404 another model, 413 a body over the limit, 429
the verifier's queue is full, 503 the verifier is unavailable, 504 the deadline passed); an
error once the stream has started is one `data: {"error": …}` event before `[DONE]`. A client
that disconnects — while sending its body (logged, not an error), while waiting, mid-stream, or
before a whole response — cancels the request: the verifier call ends and the request's pages
are freed. At shutdown, once the grace is over (`grace_over`, called by
services/gateway/http_server.py), the generations still running end with 503 "the gateway is
shutting down" (a stream: its error event, then `[DONE]`). When spans are exported the
response carries the trace id in the `x-specserve-trace-id` header.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry.trace import Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.common import telemetry
from services.common.security import bearer_ok
from services.gateway import openai_responses as out
from services.gateway import tokenize_api as tokens
from services.gateway.choices import Choices
from services.gateway.convert import TRACE_ID_KEY, GatewayFinal
from services.gateway.openai_api import ApiRequest, parse
from services.gateway.openai_errors import ApiError
from services.gateway.openai_fields import OFF_LOOP_BYTES, loads, read_body
from services.gateway.pipeline import GenerationFailed, Pipeline

API = "openai"  # the `api` label of specserve_gateway_requests_total
SHUTTING_DOWN = "the gateway is shutting down"
OFF_LOOP_IDS = 4096  # /tokenize's token texts of more ids are made in a thread
log = logging.getLogger("specserve.gateway")


class Disconnected(Exception):
    """The HTTP client went away before its answer was ready."""


class OpenAIFront:
    def __init__(self, pipeline: Pipeline, model: str, template, *, token: str | None = None,
                 max_body_bytes: int = 64 << 20, serving=lambda: True, created: int = 0,
                 body_timeout_s: float | None = None, allowed_origins: tuple[str, ...] = ()
                 ) -> None:
        """`body_timeout_s`: how long a client may take to send its body (None: no bound);
        `allowed_origins`: browser origins answered with CORS headers ('*': any)."""
        self.pipeline, self.model, self.template = pipeline, model, template
        self._want = token.encode() if token else None
        self.max_body_bytes, self.serving, self.created = max_body_bytes, serving, created
        self.body_timeout_s, self.allowed_origins = body_timeout_s, allowed_origins

    def app(self) -> Starlette:
        """The ASGI app; its `state.grace_over` is `grace_over` (HttpListener calls it)."""
        app = Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
        ], exception_handlers={404: _no_route, 405: _no_route}, middleware=[
            Middleware(CORSMiddleware, allow_origins=self.allowed_origins,
                       allow_methods=["GET", "POST"], allow_headers=["authorization",
                                                                     "content-type"],
                       expose_headers=[TRACE_ID_KEY], max_age=600),
        ] if self.allowed_origins else [])
        app.state.grace_over = self.grace_over
        return app

    def grace_over(self) -> None:
        """Shutdown's grace is over: the generations still running end with 503."""
        self.pipeline.abort_all(SHUTTING_DOWN)

    async def _health(self, request: Request) -> JSONResponse:
        ok = self.serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    async def _models(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        return JSONResponse(out.models(self.model, self.created))

    async def _model(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        if request.path_params["model_id"] != self.model:
            return _error(ApiError(404, f"model {request.path_params['model_id'][:100]!r} is "
                                   f"not served here", "not_found_error", "model",
                                   "model_not_found"))
        return JSONResponse(out.models(self.model, self.created)["data"][0])

    async def _tokenize(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            text, strs, add = await _off_loop(await self._body(request),
                                              tokens.prompt_text, self.template, self.model)
            ids = await self.pipeline.prompts.encode(text, add)  # a long one off the event loop
        except ApiError as e:
            return _error(e)
        tokenizer = self.pipeline.tokenizer
        if strs and len(ids) > OFF_LOOP_IDS:  # each token's text: Python work per token
            return JSONResponse(await asyncio.to_thread(tokens.tokenized, tokenizer, ids, strs))
        return JSONResponse(tokens.tokenized(tokenizer, ids, strs))

    async def _detokenize(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            return JSONResponse(await tokens.detokenized(
                await self._body(request), self.pipeline.prompts,
                self.model))
        except ApiError as e:
            return _error(e)

    async def _completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request):
        return await self._generate(request, chat=True)

    def _denied(self, request: Request) -> JSONResponse | None:
        sent = request.headers.get("authorization", "")
        if self._want is None or bearer_ok(sent, self._want):
            return None
        return _error(ApiError(401, "missing or wrong bearer token (Authorization: Bearer …)",
                               "authentication_error", code="invalid_api_key"))

    async def _body(self, request: Request) -> bytes:
        """The body, whole within `body_timeout_s`: a client that stops sending part-way does
        not hold its connection (and a file descriptor) for ever. ApiError 408 / 413."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await read_body(request, self.max_body_bytes)
        except TimeoutError:
            raise ApiError(408, f"the request body was not received whole within "
                                f"{self.body_timeout_s:g} s (--request-timeout-s)",
                           "timeout") from None

    async def _parse(self, request: Request, chat: bool) -> ApiRequest | ApiError:
        """The request, or the error for a body that is refused or was not sent whole."""
        try:
            return await _off_loop(await self._body(request), parse, chat,
                                   self.model, self.template, self.pipeline.defaults)
        except ApiError as e:
            self._count({404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED"}.get(e.status,
                                                                         "INVALID_ARGUMENT"))
            return e
        except ClientDisconnect:  # nobody reads the answer; not the gateway's error
            log.info("%s: the client disconnected while sending its request", request.url.path)
            self._count("CANCELLED")
            return ApiError(499, "client disconnected", "cancelled")

    async def _generate(self, request: Request, chat: bool):
        if (denied := self._denied(request)) is not None:
            self._count("UNAUTHENTICATED")
            return denied
        span = self.pipeline.start_span(request.headers.items())
        trace_id = telemetry.trace_id_of(span) if telemetry.exporting() else None
        headers = {TRACE_ID_KEY: trace_id} if trace_id else {}
        if isinstance(api := await self._parse(request, chat), ApiError):  # refused: traced too
            span.set_status(Status(StatusCode.ERROR, f"HTTP {api.status}: {api.message[:300]}"))
            span.end()
            return _error(api, headers)
        spans = [span, *(self.pipeline.start_span(request.headers.items())
                         for _ in api.requests[1:])]
        if trace_id and len(spans) > 1:  # a trace per choice: every one, in choice order
            headers[TRACE_ID_KEY] = ",".join(telemetry.trace_id_of(s) for s in spans)
        choices = Choices([self.pipeline.run(lambda r=r: r, s, None, API)
                           for r, s in zip(api.requests, spans, strict=True)], api.n)
        try:  # every choice's first event, or the error that came instead: its status
            await _unless_disconnect(request, choices.start())
        except (GenerationFailed, Disconnected) as e:
            await choices.aclose()
            return _failed(e, headers, api)
        except BaseException:  # cancelled (the server's shutdown)
            await choices.aclose()
            raise
        if api.stream:
            return StreamingResponse(self._sse(api, choices), headers=headers,
                                     media_type="text/event-stream")
        try:
            return await _unless_disconnect(request, self._whole(api, choices, headers))
        except (GenerationFailed, Disconnected) as e:
            return _failed(e, headers, api)
        finally:
            await choices.aclose()

    async def _whole(self, api: ApiRequest, choices: Choices, headers: dict) -> Response:
        n, deltas = len(api.requests), out.Deltas(api, self.pipeline.tokenizer)
        text, lps, extras, finals = [""] * n, [None] * n, [{} for _ in range(n)], [None] * n
        async for k, event in choices.events():
            if isinstance(event, GatewayFinal):
                finals[k] = event
                continue
            delta, lp, extra = await _built(api, deltas, k, event)
            text[k], lps[k] = text[k] + delta, out.joined(lps[k], lp)
            extras[k].update(extra)
        return await _built(api, lambda: Response(  # rendered here, piece by piece
            out.render(out.whole(api, self.model, text, finals, lps, extras)).encode(),
            headers=headers, media_type="application/json"))

    async def _sse(self, api: ApiRequest, choices: Choices):
        try:
            if api.chat:
                for k in range(len(api.requests)):
                    yield out.sse(out.chunk(api, self.model, "", first=True, index=k))
            deltas, finals = out.Deltas(api, self.pipeline.tokenizer), [None] * len(api.requests)
            try:
                async for k, event in choices.events():
                    if isinstance(event, GatewayFinal):
                        finals[k] = event
                        yield out.sse(out.chunk(api, self.model, "", event, index=k))
                        continue
                    if piece := await _built(api, self._piece, api, deltas, k, event):
                        yield piece
                if api.include_usage:
                    yield out.sse(out.usage_chunk(api, self.model, finals))
            except GenerationFailed as e:
                yield out.sse(ApiError.of_grpc(e.code, e.message, api.names).body())
            await choices.aclose()  # before [DONE], at which clients hang up
            yield "data: [DONE]\n\n"
        finally:
            await choices.aclose()

    def _piece(self, api: ApiRequest, deltas: out.Deltas, k: int, event) -> str | None:
        """Choice `k`'s event as a server-sent event (None: nothing to send)."""
        text, lps, extra = deltas(k, event)
        if text or lps or extra:
            return out.sse(out.chunk(api, self.model, text, lps=lps, index=k, extra=extra))
        return None

    def _count(self, code: str) -> None:
        if self.pipeline.metrics is not None:
            self.pipeline.metrics.requests.labels(code=code, api=API).inc()


def _error(e: ApiError, headers: dict | None = None) -> JSONResponse:
    if e.status == 504:  # a deadline: the OpenAI client's retries would redo the whole work
        headers = {**(headers or {}), "x-should-retry": "false"}
    return JSONResponse(e.body(), e.status, headers=headers)


async def _no_route(request: Request, exc: HTTPException) -> JSONResponse:
    """An unknown path or method: an OpenAI error object, as every other error."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(ApiError(exc.status_code, f"{request.method} {request.url.path[:200]}: "
                           f"{exc.detail}", kind), exc.headers)


def _failed(e: Exception, headers: dict, api: ApiRequest) -> JSONResponse:
    if isinstance(e, GenerationFailed):
        return _error(ApiError.of_grpc(e.code, e.message, api.names), headers)
    # Disconnected: nobody reads it; the status is for the access log
    return _error(ApiError(499, "client disconnected", "cancelled"), headers)


async def _built(api: ApiRequest, fn, *args):
    """`fn(*args)`: a part of the response; in a thread when the request asked for logprobs
    (thousands of entries a choice to build and render: on the event loop they held every other
    stream and /health for seconds)."""
    p = api.requests[0].params
    if p.logprobs is None and p.prompt_logprobs is None:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _off_loop(raw: bytes, fn, *args):
    """`fn(body, *args)` of the JSON body `raw` (ApiError 400 if it is not JSON); a large body's
    in a thread, so that checking it element by element does not hold the event loop."""
    if len(raw) <= OFF_LOOP_BYTES:
        return fn(loads(raw), *args)
    return await asyncio.to_thread(lambda: fn(loads(raw), *args))


async def _unless_disconnect(request: Request, awaitable):
    """`awaitable`'s result; cancelled (Disconnected raised) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself (shutdown): the work goes with it
        await _ended(work)
        raise
    finally:
        gone.cancel()
    if not work.done():
        await _ended(work)
        raise Disconnected()
    return work.result()


async def _ended(work: asyncio.Future) -> None:
    """Cancel `work` and wait until it has ended (what it raised is dropped), so the generator
    it was advancing is no longer running when the caller closes it."""
    work.cancel()
    await asyncio.wait({work})
    if not work.cancelled():
        work.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
