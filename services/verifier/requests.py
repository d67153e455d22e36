"""One verifier request's lifecycle, from its parsed arguments to its last output (no protobuf).

`Requests.run(parse, parent)` opens the request's `verifier.request` span (SERVER, a child of the
caller's context `parent`), parses it (`parse()`: the servicer's convert), submits it to the
step loop and yields each `StepEvent` with the request's wall time so far. The span ends before
the final event is yielded, so it ends before the caller's own. However the call ends —
finished, failed, cancelled, its deadline expired — the request is freed at once
(`StepLoop.abort`: its KV pages and drafter state) and counted under its status code in
`specserve_requests_total` (a cancel within DEADLINE_SLACK_S of the call's deadline is
DEADLINE_EXCEEDED); a finished one observes TTFT and TPOT. `stop(request_id)` (the `Stop` RPC:
the gateway matched a stop string) finishes a running request early: freed, counted OK, its
span ended with finish_reason stop. Failures surface as `RequestFailed(code, message)` (codes
through services/common/errors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from services.common.errors import ended_code, status_for
from services.verifier.convert import GenerateArgs
from services.verifier.events import StepEvent
from services.verifier.loop import StepLoop
from specserve.types import FinishReason

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request ended in error: its gRPC status and the caller's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(eq=False)
class _Call:
    span: trace.Span
    t0: float
    code: grpc.StatusCode = grpc.StatusCode.CANCELLED  # until it finishes or fails
    args: GenerateArgs | None = None
    events: asyncio.Queue | None = None  # the step loop's queue once submitted
    finished: bool = False
    first_s: float | None = None
    tokens: int = 0  # output tokens sent so far
    time_left: Callable[[], float | None] | None = None  # the call's deadline, if it has one


class Requests:
    """The verifier's requests, run on `loop` (None until the model is loaded)."""

    def __init__(self, metrics=None) -> None:
        self.loop: StepLoop | None = None
        self.metrics = metrics  # VerifierMetrics | None
        self._tracer = telemetry.tracer("specserve.verifier")
        self._live: dict[str, _Call] = {}  # submitted and not closed, by request id

    async def run(self, parse: Callable[[], GenerateArgs], parent,
                  time_left: Callable[[], float | None] | None = None
                  ) -> AsyncIterator[tuple[StepEvent, float]]:
        """(each output of the request, seconds since it began); raises RequestFailed.
        `time_left()`: seconds to the call's deadline (None: no deadline)."""
        call = _Call(self._tracer.start_span("verifier.request", parent, kind=SpanKind.SERVER),
                     time.perf_counter(), time_left=time_left)
        try:
            await self._submit(call, parse)
            self._live[call.args.request_id] = call
            while not call.finished:
                item = await call.events.get()
                if call.finished:  # stopped meanwhile: what is left is not for the caller
                    return
                if isinstance(item, BaseException):  # the engine failed it (or its step)
                    call.code = status_for(item)
                    raise RequestFailed(call.code, f"request {call.args.request_id!r} failed: "
                                                   f"{type(item).__name__}: {item}")
                wall_s = time.perf_counter() - call.t0
                call.first_s = wall_s if call.first_s is None else call.first_s
                call.tokens = item.output.num_output_tokens
                call.finished = item.output.finished
                if call.finished:  # the span ends before the caller sees the final
                    call.code = grpc.StatusCode.OK
                    self._finish(call, item.output.finish_reason, item.stats, wall_s)
                yield item, wall_s
        finally:
            self._close(call)

    def stop(self, request_id: str) -> bool:
        """The caller has what it needs of a running request: free it now and count it as
        finished on a stop string (False: no such request running)."""
        call = self._live.get(request_id)
        if call is None or call.finished or call.first_s is None:
            return False
        call.finished, call.code = True, grpc.StatusCode.OK
        call.events.put_nowait(None)  # wakes `run`, which ends the call
        self.loop.abort(request_id, owner=call.events)
        self._finish(call, FinishReason.STOP, None, time.perf_counter() - call.t0)
        return True

    async def _submit(self, call: _Call, parse: Callable[[], GenerateArgs]) -> None:
        try:
            call.args = args = parse()
            call.span.set_attributes({"request.id": args.request_id,
                                      "prompt_tokens": len(args.prompt_ids),
                                      "budget": args.budget, "budget.asked": args.asked_budget,
                                      "drafter": "none" if not args.budget
                                      else args.drafter_kind or "default"})
            if args.capped:
                log.debug("request %s: budget %d capped at %d (--max-draft-tokens)",
                          args.request_id, args.asked_budget, args.budget)
            call.events = await self.loop.submit(args.request_id, args.prompt_ids, args.params,
                                                 args.budget, args.drafter_kind,
                                                 trace.set_span_in_context(call.span))
        except Exception as e:  # InvalidRequest, CapacityExhausted, ...
            call.code = status_for(e)
            raise RequestFailed(call.code, str(e)) from None

    def _finish(self, call: _Call, reason: FinishReason | None, stats, wall_s: float) -> None:
        span = call.span
        if span.is_recording():
            span.set_attributes({"completion_tokens": call.tokens, "finish_reason": str(reason)})
            if stats is not None:
                span.set_attributes({"steps": stats.steps,
                                     "mean_commit_len": stats.mean_commit_len})
        span.end()
        if self.metrics is not None:
            self.metrics.ttft.observe(call.first_s)
            if call.tokens > 1:
                self.metrics.tpot.observe((wall_s - call.first_s) / (call.tokens - 1))

    def _close(self, call: _Call) -> None:
        """Cancelled, expired or failed: free the request now; count it either way."""
        if call.events is not None:
            if self._live.get(call.args.request_id) is call:
                del self._live[call.args.request_id]
            if not call.finished:
                self.loop.abort(call.args.request_id, owner=call.events)
        # the caller's cancel comes a transit time before its deadline
        call.code = ended_code(call.code, call.time_left() if call.time_left else None)
        if self.metrics is not None:
            self.metrics.requests.labels(code=call.code.name).inc()
        if not call.finished:
            call.span.set_status(Status(StatusCode.ERROR, call.code.name))
            call.span.end()
