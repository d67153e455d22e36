"""One generation through the gateway, whichever front took it (gRPC `Generate` or the OpenAI
HTTP API): validate, tokenize, call the verifier, relay its steps as text, finish the span and
the metrics.

The gateway owns what needs text: tokenizing the prompt, incremental detokenization and stop
strings (a completed stop string ends the text, and usage, at the token that completed it; the
verifier is told to `Stop` the request, which frees it there and counts it finished, then the
call is cancelled; a stop list over `StopLimits` is refused before the verifier is called; the
per-request state is services/gateway/request_state.py). Each request goes to the least-loaded
healthy verifier replica (services/gateway/replicas.py; its address is the span's `verifier`
attribute and the final's `verifier`). Verifier errors keep
their status code and message, but UNAVAILABLE's (it can name the verifier's address) goes to
the log and the client reads "verifier unavailable". Cancelling the consumer (a gRPC client's
cancel, an HTTP client's disconnect) cancels the verifier call. `abort_all` (the gateway's
shutdown once its grace is over) cancels every verifier call in flight, and those generations
fail with UNAVAILABLE and its message. A call whose deadline passed (or was cancelled less
than DEADLINE_SLACK_S before it: the client's own deadline) is counted as
DEADLINE_EXCEEDED in `specserve_gateway_requests_total`.

Each request is one `generate` span (SERVER; a child of the caller's span if it sent a W3C
`traceparent`), whose context goes to the verifier in the call metadata: the root of the
request's trace across the three services. The final's phase times are the verifier's, and
`other` = the gateway's wall time − those phases, so they add up to `wall_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from services.common.convert import MAX_STOP_BYTES, MAX_STOP_STRINGS, check_stop
from services.common.errors import ended_code, status_for
from services.gateway import convert
from services.gateway.convert import GatewayFinal, GatewayRequest, Step
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.replicas import Replica, Replicas
from services.gateway.request_state import RequestState
from specserve.errors import InvalidRequest, SpecServeError, check_context
from specserve.tokenizer import Tokenizer
from specserve.types import FinishReason
from specserve.v1 import verifier_pb2

log = logging.getLogger("specserve.gateway")
STOP_FLAGS = ("--max-stop-strings", "--max-stop-bytes")  # what sets StopLimits
STOP_TIMEOUT_S = 1.0  # the verifier's Stop reply; past it the call is cancelled anyway
DEADLINE = "the request's deadline passed (the client's timeout, else --request-timeout-s)"


@dataclass(frozen=True)
class StopLimits:
    """A request's stop list: at most `max_strings` strings, `max_bytes` UTF-8 bytes in all."""

    max_strings: int = MAX_STOP_STRINGS
    max_bytes: int = MAX_STOP_BYTES


@dataclass(frozen=True)
class TextChunk:
    """Text for the client and the step it came from (None: held-back text at the end)."""

    text: str
    step: Step | None


class GenerationFailed(Exception):
    """A generation ended in error: the gRPC status and the client's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Pipeline:
    """What the gateway's fronts share: the tokenizer, the verifier, defaults, limits, metrics."""

    def __init__(self, tokenizer: Tokenizer, replicas: Replicas,
                 default_timeout_s: float, metrics=None, *,
                 stop_limits: StopLimits | None = None,
                 peer_metadata: tuple[tuple[str, str], ...] = (), defaults=None,
                 prompts: PromptEncoder | None = None) -> None:
        self.tokenizer = tokenizer
        # long prompt texts are encoded in a worker process (without one: inline)
        self.prompts = prompts or PromptEncoder(tokenizer, None)
        self.defaults = defaults  # the model's GenerationDefaults (None: greedy)
        self._peer_metadata = peer_metadata  # the token the verifier wants, if any
        self.replicas = replicas  # the verifiers; each request goes to the least loaded
        self.default_timeout_s = default_timeout_s
        self._stop_limits = stop_limits or StopLimits()
        self.metrics = metrics  # GatewayMetrics | None
        self._tracer = telemetry.tracer("specserve.gateway")
        self._calls: set = set()  # the verifier calls in flight
        self._stopping: dict[str, asyncio.Task] = {}  # request id -> its `_stop`, not done
        self._aborting: str | None = None  # abort_all's message, once called

    def abort_all(self, message: str) -> None:
        """End every generation in flight (and any that reaches the verifier later) with
        UNAVAILABLE `message`: their verifier calls are cancelled."""
        self._aborting = message
        for call in list(self._calls):
            call.cancel()

    def start_span(self, carrier: Iterable | None):
        """The request's `generate` span, a child of the caller's (W3C headers / metadata)."""
        return self._tracer.start_span("generate", telemetry.extract_metadata(carrier),
                                       kind=SpanKind.SERVER)

    async def run(self, parse: Callable[[], GatewayRequest], span, timeout_s: float | None,
                  api: str, on_done=None) -> AsyncIterator[TextChunk | GatewayFinal]:
        """The request `parse()` returns, generated: text chunks, then one GatewayFinal.
        Raises GenerationFailed; `timeout_s` None: the default deadline. `on_done` (gRPC's
        `context.add_done_callback`) also cancels the verifier call when the caller's call ends."""
        t0, code, state, replica = time.perf_counter(), grpc.StatusCode.CANCELLED, None, None
        detail = ""  # the client's error message
        deadline = time.monotonic() + (timeout_s or self.default_timeout_s)
        try:
            try:
                req = parse()
                prompt_ids = await self._admit(req, span, deadline)
                replica = self._pick(span)
            except SpecServeError as e:
                code, detail = status_for(e), str(e)
                raise GenerationFailed(code, detail) from None
            state = RequestState(self.tokenizer, prompt_ids, req)
            state.verifier = replica.address
            call = self._call(replica, req, prompt_ids, deadline, span)
            if on_done is not None:
                on_done(lambda _ctx: state.cut or call.cancel())  # a cut one: `_stop`'s
            try:
                async for event in self._relay(call, state):
                    if isinstance(event, GatewayFinal):  # done, even if not read further
                        code = grpc.StatusCode.OK
                    yield event
            except (grpc.aio.AioRpcError, SpecServeError, asyncio.CancelledError) as e:
                if (failed := self._failed(e, req, replica)) is None:
                    raise
                code, detail = failed.code, failed.message
                raise failed from None
            finally:
                self._end_call(call, replica, req, state)
            code = grpc.StatusCode.OK
        finally:
            if replica is not None:
                self.replicas.release(replica)
            self._finish(span, code, state, time.perf_counter() - t0, api, detail, deadline)

    async def _admit(self, req: GatewayRequest, span, deadline: float) -> list[int]:
        """The validated request's prompt ids (raises InvalidRequest)."""
        span.set_attribute("request.id", req.request_id)
        check_stop(req.params.stop, self._stop_limits.max_strings, self._stop_limits.max_bytes,
                   STOP_FLAGS)
        prompt_ids = await self._prompt_ids(req, deadline)
        if (stopping := self._stopping.get(req.request_id)) is not None:
            await asyncio.wait({stopping})  # its id's last request, cut at a stop string
        span.set_attributes({"prompt_tokens": len(prompt_ids),
                             "max_tokens": req.params.max_tokens,
                             "drafter": req.drafter or "default"})
        return prompt_ids

    async def _relay(self, call, state: RequestState):
        async for event in call:
            step, final = convert.event_from_pb(event)
            if step is not None:  # a verifier's STOP is a stop id's (stop strings are ours)
                at_stop_id = final is not None and final.finish_reason == FinishReason.STOP
                text, step, stopped = state.push(step, at_stop_id)
                yield TextChunk(text, step)
                if stopped:  # the call is stopped at the verifier, then cancelled (run)
                    state.cut = True
                    yield state.final(FinishReason.STOP, None)
                    return
            if final is not None:
                text, stopped = state.tail()
                if text:
                    yield TextChunk(text, None)
                yield state.final(FinishReason.STOP if stopped else final.finish_reason, final)
                return
        raise SpecServeError("the verifier stream ended without a final event")

    def _pick(self, span) -> Replica:
        """The request's verifier replica."""
        replica = self.replicas.pick()
        span.set_attribute("verifier", replica.address)
        return replica

    def _call(self, replica: Replica, req: GatewayRequest, prompt_ids: list[int],
              deadline: float, span):
        """The verifier's Generate stream for the request, with the trace and peer metadata
        (cancelled at once after `abort_all`)."""
        call = replica.stub.Generate(
            convert.verify_request_to_pb(req, prompt_ids),
            timeout=max(deadline - time.monotonic(), 0.001),
            metadata=(*telemetry.inject_metadata(trace.set_span_in_context(span)),
                      *self._peer_metadata))
        self._calls.add(call)
        if self._aborting is not None:
            call.cancel()
        return call

    def _end_call(self, call, replica: Replica, req: GatewayRequest,
                  state: RequestState) -> None:
        """Cancel the verifier call; one cut at a stop string is first stopped there — in the
        background, the response does not wait — so the verifier frees the request at once
        and counts it finished, not cancelled; a request reusing the id waits for it (`_admit`)."""
        if state.cut and not call.done() and self._aborting is None:
            rid = req.request_id
            task = self._stopping[rid] = asyncio.ensure_future(self._stop(call, replica, req))
            task.add_done_callback(lambda t: self._stopping.pop(rid) if self._stopping.get(
                rid) is t else None)
        else:
            call.cancel()
            self._calls.discard(call)

    async def _stop(self, call, replica: Replica, req: GatewayRequest) -> None:
        try:
            await replica.stub.Stop(verifier_pb2.StopRequest(request_id=req.request_id),
                                    timeout=STOP_TIMEOUT_S, metadata=self._peer_metadata)
        except grpc.aio.AioRpcError as e:  # a verifier without Stop, or going down
            log.debug("request %s: Stop: %s", req.request_id, e.code().name)
        finally:
            call.cancel()
            self._calls.discard(call)

    async def drain(self) -> None:
        """Until the verifier calls being stopped have ended (at most STOP_TIMEOUT_S)."""
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)

    def _failed(self, e: BaseException, req: GatewayRequest,
                replica: Replica) -> GenerationFailed | None:
        """The client's error for a verifier call that ended in `e` (None: the consumer's own
        cancel, passed on; a call cancelled by `abort_all` is UNAVAILABLE)."""
        if isinstance(e, grpc.aio.AioRpcError):
            return GenerationFailed(e.code(), self._verifier_error(req, replica, e))
        if isinstance(e, SpecServeError):
            return GenerationFailed(status_for(e), str(e))
        task = asyncio.current_task()
        if self._aborting is None or (task is not None and task.cancelling()):
            return None
        return GenerationFailed(grpc.StatusCode.UNAVAILABLE, self._aborting)

    def _verifier_error(self, req: GatewayRequest, replica: Replica,
                        e: grpc.aio.AioRpcError) -> str:
        """The client's message for a failed verifier call; the log keeps the details. An
        UNAVAILABLE replica takes no new requests until its health check passes again."""
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            log.warning("request %s: verifier at %s unavailable: %s", req.request_id,
                        replica.address, e.details())
            self.replicas.mark_down(replica, f"UNAVAILABLE: {e.details()}")
            return "verifier unavailable"
        log.info("request %s: verifier %s: %s", req.request_id, e.code().name, e.details())
        if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return DEADLINE
        return e.details() or e.code().name

    def _check_context(self, prompt_tokens: int, req: GatewayRequest) -> None:
        """Refuse a prompt no verifier could take before it is checked id by id and sent."""
        if (limit := self.replicas.max_model_len) is not None:
            check_context(prompt_tokens, req.params.max_tokens, limit)

    async def _prompt_ids(self, req: GatewayRequest, deadline: float) -> list[int]:
        """The prompt's ids, refused if no verifier could take them; a text being encoded for
        another request (the choices of one HTTP request) waits for that encoding
        (`PromptEncoder.shared`), until `deadline` (time.monotonic)."""
        if req.token_ids is not None:
            self._check_context(len(req.token_ids), req)
            return self.tokenizer.check_ids(req.token_ids)
        ids = await self.prompts.shared(req.text, deadline - time.monotonic(),
                                        req.add_special_tokens)
        if not ids:
            raise InvalidRequest("prompt text encodes to no tokens")
        self._check_context(len(ids), req)
        return ids

    def _finish(self, span, code: grpc.StatusCode, state: RequestState | None, wall_s: float,
                api: str, detail: str, deadline: float) -> None:
        # the client's own deadline fires a transit time before ours (ours counts from
        # arrival): a cancel that close to it is the deadline
        code = ended_code(code, deadline - time.monotonic())
        final = state.final_ if state is not None else None
        if final is not None and span.is_recording():
            span.set_attributes({
                "completion_tokens": final.completion_tokens, "ttft_s": final.ttft_s,
                "finish_reason": str(final.finish_reason), "steps": final.stats.steps,
                "mean_commit_len": final.stats.mean_commit_len})
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {detail[:300]}"
                                   if detail else code.name))
        span.end()
        if self.metrics is None:
            return
        self.metrics.requests.labels(code=code.name, api=api).inc()
        self.metrics.duration.observe(wall_s)
        if state is not None and state.ttft_s:
            self.metrics.ttft.observe(state.ttft_s)
        if state is not None:
            self.metrics.completion_tokens.inc(state.completion_tokens)
