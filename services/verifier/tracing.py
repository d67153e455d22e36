"""The verifier's per-request spans below `verifier.request`: `prefill` and `step` × n, each step
with children `draft`, `verify`, `commit`.

Engine steps are batched, so every request traced in a step gets its own `step` span covering
the shared step, with explicit timestamps: the step loop's mark just before `engine.step()`
and the engine's own `StepTimes` (draft end, verify end, commit end). The drafter's spans must
be children of the request's `draft` span, so that span has to exist *before* the drafter call:
`RemoteDrafter.draft` (engine thread) asks `open_draft` for each request it sends, which starts
its `step` and `draft` spans and returns the `draft` span's W3C context for the entry. After the
step, `end_step` ends them with the engine's timestamps; requests that did not draft (budget 0,
no drafter) get all their spans created there, after the fact. A draft sent ahead (during a
step's commit, for the next step: engine/overlap.Ahead) opens the next step's `step` and
`draft` spans at that moment, and the step that sent it (its `commit`, or the prompt's
`prefill`) ends there: what the verifier does after sending it — the step records, streaming,
the next schedule — runs while the drafter drafts, inside the next step's `draft`.

A step is draft → verify → commit → stream, so a `step` span (and `prefill`)
ends when the loop starts its next step — or, for a request's last one, once its outputs are
handed over: the time after `commit` (streaming the tokens, the loop's bookkeeping, waiting for
the GIL held by the event loop) is the step span's self time. A request's prefill and steps thus
cover its time in the engine without gaps. A request that ends during its prefill (cancelled, its
deadline passed) still gets its `prefill` span, with the chunks done, as an error.

`trace_steps` N: trace a request's steps 0, N, 2N, … (1 = every step, 0 = none; prefill and the
request spans are always traced). Every method runs on the engine thread; the registry is
still lock-protected so that nothing else can ever see it half-updated.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from specserve.spec.metrics import StepOutcome, StepTimes, reason_kind


@dataclass(eq=False)
class _Traced:
    parent: Context  # the request's `verifier.request` span
    steps: int = 0  # steps seen (traced or not)
    prefill_start_ns: int = 0
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (time, start, tokens)
    open: tuple | None = None  # (step span, draft span) opened by `open_draft` this step
    ahead: tuple | None = None  # the same, opened during this step for the next (draft ahead)
    ahead_ns: int = 0  # when `ahead` was opened: where this step's spans end
    decoding: bool = False  # its first token is out: a draft sent ahead is for step steps + 1
    tail: object = None  # its last prefill / step span: ends when the next step begins
    request_id: str = ""


class StepTracer:
    def __init__(self, trace_steps: int = 1, tracer: trace.Tracer | None = None) -> None:
        if trace_steps < 0:
            raise ValueError(f"trace_steps must be >= 0, got {trace_steps}")
        self.trace_steps = trace_steps
        self._tracer = tracer or telemetry.tracer("specserve.verifier")
        self._lock = threading.Lock()
        self._requests: dict[str, _Traced] = {}
        self._step_start_ns = 0

    # ---- registry --------------------------------------------------------------------------
    def add(self, request_id: str, parent: Context | None) -> None:
        """Trace `request_id` under `parent` (its `verifier.request` span); None: not traced."""
        if parent is not None:
            with self._lock:
                self._requests[request_id] = _Traced(parent, request_id=request_id)

    def remove(self, request_id: str, end_ns: int | None = None) -> None:
        """Stop tracing `request_id`; its last and open spans end at `end_ns` (default: now)."""
        with self._lock:
            traced = self._requests.pop(request_id, None)
        if traced is None:
            return
        end_ns = end_ns or time.time_ns()
        if traced.chunks and not traced.decoding:  # it ended during its prefill
            self._prefill_span(traced, "the request ended mid-prefill")
        self._end_open(traced, "the request ended mid-step", end_ns)
        self._end_open(traced, "the request ended with a draft in flight", end_ns, ahead=True)
        self._end_tail(traced, end_ns)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests

    def _traces_step(self, traced: _Traced, later: int = 0) -> bool:
        """Whether the request's step `later` steps after this one is traced."""
        return self.trace_steps > 0 and (traced.steps + later) % self.trace_steps == 0

    # ---- one engine step -------------------------------------------------------------------
    def begin_step(self, start_ns: int) -> None:
        """The step loop is about to call `engine.step()` (wall clock, ns)."""
        self._step_start_ns = start_ns
        with self._lock:
            for traced in self._requests.values():
                self._end_tail(traced, start_ns)

    def open_draft(self, request_id: str, ahead_ns: int | None = None) -> dict[str, str]:
        """Start the request's `step` and `draft` spans (if that step is traced); returns the
        `draft` span's W3C context for its DraftEntry ({} if untraced). `ahead_ns`: the draft
        is for the next step, sent during this one's commit at that wall-clock time, where
        its spans start."""
        ahead = ahead_ns is not None
        with self._lock:
            traced = self._requests.get(request_id)
            if traced is None or not self._traces_step(traced, int(ahead and traced.decoding)):
                return {}
            spans = traced.ahead if ahead else traced.open
            if spans is None:
                start = ahead_ns if ahead else self._step_start_ns
                step = self._tracer.start_span("step", traced.parent, start_time=start)
                draft = self._tracer.start_span("draft", trace.set_span_in_context(step),
                                                kind=SpanKind.CLIENT, start_time=start)
                spans = (step, draft)
                if ahead:
                    traced.ahead, traced.ahead_ns = spans, ahead_ns
                else:
                    traced.open = spans
            return telemetry.traceparent(spans[1].get_span_context())

    def note_draft(self, request_ids, events: list[tuple[str, int]]) -> None:
        """Events (name, wall clock ns) on the open `draft` span of each of `request_ids`."""
        with self._lock:
            spans = [t.open[1] for rid in request_ids
                     if (t := self._requests.get(rid)) is not None and t.open is not None]
        for span in spans:
            for name, ns in events:
                span.add_event(name, timestamp=ns)

    def end_step(self, outputs, times: StepTimes | None) -> None:
        """After `engine.step()`: prefill chunk events and spans, and every traced step."""
        if times is None:
            self.abandon_step("the engine step did no work")
            return
        t0 = min(self._step_start_ns or times.start_ns, times.start_ns)
        with self._lock:
            for request_id, start, tokens in times.prefill:
                traced = self._requests.get(request_id)
                if traced is not None:
                    traced.prefill_start_ns = traced.prefill_start_ns or t0
                    traced.chunks.append((t0, start, tokens))
            for out in outputs:
                traced = self._requests.get(out.request_id)
                if traced is None:
                    continue
                traced.decoding = True
                if out.stats is None:  # the token sampled at the end of prefill
                    self._prefill_span(traced)
                    continue
                if traced.open is not None or self._traces_step(traced):
                    self._step_spans(traced, out.request_id, out.stats, times, t0)
                traced.steps += 1
        self.abandon_step("no output for the request this step")

    def abandon_step(self, why: str) -> None:
        """End the step: spans still open for it end with `why` (the engine raised, or the
        request had no output); the drafts sent ahead during it become the next step's."""
        with self._lock:
            opened = [t for t in self._requests.values() if t.open is not None]
        for traced in opened:
            self._end_open(traced, why, time.time_ns())
        with self._lock:
            for traced in self._requests.values():
                traced.open, traced.ahead = traced.ahead, None

    # ---- spans -------------------------------------------------------------------------------
    def _prefill_span(self, traced: _Traced, error: str | None = None) -> None:
        """The request's `prefill` span, its chunks as events (`error`: it ended mid-prefill)."""
        span = self._tracer.start_span("prefill", traced.parent,
                                       start_time=traced.prefill_start_ns or None)
        span.set_attribute("request.id", traced.request_id)
        span.set_attribute("prefill.chunks", len(traced.chunks))
        span.set_attribute("prefill.tokens", sum(n for _, _, n in traced.chunks))
        for t, first, n in traced.chunks:
            span.add_event("chunk", {"tokens": n, "start": first}, timestamp=t)
        traced.chunks.clear()
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        self._set_tail(traced, span)

    def _step_spans(self, traced: _Traced, request_id: str, outcome: StepOutcome,
                    times: StepTimes, t0: int) -> None:
        step = outcome.step
        if traced.open is not None:
            step_span, draft = traced.open
            traced.open = None
        else:
            step_span = self._tracer.start_span("step", traced.parent, start_time=t0)
            draft = self._tracer.start_span("draft", trace.set_span_in_context(step_span),
                                            kind=SpanKind.CLIENT, start_time=t0)
        if step_span.is_recording():
            attrs = {"request.id": request_id, "step.index": traced.steps,
                     "context_len": outcome.context_len, "budget": step.budget,
                     "tree_size": step.tree_size, "accepted_depth": step.accepted_depth,
                     "commit_len": step.commit_len, "cut": step.cut}
            if step.fallback:
                attrs["fallback"] = step.fallback
            if step.shape:  # adaptive speculation: what it chose and why
                attrs["adaptive.shape"], attrs["adaptive.why"] = step.shape, step.why or ""
                attrs["adaptive.reason"] = reason_kind(step.why or "")
            step_span.set_attributes(attrs)
        if step.fallback:  # the drafter's answer was lost or unusable: a root-only tree
            draft.set_status(Status(StatusCode.ERROR, step.fallback[:200]))
        draft.end(end_time=times.draft_end_ns)
        ctx = trace.set_span_in_context(step_span)
        self._tracer.start_span("verify", ctx, start_time=times.draft_end_ns).end(
            end_time=times.verify_end_ns)
        commit_end = traced.ahead_ns if traced.ahead is not None else times.end_ns
        self._tracer.start_span("commit", ctx, start_time=times.verify_end_ns).end(
            end_time=max(commit_end, times.verify_end_ns))
        self._set_tail(traced, step_span)

    @staticmethod
    def _set_tail(traced: _Traced, span) -> None:
        """`span` (the request's prefill or step) ends where its next step begins: when the
        next draft was sent ahead (the rest of this step's commit is the next one's draft
        wait), or else when the loop starts its next step (`begin_step`)."""
        if traced.ahead is not None:
            span.end(end_time=traced.ahead_ns)
        else:
            traced.tail = span

    @staticmethod
    def _end_tail(traced: _Traced, end_ns: int) -> None:
        if traced.tail is not None:
            traced.tail.end(end_time=end_ns)
            traced.tail = None

    @staticmethod
    def _end_open(traced: _Traced, why: str, end_ns: int, ahead: bool = False) -> None:
        """End the request's open `step` and `draft` spans as errors (`why`) at `end_ns`."""
        spans = traced.ahead if ahead else traced.open
        if spans is not None and spans[0].is_recording():
            spans[0].set_attributes({"request.id": traced.request_id,
                                     "step.index": traced.steps + int(ahead and traced.decoding)})
        for span in reversed(spans or ()):
            span.set_status(Status(StatusCode.ERROR, why))
            span.end(end_time=max(end_ns, getattr(span, "start_time", None) or 0))
        if ahead:
            traced.ahead = None
        else:
            traced.open = None
