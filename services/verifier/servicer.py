"""The Verifier gRPC servicer: thin — convert, hand to the step loop, convert back.

`Generate` streams one VerifyEvent per step that committed tokens for the request (the last one
carries `final`); core errors map to status codes through services/common/errors. A cancelled
or expired stream aborts its request, so its KV pages (and drafter state) are freed at once.
Each call is one `verifier.request` span, a child of the caller's span (W3C `traceparent` in the
call metadata); the step loop hangs the request's prefill and step spans below it.
"""

from __future__ import annotations

import itertools
import logging
import time

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from services.common.errors import status_for
from services.verifier import convert
from services.verifier.loop import StepEvent, StepLoop
from specserve.v1 import verifier_pb2_grpc

log = logging.getLogger(__name__)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, limits: convert.SpecLimits, metrics=None) -> None:
        self.limits = limits
        self.metrics = metrics  # VerifierMetrics | None
        self.loop: StepLoop | None = None  # set by `attach` once the model is loaded
        self.drafter = None
        self._ids = itertools.count()
        self._tracer = telemetry.tracer("specserve.verifier")

    def attach(self, loop: StepLoop, drafter=None) -> None:
        self.loop, self.drafter = loop, drafter

    async def Generate(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        t0 = time.perf_counter()
        span = self._tracer.start_span(
            "verifier.request", telemetry.extract_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER)
        code, finished, events, args = grpc.StatusCode.CANCELLED, False, None, None
        try:
            try:
                args = convert.generate_args_from_pb(request, self.limits,
                                                     f"verify-{next(self._ids)}")
                span.set_attributes({"request.id": args.request_id,
                                     "prompt_tokens": len(args.prompt_ids),
                                     "budget": args.budget, "budget.asked": args.asked_budget,
                                     "drafter": args.drafter_kind or "default"})
                if args.capped:
                    log.debug("request %s: budget %d capped at %d (--max-draft-tokens)",
                              args.request_id, args.asked_budget, args.budget)
                events = await self.loop.submit(args.request_id, args.prompt_ids, args.params,
                                                args.budget, args.drafter_kind,
                                                trace.set_span_in_context(span))
            except Exception as e:  # InvalidRequest, CapacityExhausted, ...
                code = status_for(e)
                await context.abort(code, str(e))
            error, first_s, item = None, None, None
            while not finished:
                item = await events.get()
                if isinstance(item, BaseException):
                    error = item
                    break
                finished = item.output.finished
                if first_s is None:
                    first_s = time.perf_counter() - t0
                event = self._event(item, t0)
                if finished:  # end the span before the caller can see the final and end its own
                    code = grpc.StatusCode.OK
                    self._finish(span, item, first_s, time.perf_counter() - t0)
                    span.end()
                yield event
            if error is not None:  # the engine failed this request (or its whole step)
                code = status_for(error)
                await context.abort(code, f"request {args.request_id!r} failed: "
                                          f"{type(error).__name__}: {error}")
        finally:  # cancelled, deadline expired or failed: free the request now
            if events is not None and not finished:
                self.loop.abort(args.request_id, owner=events)
            if self.metrics is not None:
                self.metrics.requests.labels(code=code.name).inc()
            if not finished:
                span.set_status(Status(StatusCode.ERROR, code.name))
                span.end()

    def _finish(self, span, item: StepEvent, first_s: float | None, wall_s: float) -> None:
        out, stats = item.output, item.stats
        if span.is_recording():
            span.set_attributes({"completion_tokens": out.num_output_tokens,
                                 "finish_reason": str(out.finish_reason)})
            if stats is not None:
                span.set_attributes({"steps": stats.steps,
                                     "mean_commit_len": stats.mean_commit_len})
        if self.metrics is not None and first_s is not None:
            self.metrics.ttft.observe(first_s)
            if out.num_output_tokens > 1:
                self.metrics.tpot.observe((wall_s - first_s) / (out.num_output_tokens - 1))

    @staticmethod
    def _event(item: StepEvent, t0: float):
        event = convert.step_event_to_pb(item.output.new_token_ids, item.step)
        if item.output.finished:
            convert.final_to_pb(event, item.output, item.stats, time.perf_counter() - t0)
        return event

    async def Stats(self, request, context):
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is loading its model")
        connected = self.drafter is not None and self.drafter.connected
        transport = self.drafter.transport if connected else ""
        rows = dict(self.drafter.context_rows) if self.drafter is not None else {}
        profile = dict(self.loop.profile) | (dict(self.drafter.profile) if self.drafter else {})
        return convert.stats_to_pb(self.loop.stats(), connected, transport, rows, profile)
