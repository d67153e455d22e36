"""The verifier's StepTracer on a scripted engine timeline (in-memory exporter, no processes):
`--trace-steps N` picks steps 0, N, 2N, …; the draft span's context is what the drafter gets;
step / prefill spans end where the next step begins; abandoned steps end as errors; and the
W3C helpers round-trip through gRPC metadata."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.common import telemetry
from services.common.metrics import FALLBACK_KINDS, VerifierMetrics, fallback_kind
from services.verifier.tracing import StepTracer
from specserve.spec.metrics import RequestSpecStats, StepOutcome, StepRecord, StepTimes
from specserve.types import RequestOutput

STEPS, T0, MS = 7, 1_000_000_000_000, 1_000_000


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _drive(tracer: StepTracer, otel, drafting=True) -> tuple[object, list[dict]]:
    """Prefill (2 chunks) then STEPS decode steps of 10 ms each for request "r"."""
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    contexts, t = [], T0
    for i in range(2):  # two prefill chunks; the second samples the first token
        tracer.begin_step(t)
        out = [RequestOutput("r", [5])] if i == 1 else []
        tracer.end_step(out, StepTimes(t, t + MS, t + 8 * MS, t + 9 * MS, (("r", 4 * i, 4),)))
        t += 10 * MS
    for k in range(STEPS):
        tracer.begin_step(t)
        contexts.append(tracer.open_draft("r") if drafting else {})
        step = StepRecord(8, 8, k % 3, k % 3 + 1, False)
        out = RequestOutput("r", [1] * step.commit_len,
                            stats=StepOutcome(step, RequestSpecStats(), 9 + k))
        tracer.end_step([out], StepTimes(t, t + 2 * MS, t + 6 * MS, t + 7 * MS))
        t += 10 * MS
    tracer.remove("r", t)
    parent.end(end_time=t)
    return parent, contexts


@pytest.mark.parametrize("every", [1, 3])
def test_every_nth_step_is_traced(spans, every):
    otel, exporter = spans
    parent, contexts = _drive(StepTracer(every, otel), otel)
    got = exporter.get_finished_spans()
    steps = sorted((s for s in got if s.name == "step"), key=lambda s: s.start_time)
    assert [s.attributes["step.index"] for s in steps] == list(range(0, STEPS, every))
    assert [bool(c) for c in contexts] == [k % every == 0 for k in range(STEPS)]
    traced_ctx = [c for c in contexts if c]
    for step, ctx in zip(steps, traced_ctx, strict=True):
        assert step.parent.span_id == parent.get_span_context().span_id
        kids = {s.name: s for s in got if s.parent and s.parent.span_id ==
                step.context.span_id}
        assert set(kids) == {"draft", "verify", "commit"}
        draft_ctx = trace.get_current_span(telemetry.extract_map(ctx)).get_span_context()
        assert draft_ctx.span_id == kids["draft"].context.span_id  # what the drafter parents on
        assert kids["draft"].end_time == kids["verify"].start_time == step.start_time + 2 * MS
        assert kids["commit"].end_time == step.start_time + 7 * MS
        assert step.end_time == step.start_time + 10 * MS  # the next step's start: no gap
        assert step.attributes["accepted_depth"] + 1 == step.attributes["commit_len"]
    (prefill,) = [s for s in got if s.name == "prefill"]
    assert [(e.name, e.attributes["start"], e.attributes["tokens"]) for e in prefill.events] \
        == [("chunk", 0, 4), ("chunk", 4, 4)]
    assert (prefill.start_time, prefill.end_time) == (T0, T0 + 20 * MS)


@pytest.mark.parametrize("every", [1, 3])
def test_drafts_sent_ahead_open_the_next_steps_spans(spans, every):
    """`draft_ahead`: each step's next draft is sent during its commit (6.5 ms in), the first
    during the step that ends the prompt; the next step's spans start there, and the step (or
    the prefill) that sent it ends there when that next step is traced."""
    otel, exporter = spans
    tracer = StepTracer(every, otel)
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    contexts, sent, t = [], [], T0
    for k in range(-1, STEPS):  # -1: the prompt's only chunk, its first token sampled
        tracer.begin_step(t)
        if k + 1 < STEPS:
            sent.append(t + 6 * MS + MS // 2)
            contexts.append(tracer.open_draft("r", ahead_ns=sent[-1]))
        if k < 0:
            out = RequestOutput("r", [5])
            times = StepTimes(t, t, t + 6 * MS, t + 7 * MS, (("r", 0, 8),))
        else:
            step = StepRecord(8, 8, k % 3, k % 3 + 1, False)
            out = RequestOutput("r", [1] * step.commit_len,
                                stats=StepOutcome(step, RequestSpecStats(), 9 + k))
            times = StepTimes(t, t + 2 * MS, t + 6 * MS, t + 7 * MS)
        tracer.end_step([out], times)
        t += 10 * MS
    tracer.remove("r", t)
    parent.end(end_time=t)
    got = exporter.get_finished_spans()
    steps = sorted((s for s in got if s.name == "step"), key=lambda s: s.start_time)
    assert [s.attributes["step.index"] for s in steps] == list(range(0, STEPS, every))
    assert [bool(c) for c in contexts] == [k % every == 0 for k in range(STEPS)]
    assert all(s.status.status_code is not StatusCode.ERROR for s in got)
    for step, ctx in zip(steps, [c for c in contexts if c], strict=True):
        k = step.attributes["step.index"]
        kids = {s.name: s for s in got if s.parent and s.parent.span_id ==
                step.context.span_id}
        draft_ctx = trace.get_current_span(telemetry.extract_map(ctx)).get_span_context()
        assert draft_ctx.span_id == kids["draft"].context.span_id
        assert step.start_time == kids["draft"].start_time == sent[k]  # in the last commit
        begin = T0 + 10 * MS * (k + 1)
        assert kids["draft"].end_time == kids["verify"].start_time == begin + 2 * MS
        end = sent[k + 1] if k + 1 < STEPS and (k + 1) % every == 0 else begin + 10 * MS
        assert step.end_time == end and kids["commit"].end_time == min(end, begin + 7 * MS)
    (prefill,) = [s for s in got if s.name == "prefill"]
    assert prefill.end_time == sent[0]


def test_trace_steps_0_keeps_prefill_only_and_late_spans_without_drafting(spans):
    otel, exporter = spans
    _, contexts = _drive(StepTracer(0, otel), otel)
    assert not any(contexts)
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["prefill",
                                                                      "verifier.request"]
    exporter.clear()
    _drive(StepTracer(1, otel), otel, drafting=False)  # budget 0: spans made after the step
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("step") == names.count("draft") == STEPS


def test_untraced_requests_and_abandoned_steps(spans):
    otel, exporter = spans
    tracer = StepTracer(1, otel)
    assert tracer.open_draft("unknown") == {}
    tracer.add("none", None)  # no parent context: not traced
    assert "none" not in tracer
    parent = otel.start_span("verifier.request")
    tracer.add("r", trace.set_span_in_context(parent))
    tracer.begin_step(T0)
    assert "traceparent" in tracer.open_draft("r")
    tracer.abandon_step("engine step failed: boom")
    bad = exporter.get_finished_spans()
    assert sorted(s.name for s in bad) == ["draft", "step"]
    assert all(s.status.status_code is StatusCode.ERROR for s in bad)
    step = next(s for s in bad if s.name == "step")  # cut short, it still says whose it was
    assert (step.attributes["request.id"], step.attributes["step.index"]) == ("r", 0)
    tracer.begin_step(T0 + 10 * MS)
    tracer.open_draft("r")
    tracer.remove("r", T0 + 12 * MS)  # an abort asked then: its open spans end there
    cut = [s for s in exporter.get_finished_spans() if s not in bad]
    assert sorted(s.name for s in cut) == ["draft", "step"]
    assert {s.end_time for s in cut} == {T0 + 12 * MS}
    with pytest.raises(ValueError):
        StepTracer(-1, otel)


def test_a_request_that_ends_mid_prefill_keeps_its_prefill_span(spans):
    otel, exporter = spans
    tracer = StepTracer(1, otel)
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    for i in range(3):  # three chunks of a longer prompt, no token yet
        t = T0 + 10 * MS * i
        tracer.begin_step(t)
        tracer.end_step([], StepTimes(t, t + MS, t + 8 * MS, t + 9 * MS, (("r", 64 * i, 64),)))
    tracer.remove("r", T0 + 35 * MS)  # its deadline passed
    (prefill,) = exporter.get_finished_spans()
    assert prefill.name == "prefill" and prefill.status.status_code is StatusCode.ERROR
    assert (prefill.start_time, prefill.end_time) == (T0, T0 + 35 * MS)
    assert (prefill.attributes["prefill.chunks"], prefill.attributes["prefill.tokens"]) == \
        (3, 192)
    assert prefill.attributes["request.id"] == "r"  # cut short, it still says whose it was
    assert [e.attributes["start"] for e in prefill.events] == [0, 64, 128]


def test_w3c_context_round_trips_through_grpc_metadata(spans):
    otel, _ = spans
    span = otel.start_span("generate")
    metadata = telemetry.inject_metadata(trace.set_span_in_context(span))
    assert [k for k, _ in metadata] == ["traceparent"]
    got = trace.get_current_span(telemetry.extract_metadata(metadata)).get_span_context()
    assert (got.trace_id, got.span_id) == (span.get_span_context().trace_id,
                                           span.get_span_context().span_id)
    assert not trace.get_current_span(telemetry.extract_metadata(())).get_span_context() \
        .is_valid


def test_fallback_labels_are_a_fixed_set():
    """Label values (and the verifier's Stats keys) never carry request ids, counts or
    messages: every reason maps into FALLBACK_KINDS."""
    assert fallback_kind("drafter_error: DrafterTimeout: no reply within 2.0 s") == \
        "drafter_timeout"
    assert fallback_kind("drafter_error: DrafterUnavailable: no stream") == "drafter_unavailable"
    assert fallback_kind("drafter_error: ValueError: drafter returned 3 trees") == "drafter_error"
    assert fallback_kind("invalid_tree: too deep") == "invalid_tree"
    assert fallback_kind("drafter_entry_error: INVALID_ARGUMENT: request 'x' …") == \
        "drafter_entry_error"
    assert fallback_kind("drafter_context_lost: its rows were not kept") == \
        "drafter_context_lost"
    m = VerifierMetrics()
    for i in range(100):
        m.record_fallback(f"reason{i}: detail of request r{i}")
        m.record_fallback(f"drafter_error: Error{i}: x")
    labels = {s.labels["reason"] for s in m.fallbacks.collect()[0].samples}
    assert labels <= set(FALLBACK_KINDS) and labels == {"other", "drafter_error"}
    stats = RequestSpecStats()  # a request's own count uses the same kinds as the metric
    for reason in ("drafter_error: DrafterUnavailable: no stream to the drafter",
                   "drafter_error: DrafterUnavailable: [Errno 104] Connection reset by peer",
                   "drafter_error: DrafterTimeout: no reply within 2.0 s"):
        stats.record(StepRecord(0, 0, 0, 1, False, fallback=reason))
    assert stats.fallbacks == {"drafter_unavailable": 2, "drafter_timeout": 1}


def test_adaptive_steps_carry_their_shape_why_and_reason(spans):
    """With adaptive speculation a step span says what was verified and why, and the why's
    kind; the metrics count the same steps by shape and by reason kind (a fixed label set)."""
    otel, exporter = spans
    tracer, m = StepTracer(1, otel), VerifierMetrics()
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    whys = [("tree", 15, "step rows 16: 3.14 tok/step in 7.29 ms (+8.48 draft) = 199 tok/s"),
            ("tree", 15, "held: step rows 16: 3.14 tok/step in 7.29 ms (+8.48 draft) = 199"),
            ("tree", 31, "explore: 15 held nodes saturated; step rows 16: 3.14 tok/step"),
            ("off", 0, "plain decoding expected faster; probe in 3 steps")]
    t = T0
    for k, (shape, n, why) in enumerate(whys):
        tracer.begin_step(t)
        tracer.open_draft("r")
        step = StepRecord(63, n, 0, 1, False, shape=shape, why=why)
        m.record_step(step)
        tracer.end_step([RequestOutput("r", [1], stats=StepOutcome(step, RequestSpecStats(),
                                                                    9 + k))],
                        StepTimes(t, t + 2 * MS, t + 6 * MS, t + 7 * MS))
        t += 10 * MS
    tracer.remove("r", t)  # the last step's span ends with the request
    steps = sorted((s for s in exporter.get_finished_spans() if s.name == "step"),
                   key=lambda s: s.start_time)
    assert [(s.attributes["adaptive.shape"], s.attributes["adaptive.why"],
             s.attributes["adaptive.reason"]) for s in steps] == [
        (shape, why, kind) for (shape, _, why), kind in
        zip(whys, ["decided", "held", "explore", "plain"], strict=True)]
    counted = {s.labels["reason"]: s.value for s in m.reasons.collect()[0].samples
               if s.name.endswith("_total")}
    assert counted == {"decided": 1, "held": 1, "explore": 1, "plain": 1}


def test_note_draft_puts_events_on_open_draft_spans_only(spans):
    """RemoteDrafter's round-trip stamps land on each traced request's open `draft` span, at
    their own times, in order; untraced or unopened requests get nothing."""
    otel, exporter = spans
    tracer = StepTracer(1, otel)
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    tracer.add("idle", trace.set_span_in_context(parent))  # traced, but no draft opened
    tracer.begin_step(T0 + MS)
    tracer.open_draft("r")
    events = [("drafter.call", T0 + 2 * MS), ("batch.built", T0 + 2 * MS + 137),
              ("reply.taken", T0 + 5 * MS + 9)]
    tracer.note_draft(["r", "idle", "unknown"], events)
    step = StepRecord(8, 8, 1, 2, False)
    tracer.end_step([RequestOutput("r", [1, 2], stats=StepOutcome(step, RequestSpecStats(), 9))],
                    StepTimes(T0 + MS, T0 + 6 * MS, T0 + 7 * MS, T0 + 8 * MS))
    tracer.remove("r", T0 + 9 * MS)
    tracer.remove("idle", T0 + 9 * MS)
    (draft,) = [s for s in exporter.get_finished_spans() if s.name == "draft"]
    assert [(e.name, e.timestamp) for e in draft.events] == events
    assert all(not s.events for s in exporter.get_finished_spans() if s.name != "draft")


def test_a_fallback_steps_draft_span_is_an_error_with_the_reason(spans):
    otel, exporter = spans
    tracer = StepTracer(1, otel)
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    tracer.begin_step(T0)
    tracer.end_step([RequestOutput("r", [5])], StepTimes(T0, T0 + MS, T0 + 2 * MS, T0 + 3 * MS,
                                                        (("r", 0, 8),)))
    reason = "drafter_error: DrafterTimeout: no reply within 2.0 s"
    for k, why in enumerate((reason, None)):
        t = T0 + 10 * MS * (k + 1)
        tracer.begin_step(t)
        tracer.open_draft("r")
        step = StepRecord(8, 0 if why else 8, 0, 1, False, fallback=why)
        out = RequestOutput("r", [1], stats=StepOutcome(step, RequestSpecStats(), 9 + k))
        tracer.end_step([out], StepTimes(t, t + 2 * MS, t + 6 * MS, t + 7 * MS))
    tracer.remove("r", T0 + 40 * MS)
    drafts = sorted((s for s in exporter.get_finished_spans() if s.name == "draft"),
                    key=lambda s: s.start_time)
    assert [(d.status.status_code, d.status.description) for d in drafts] == \
        [(StatusCode.ERROR, reason), (StatusCode.UNSET, None)]
    steps = [s for s in exporter.get_finished_spans() if s.name == "step"]
    assert all(s.status.status_code is StatusCode.UNSET for s in steps)


def test_overlap_groups_open_their_next_steps_spans_while_sitting_out(spans):
    """`--overlap on`: a request's draft goes out during the step it sits out (the other group
    is verified), for its next step: no span ends as an error, and every verified step has its
    spans, the draft from where it was sent."""
    otel, exporter = spans
    tracer = StepTracer(1, otel)
    parent = otel.start_span("verifier.request", start_time=T0)
    tracer.add("r", trace.set_span_in_context(parent))
    tracer.begin_step(T0)
    tracer.end_step([RequestOutput("r", [5])], StepTimes(T0, T0, T0 + 6 * MS, T0 + 7 * MS,
                                                          (("r", 0, 8),)))
    sent, t = [], T0 + 10 * MS
    for k in range(2 * STEPS):  # even steps: out; odd steps: verified
        tracer.begin_step(t)
        out = []
        if k % 2 == 0:
            sent.append(t + MS)
            tracer.open_draft("r", ahead_ns=sent[-1])
        else:
            step = StepRecord(8, 8, 1, 2, False)
            out = [RequestOutput("r", [1, 1], stats=StepOutcome(step, RequestSpecStats(), k))]
        tracer.end_step(out, StepTimes(t, t + 2 * MS, t + 6 * MS, t + 7 * MS))
        t += 10 * MS
    tracer.remove("r", t)
    parent.end(end_time=t)
    got = exporter.get_finished_spans()
    assert [s for s in got if s.status.status_code is StatusCode.ERROR] == []
    steps = sorted((s for s in got if s.name == "step"), key=lambda s: s.start_time)
    assert [s.attributes["step.index"] for s in steps] == list(range(STEPS))
    assert [s.start_time for s in steps] == sent
