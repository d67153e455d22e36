"""`Gateway.Generate`: validate, tokenize, relay the verifier's steps as text chunks, final stats.

Thin: convert → call the verifier → convert. The gateway owns what needs text: tokenizing the
prompt, incremental detokenization and stop strings (a completed stop string cancels the
verifier stream, which frees the request there; a stop list over `StopLimits` is refused before
the verifier is called). Verifier errors keep their status code and message, but UNAVAILABLE's
(it can name the verifier's address) goes to the log and the client reads "verifier
unavailable"; a client cancel cancels the verifier call. A call whose deadline passed is counted
as DEADLINE_EXCEEDED in `specserve_gateway_requests_total`.

Each call is one `generate` span (SERVER; a child of the client's span if it sent a W3C
`traceparent`), whose context goes to the verifier in the call metadata: the root of the
request's trace across the three services; when spans are exported, its trace id goes back to
the client as initial metadata `x-specserve-trace-id`. The final message's phase times are the
verifier's, and `other` = the gateway's wall time − those phases, so they add up to `wall_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from services.common.convert import MAX_STOP_BYTES, MAX_STOP_STRINGS, check_stop
from services.common.errors import status_for
from services.gateway import convert
from services.gateway.convert import GatewayFinal, GatewayRequest, Step, VerifierFinal
from specserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from specserve.errors import InvalidRequest, SpecServeError
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FinishReason
from specserve.v1 import gateway_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger("specserve.gateway")
_TOKENIZE_OFF_LOOP_CHARS = 16_384  # longer prompts are tokenized in a worker thread
STOP_FLAGS = ("--max-stop-strings", "--max-stop-bytes")  # what sets StopLimits


@dataclass(frozen=True)
class StopLimits:
    """A request's stop list: at most `max_strings` strings, `max_bytes` UTF-8 bytes in all."""

    max_strings: int = MAX_STOP_STRINGS
    max_bytes: int = MAX_STOP_BYTES


class _RequestState:
    """Per-request detokenizer, stop-string matcher and the stats seen so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], req: GatewayRequest) -> None:
        self.req, self.prompt_tokens = req, len(prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stopper = StopStringMatcher(req.params.stop) if req.params.stop else None
        self.stats = RequestSpecStats()
        self.completion_tokens = 0
        self.t0 = time.perf_counter()
        self.ttft_s = 0.0
        self.final_: GatewayFinal | None = None  # what the client was sent last

    def push(self, step: Step) -> tuple[str, bool]:
        """Text for a step's tokens (cut at a stop string) and whether a stop string completed."""
        if not self.ttft_s:
            self.ttft_s = time.perf_counter() - self.t0
        if self.completion_tokens:  # the first event is prefill's sampled token, not a step
            _record(self.stats, step)
        self.completion_tokens += len(step.token_ids)
        return self._stop(self.detok.push(step.token_ids))

    def tail(self) -> tuple[str, bool]:
        """Held-back text at the end of generation."""
        text, stopped = self._stop(self.detok.flush())
        if self.stopper is not None and not stopped:
            text += self.stopper.flush()
        return text, stopped

    def _stop(self, delta: str) -> tuple[str, bool]:
        return (delta, False) if self.stopper is None else self.stopper.feed(delta)

    def final(self, reason: FinishReason | None, v: VerifierFinal | None) -> GatewayFinal:
        """The verifier's usage and stats when it finished the request, ours when we cut it."""
        wall = time.perf_counter() - self.t0
        stats, prompt, completion = (self.stats, self.prompt_tokens, self.completion_tokens) \
            if v is None else (v.stats, v.prompt_tokens, v.completion_tokens)
        phases = stats.prefill_s + stats.draft_s + stats.verify_s + stats.commit_s
        self.final_ = GatewayFinal(reason, prompt, completion, stats, max(0.0, wall - phases),
                                   self.req.request_id, self.ttft_s, wall)
        return self.final_


def _record(stats: RequestSpecStats, step: Step) -> None:
    """Accumulate a step (the verifier's own stats replace these when it finishes the request)."""
    stats.steps += 1
    stats.draft_tokens += step.tree_size
    stats.accepted_tokens += step.accepted_depth
    stats.committed_tokens += step.commit_len
    stats.commit_len_hist[step.commit_len] += 1
    for depth in range(1, step.accepted_depth + 1):
        stats.accepted_per_position[depth] += 1
    if step.fallback:
        stats.fallbacks[step.fallback] += 1


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, verifier: grpc.aio.Channel,
                 default_timeout_s: float, metrics=None, *, verifier_address: str = "",
                 stop_limits: StopLimits | None = None,
                 peer_metadata: tuple[tuple[str, str], ...] = (),
                 defaults=None) -> None:
        self._tokenizer = tokenizer
        self._defaults = defaults  # the model's GenerationDefaults (None: greedy)
        self._peer_metadata = peer_metadata  # the token the verifier wants, if any
        self._verifier = verifier_pb2_grpc.VerifierStub(verifier)
        self._verifier_address = verifier_address  # for the log only
        self._default_timeout_s = default_timeout_s
        self._stop_limits = stop_limits or StopLimits()
        self.metrics = metrics  # GatewayMetrics | None
        self._tracer = telemetry.tracer("specserve.gateway")

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        t0 = time.perf_counter()
        span = self._tracer.start_span(
            "generate", telemetry.extract_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER)
        code, state = grpc.StatusCode.CANCELLED, None
        trace_id = telemetry.trace_id_of(span) if telemetry.exporting() else None
        if trace_id is not None:  # the client can print where the request's trace is
            await context.send_initial_metadata(((convert.TRACE_ID_KEY, trace_id),))
        try:
            try:
                req, prompt_ids = await self._admit(request, span)
                state = _RequestState(self._tokenizer, prompt_ids, req)
            except SpecServeError as e:
                code = status_for(e)
                await context.abort(code, str(e))
            call = self._verifier.Generate(
                convert.verify_request_to_pb(req, prompt_ids), timeout=self._timeout(context),
                metadata=(*telemetry.inject_metadata(trace.set_span_in_context(span)),
                          *self._peer_metadata))
            context.add_done_callback(lambda _ctx: call.cancel())  # client cancel → verifier's
            try:
                async for response in self._relay(call, state):
                    yield response
            except grpc.aio.AioRpcError as e:
                code = e.code()
                await context.abort(code, self._verifier_error(req, e))
            except SpecServeError as e:
                code = status_for(e)
                await context.abort(code, str(e))
            finally:
                call.cancel()
            code = grpc.StatusCode.OK
        finally:
            self._finish(span, _counted_as(code, context), state, time.perf_counter() - t0)

    async def _admit(self, request, span) -> tuple[GatewayRequest, list[int]]:
        """The validated request and its prompt ids (raises InvalidRequest)."""
        req = convert.request_from_pb(request, self._defaults)
        span.set_attribute("request.id", req.request_id)
        check_stop(req.params.stop, self._stop_limits.max_strings, self._stop_limits.max_bytes,
                   STOP_FLAGS)
        prompt_ids = await self._prompt_ids(req)
        span.set_attributes({"prompt_tokens": len(prompt_ids),
                             "max_tokens": req.params.max_tokens,
                             "drafter": req.drafter or "default"})
        return req, prompt_ids

    def _verifier_error(self, req: GatewayRequest, e: grpc.aio.AioRpcError) -> str:
        """The client's message for a failed verifier call; the log keeps the details."""
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            log.warning("request %s: verifier at %s unavailable: %s", req.request_id,
                        self._verifier_address, e.details())
            return "verifier unavailable"
        log.info("request %s: verifier %s: %s", req.request_id, e.code().name, e.details())
        return e.details() or e.code().name

    def _finish(self, span, code: grpc.StatusCode, state: _RequestState | None,
                wall_s: float) -> None:
        final = state.final_ if state is not None else None
        if final is not None and span.is_recording():
            span.set_attributes({
                "completion_tokens": final.completion_tokens, "ttft_s": final.ttft_s,
                "finish_reason": str(final.finish_reason), "steps": final.stats.steps,
                "mean_commit_len": final.stats.mean_commit_len})
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()
        if self.metrics is not None:
            self.metrics.requests.labels(code=code.name).inc()
            self.metrics.duration.observe(wall_s)
            if state is not None and state.ttft_s:
                self.metrics.ttft.observe(state.ttft_s)
            if state is not None:
                self.metrics.completion_tokens.inc(state.completion_tokens)

    async def _relay(self, call, state: _RequestState):
        async for event in call:
            step, final = convert.event_from_pb(event)
            if step is not None:
                text, stopped = state.push(step)
                yield convert.chunk_to_pb(text, step)
                if stopped:
                    call.cancel()  # the verifier frees the request's pages
                    yield convert.final_to_pb(state.final(FinishReason.STOP, None))
                    return
            if final is not None:
                text, stopped = state.tail()
                if text:
                    yield convert.chunk_to_pb(text, None)
                reason = FinishReason.STOP if stopped else final.finish_reason
                yield convert.final_to_pb(state.final(reason, final))
                return
        raise SpecServeError("the verifier stream ended without a final event")

    async def _prompt_ids(self, req: GatewayRequest) -> list[int]:
        if req.token_ids is not None:
            return self._tokenizer.check_ids(req.token_ids)
        if len(req.text) > _TOKENIZE_OFF_LOOP_CHARS:
            ids = await asyncio.to_thread(self._tokenizer.encode, req.text)
        else:
            ids = self._tokenizer.encode(req.text)
        if not ids:
            raise InvalidRequest("prompt text encodes to no tokens")
        return ids

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self._default_timeout_s if remaining is None else max(remaining, 0.001)


def _counted_as(code: grpc.StatusCode, context) -> grpc.StatusCode:
    """The code a finished call is counted under: cancelled past its deadline is
    DEADLINE_EXCEEDED (gRPC cancels the handler when the client's deadline passes)."""
    remaining = context.time_remaining()
    if code is grpc.StatusCode.CANCELLED and remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return code
