"""The verifier's request lifecycle (services/verifier/requests.py) against a fake step loop.

A finished request: its outputs with the time so far, the `verifier.request` span ended (with
its budget, asked and capped) before the final reaches the caller, counted OK, TTFT observed.
A refused one fails with its status before anything is queued; one the engine fails carries the
error's name; one whose caller goes away early is aborted on the loop at once, counted CANCELLED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.common.metrics import VerifierMetrics
from services.verifier.convert import GenerateArgs
from services.verifier.requests import RequestFailed, Requests
from specserve.errors import CapacityExhausted, InvalidRequest, ModelError
from specserve.types import SamplingParams

pytestmark = pytest.mark.asyncio


class FakeLoop:
    """`submit` hands back a queue holding `items`; `abort` is recorded."""

    def __init__(self, items=(), refuse: Exception | None = None) -> None:
        self.items, self.refuse, self.aborted, self.queue = list(items), refuse, [], None

    async def submit(self, request_id, prompt_ids, params, budget, kind, context):
        if self.refuse is not None:
            raise self.refuse
        self.queue = asyncio.Queue()
        for item in self.items:
            self.queue.put_nowait(item)
        return self.queue

    def abort(self, request_id, owner=None):
        self.aborted.append((request_id, owner is self.queue))


def _item(tokens: int, finished: bool = False):
    output = SimpleNamespace(finished=finished, num_output_tokens=tokens, finish_reason=None,
                             new_token_ids=[7])
    return SimpleNamespace(output=output, step=None, stats=None)


def _args(budget=4, asked=4, capped=False) -> GenerateArgs:
    return GenerateArgs("r1", [1, 2], SamplingParams(max_tokens=3), budget, "ngram", asked,
                        capped)


@pytest.fixture
def lifecycle():
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    requests = Requests(VerifierMetrics())
    requests._tracer = provider.get_tracer("test")
    return requests, exporter


def _count(requests: Requests, code: str) -> float:
    return requests.metrics.registry.get_sample_value("specserve_requests_total", {"code": code})


async def test_a_finished_request_ends_its_span_before_the_final(lifecycle, caplog):
    requests, exporter = lifecycle
    requests.loop = FakeLoop([_item(1), _item(2), _item(3, finished=True)])
    seen = []
    with caplog.at_level(logging.DEBUG, logger="services.verifier.requests"):
        async for item, wall_s in requests.run(lambda: _args(16, 100, True), None):
            seen.append((item.output.num_output_tokens, wall_s, len(exporter.get_finished_spans())))
    assert [n for n, _, _ in seen] == [1, 2, 3]
    assert [ended for _, _, ended in seen] == [0, 0, 1]  # ended when the final is handed out
    assert all(a[1] <= b[1] for a, b in zip(seen, seen[1:], strict=False))
    (span,) = exporter.get_finished_spans()
    assert span.name == "verifier.request" and span.status.status_code is not StatusCode.ERROR
    assert (span.attributes["budget"], span.attributes["budget.asked"]) == (16, 100)
    assert span.attributes["drafter"] == "ngram"
    assert span.attributes["completion_tokens"] == 3
    assert "request r1: budget 100 capped at 16 (--max-draft-tokens)" in caplog.text
    assert _count(requests, "OK") == 1 and requests.loop.aborted == []
    assert requests.metrics.registry.get_sample_value("specserve_ttft_seconds_count") == 1


@pytest.mark.parametrize("refusal, code", [
    (InvalidRequest("budget must be in [0, 16]"), grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
async def test_a_refused_request_fails_with_its_status(lifecycle, refusal, code):
    requests, exporter = lifecycle
    requests.loop = FakeLoop(refuse=refusal)
    with pytest.raises(RequestFailed) as err:
        async for _ in requests.run(_args, None):
            pass
    assert (err.value.code, err.value.message) == (code, str(refusal))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.status.description == code.name
    assert _count(requests, code.name) == 1 and requests.loop.aborted == []


async def test_a_parse_error_is_invalid_argument(lifecycle):
    requests, _ = lifecycle
    requests.loop = FakeLoop()

    def parse():
        raise InvalidRequest("unknown drafter kind 9")

    with pytest.raises(RequestFailed) as err:
        async for _ in requests.run(parse, None):
            pass
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert _count(requests, "INVALID_ARGUMENT") == 1


async def test_an_engine_failure_names_the_error(lifecycle):
    requests, _ = lifecycle
    requests.loop = FakeLoop([_item(1), ModelError("NaN logits")])
    with pytest.raises(RequestFailed) as err:
        async for _ in requests.run(_args, None):
            pass
    assert err.value.code is grpc.StatusCode.INTERNAL
    assert err.value.message == "request 'r1' failed: ModelError: NaN logits"
    assert requests.loop.aborted == [("r1", True)] and _count(requests, "INTERNAL") == 1


async def test_a_caller_that_goes_away_frees_the_request_at_once(lifecycle):
    requests, exporter = lifecycle
    requests.loop = FakeLoop([_item(1), _item(2)])
    async with contextlib.aclosing(requests.run(_args, None)) as outputs:
        async for _ in outputs:
            break  # the client cancelled after the first token
    assert requests.loop.aborted == [("r1", True)] and _count(requests, "CANCELLED") == 1
    (span,) = exporter.get_finished_spans()
    assert span.status.description == "CANCELLED"


@pytest.mark.parametrize("left, code", [(0.01, "DEADLINE_EXCEEDED"), (5.0, "CANCELLED"),
                                        (None, "CANCELLED")])
async def test_a_cancel_at_the_calls_deadline_is_counted_as_deadline_exceeded(lifecycle, left,
                                                                              code):
    requests, exporter = lifecycle
    requests.loop = FakeLoop([_item(1), _item(2)])
    async with contextlib.aclosing(requests.run(_args, None, lambda: left)) as outputs:
        async for _ in outputs:
            break  # gRPC cancels the handler when the deadline passes
    assert _count(requests, code) == 1 and requests.loop.aborted == [("r1", True)]
    (span,) = exporter.get_finished_spans()
    assert span.status.description == code


async def test_a_stopped_request_is_freed_and_counted_finished(lifecycle):
    """The gateway matched a stop string after 2 tokens: `stop` frees the request and ends its
    span as a finished one; the caller's cancel that follows changes neither."""
    requests, exporter = lifecycle
    requests.loop = FakeLoop([_item(1), _item(2)])
    assert not requests.stop("r1")  # not running yet
    async with contextlib.aclosing(requests.run(_args, None)) as outputs:
        async for item, _ in outputs:
            if item.output.num_output_tokens == 2:
                assert requests.stop("r1") and not requests.stop("r1")
                assert requests.loop.aborted == [("r1", True)]
                break
    assert requests.loop.aborted == [("r1", True)]  # not aborted again
    assert _count(requests, "OK") == 1 and _count(requests, "CANCELLED") is None
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is not StatusCode.ERROR
    assert (span.attributes["finish_reason"], span.attributes["completion_tokens"]) == \
        ("stop", 2)
    registry = requests.metrics.registry
    assert registry.get_sample_value("specserve_ttft_seconds_count") == 1
    assert registry.get_sample_value("specserve_tpot_seconds_count") == 1
    assert not requests.stop("r1")  # closed: no longer known


async def test_a_request_that_does_not_draft_names_no_drafter(lifecycle):
    requests, exporter = lifecycle
    requests.loop = FakeLoop([_item(1, finished=True)])
    async for _ in requests.run(lambda: _args(budget=0, asked=8), None):  # --drafter none
        pass
    (span,) = exporter.get_finished_spans()
    assert span.attributes["drafter"] == "none"
