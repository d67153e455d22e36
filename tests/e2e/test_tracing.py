"""Traces and metrics of the three services as real subprocesses, end to end.

An in-process OTLP/gRPC receiver (tests/e2e/otlp_sink.py) starts first; drafter, verifier and
gateway export to it (`OTEL_EXPORTER_OTLP_ENDPOINT`, batch delay 200 ms, every step traced) and
serve Prometheus metrics on free ports. Two generations run one after the other — DFlash on a
random prompt, n-gram on a repetitive one (so steps accept) — then: one trace id per request
across the three service.names; parents generate → verifier.request → prefill / step →
draft / verify / commit, and draft.forward + ddtree.build (or ngram.draft) under draft; the
step attributes chain (each step's context_len = the previous one's + its commit_len) and add up
to the final stats; prefill + steps cover the `generate` span within 5%; a scrape of each
service agrees with the spans; the final message's phase times add up to its wall time.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter, defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.server import channel
from services.gateway import convert
from services.verifier.drafter_client import DRAFT_EVENTS
from specserve.types import SamplingParams
from specserve.v1 import gateway_pb2_grpc
from tests.e2e.otlp_sink import OtlpSink
from tests.e2e.test_services import (
    ENV,
    REPETITIVE,
    RPC_S,
    Stack,
    _free_ports,
    checkpoints,  # noqa: F401 (a fixture)
)
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(150)
NEW, BUDGET = 64, 8
RUNS = {"trace-dflash": ("dflash", None), "trace-ngram": ("ngram", REPETITIVE)}
SERVICES = ("gateway", "verifier", "drafter")


@pytest.fixture(scope="module")
def sink():
    s = OtlpSink().start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def traced(checkpoints, sink, tmp_path_factory):  # noqa: F811
    """The stack, the two generations' final messages, and every span they produced."""
    tdir, ddir = map(str, checkpoints)
    ports = dict(zip(SERVICES, _free_ports(3), strict=True))
    env = {**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
           "SPECSERVE_TRACE_STEPS": "1"}
    env.pop("OTEL_SERVICE_NAME", None)
    for name, port in ports.items():
        env[f"SPECSERVE_{name.upper()}_METRICS_PORT"] = str(port)
    stack = Stack(tmp_path_factory.mktemp("trace-stack"), env)
    cpu = ["--device", "cpu", "--dtype", "float32"]
    try:
        stack.start("drafter", ["--model", tdir, "--draft-model", ddir, *cpu])
        stack.start("verifier", ["--model", tdir, "--drafter", stack.addr("drafter"),
                                 "--draft-model", ddir, *cpu, "--max-draft-tokens", "16"])
        stack.start("gateway", ["--verifier", stack.addr("verifier"), "--model", tdir])
        finals = asyncio.run(_generate_all(stack.addr("gateway")))

        def complete(spans) -> bool:  # the drafter's spans arrive on their own schedule
            names = Counter((r.span.name, _attr(r.span, "request.id")) for r in spans)
            remote = {"trace-dflash": "ddtree.build", "trace-ngram": "ngram.draft"}
            return all(names["generate", rid] == 1 and names["prefill", rid] == 1
                       and names["step", rid] == names[remote[rid], rid] == f.stats.steps
                       for rid, f in finals.items())

        spans = sink.wait_for(complete, timeout_s=30)
        metrics = {name: _scrape(port) for name, port in ports.items()}
        yield finals, spans, metrics
    finally:
        stack.close()


async def _generate_all(gateway: str) -> dict[str, convert.GatewayFinal]:
    prompt = random_prompts(1, 300, [24], seed=5)[0]
    finals = {}
    async with channel(gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for rid, (drafter, ids) in RUNS.items():  # one at a time: steps are this request's
            req = convert.generate_request_to_pb(
                ids or prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), drafter,
                BUDGET, request_id=rid)
            async for msg in stub.Generate(req, timeout=RPC_S):
                event = convert.response_from_pb(msg)
                if isinstance(event, convert.GatewayFinal):
                    finals[rid] = event
    return finals


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _attr(span, key: str):
    for kv in span.attributes:
        if kv.key == key:
            v = kv.value
            return getattr(v, v.WhichOneof("value"))
    return None


def _dur(span) -> int:
    return span.end_time_unix_nano - span.start_time_unix_nano


class _Trace:
    """One request's spans, by id, with their services."""

    def __init__(self, spans, request_id: str) -> None:
        root = [r for r in spans if r.span.name == "generate"
                and _attr(r.span, "request.id") == request_id]
        assert len(root) == 1 and root[0].service == "gateway"
        self.root = root[0].span
        mine = [r for r in spans if r.span.trace_id == self.root.trace_id]
        self.service = {r.span.span_id: r.service for r in mine}
        self.spans = [r.span for r in mine]
        self.children = defaultdict(list)
        for s in self.spans:
            self.children[s.parent_span_id].append(s)

    def named(self, name: str) -> list:
        return sorted((s for s in self.spans if s.name == name),
                      key=lambda s: s.start_time_unix_nano)

    def kids(self, parent, name: str | None = None) -> list:
        return [s for s in self.children[parent.span_id] if name is None or s.name == name]


def test_one_trace_per_request_across_the_three_services(traced):
    finals, spans, _ = traced
    for rid, (drafter, _) in RUNS.items():
        t = _Trace(spans, rid)
        assert set(t.service.values()) == set(SERVICES), rid
        # every span anyone made for this request is in this trace
        assert {s.trace_id for r in spans for s in [r.span]
                if _attr(s, "request.id") == rid} == {t.root.trace_id}
        (vr,) = t.kids(t.root, "verifier.request")
        assert t.service[vr.span_id] == "verifier" and _attr(vr, "request.id") == rid
        assert {s.name for s in t.kids(vr)} == {"prefill", "step"}
        (prefill,) = t.kids(vr, "prefill")
        chunks = [e for e in prefill.events if e.name == "chunk"]
        assert chunks and sum(_attr(e, "tokens") for e in chunks) == finals[rid].prompt_tokens
        steps = t.named("step")
        assert len(steps) == finals[rid].stats.steps == len(t.kids(vr, "step"))
        for step in steps:
            assert sorted(s.name for s in t.kids(step)) == ["commit", "draft", "verify"]
            (draft,) = t.kids(step, "draft")
            remote = sorted(s.name for s in t.kids(draft))
            want = ["ddtree.build", "draft.forward"] if drafter == "dflash" else ["ngram.draft"]
            assert remote == want, (rid, remote)
            assert [e.name for e in draft.events] == list(DRAFT_EVENTS)
            marks = [e.time_unix_nano for e in draft.events]
            assert marks == sorted(marks) and draft.start_time_unix_nano <= marks[0]
            assert marks[-1] <= draft.end_time_unix_nano
            for s in t.kids(draft):  # causal: built before the drafter ran, reply in after
                assert marks[1] <= s.start_time_unix_nano and s.end_time_unix_nano <= marks[3]
            for s in t.kids(draft):
                assert t.service[s.span_id] == "drafter"
                assert draft.start_time_unix_nano <= s.start_time_unix_nano
                assert s.end_time_unix_nano <= draft.end_time_unix_nano
            for s in t.kids(step):
                assert step.start_time_unix_nano <= s.start_time_unix_nano
                assert s.end_time_unix_nano <= step.end_time_unix_nano
        for s in (prefill, *steps):
            assert vr.start_time_unix_nano <= s.start_time_unix_nano
            assert s.end_time_unix_nano <= vr.end_time_unix_nano
        assert t.root.start_time_unix_nano <= vr.start_time_unix_nano
        assert vr.end_time_unix_nano <= t.root.end_time_unix_nano


def test_step_attributes_chain_and_add_up_to_the_final_stats(traced):
    finals, spans, _ = traced
    for rid, final in finals.items():
        t = _Trace(spans, rid)
        steps = t.named("step")
        attrs = [{k: _attr(s, k) for k in ("request.id", "context_len", "budget", "tree_size",
                                            "accepted_depth", "commit_len", "cut")}
                 for s in steps]
        assert all(a["request.id"] == rid and a["budget"] == BUDGET for a in attrs)
        assert not any(_attr(s, "fallback") for s in steps)
        for a in attrs:
            assert 0 <= a["accepted_depth"] <= a["tree_size"] <= BUDGET
            assert a["commit_len"] == a["accepted_depth"] + 1 or a["cut"]
        assert attrs[0]["context_len"] == final.prompt_tokens  # the first token: prefill's
        for a, b in zip(attrs, attrs[1:], strict=False):
            assert b["context_len"] == a["context_len"] + a["commit_len"]
        assert sum(a["commit_len"] for a in attrs) == final.completion_tokens - 1
        assert sum(a["accepted_depth"] for a in attrs) == final.stats.accepted_tokens
        assert sum(a["tree_size"] for a in attrs) == final.stats.draft_tokens
        assert Counter(a["commit_len"] for a in attrs) == final.stats.commit_len_hist
    ngram = [_attr(s, "accepted_depth") for s in _Trace(spans, "trace-ngram").named("step")]
    assert max(ngram) > 1, "the repetitive prompt should make n-gram drafts accept"


def test_prefill_and_steps_cover_the_generate_span(traced):
    _, spans, _ = traced
    report = {}
    for rid in RUNS:
        t = _Trace(spans, rid)
        covered = _dur(t.named("prefill")[0]) + sum(_dur(s) for s in t.named("step"))
        report[rid] = round(covered / _dur(t.root), 4)
    print("prefill + steps / generate:", json.dumps(report))
    assert all(0.95 <= r <= 1.0 for r in report.values()), report


def test_final_stats_are_filled_end_to_end(traced):
    finals, _, _ = traced
    for f in finals.values():
        s = f.stats
        assert f.completion_tokens == NEW and s.steps > 0
        assert s.committed_tokens == NEW - 1 == sum(k * v for k, v in s.commit_len_hist.items())
        assert sum(s.commit_len_hist.values()) == s.steps
        assert s.mean_commit_len == pytest.approx(s.committed_tokens / s.steps)
        assert min(s.prefill_s, s.draft_s, s.verify_s, s.commit_s) > 0 and f.other_s >= 0
        phases = s.prefill_s + s.draft_s + s.verify_s + s.commit_s + f.other_s
        assert phases == pytest.approx(f.wall_s, rel=1e-6)


def test_prometheus_scrapes_agree_with_the_spans(traced):
    finals, spans, metrics = traced
    steps = [r.span for r in spans if r.span.name == "step"]
    depths = [_attr(s, "accepted_depth") for s in steps]
    v, g, d = metrics["verifier"], metrics["gateway"], metrics["drafter"]

    def val(m, name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    n = len(steps)
    assert n == sum(f.stats.steps for f in finals.values())
    assert val(v, "specserve_steps_total") == n
    assert val(v, "specserve_accepted_tokens_total") == sum(depths)
    assert val(v, "specserve_draft_tokens_total") == sum(_attr(s, "tree_size") for s in steps)
    assert val(v, "specserve_committed_tokens_total") == sum(_attr(s, "commit_len")
                                                              for s in steps)
    assert val(v, "specserve_commit_len_count") == n
    assert val(v, "specserve_commit_len_sum") == sum(_attr(s, "commit_len") for s in steps)
    for pos in range(1, max(depths) + 1):
        assert val(v, "specserve_accepted_per_position_total", position=str(pos)) == \
            sum(dep >= pos for dep in depths)
    for phase in ("draft", "verify", "commit"):  # one request at a time: engine step = step
        assert val(v, "specserve_phase_seconds_count", phase=phase) == n
    assert val(v, "specserve_phase_seconds_count", phase="prefill") == len(finals)
    assert val(v, "specserve_ttft_seconds_count") == val(v, "specserve_tpot_seconds_count") == 2
    assert val(v, "specserve_requests_total", code="OK") == 2
    assert val(v, "specserve_kv_pages_used") == 0 and val(v, "specserve_kv_pages_free") > 0
    assert not [k for k in v if k[0] == "specserve_drafter_fallbacks_total"]
    assert val(g, "specserve_gateway_requests_total", api="grpc", code="OK") == 2
    assert val(g, "specserve_gateway_ttft_seconds_count") == 2
    assert val(g, "specserve_gateway_completion_tokens_total") == 2 * NEW
    forwards = sum(r.span.name == "draft.forward" for r in spans)
    lookups = sum(r.span.name == "ngram.draft" for r in spans)
    assert val(d, "specserve_drafter_entries_total", drafter="dflash", result="ok") == forwards
    assert val(d, "specserve_drafter_entries_total", drafter="ngram", result="ok") == lookups
    assert forwards + lookups == n == val(d, "specserve_drafter_batches_total")
    assert val(d, "specserve_drafter_feeds_total") >= 1  # dflash prompts went ahead (feeds)
    assert val(d, "specserve_drafter_phase_seconds_count", phase="forward") == forwards
