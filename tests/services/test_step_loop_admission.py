"""The step loop's admission window (services/verifier/loop.py, `--admission-window-ms`).

Woken from idle by a request, the engine thread waits up to the window for more, so that
requests sent together are prefilled in one step; without a window the first is stepped alone.
A lone request waits at most the window, a burst no longer than it takes to fill a step; work
that arrives while the engine is busy waits for no window. Against a fake engine whose step
records who ran in it; the flag's range.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.verifier.config import MAX_ADMISSION_WINDOW_MS, VerifierConfig
from services.verifier.loop import StepLoop
from specserve.spec.metrics import RequestSpecStats
from specserve.types import RequestOutput, SamplingParams

STEP_S = 0.15  # each fake step's duration


class FakeEngine:
    """Every request runs one step and finishes; `steps` lists (start time, request ids)."""

    def __init__(self, full_at: int | None = None, step_s: float = STEP_S) -> None:
        self.requests: dict = {}
        self.step_s = step_s
        self.pending: list[str] = []
        self.full_at = full_at  # the waiting requests fill a step from this many
        self.scheduler = self
        self.steps: list[tuple[float, list[str]]] = []
        self.last_step = None

    def add_request(self, request_id, prompt_ids, params, budget, drafter_kind=None) -> None:
        self.requests[request_id] = SimpleNamespace(spec_stats=RequestSpecStats())
        self.pending.append(request_id)

    def abort(self, request_id) -> bool:
        return self.requests.pop(request_id, None) is not None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    @property
    def next_step_full(self) -> bool:
        return self.full_at is not None and len(self.pending) >= self.full_at

    def step(self) -> list[RequestOutput]:
        ran, self.pending = self.pending, []
        self.steps.append((time.perf_counter(), ran))
        time.sleep(self.step_s)
        return [RequestOutput(r, [5], "", "length", 2, 1) for r in ran]


async def _run(window_s: float, delays_s: list[float], full_at: int | None = None,
               step_s: float = STEP_S) -> tuple[FakeEngine, list[float]]:
    """Submit one request per delay (each that long after the start, concurrently); wait for
    all; the engine (its `loop` set) and when each request was submitted."""
    engine = FakeEngine(full_at, step_s)
    engine.loop = loop = StepLoop(engine, admission_window_s=window_s)
    loop.start()
    sent = [0.0] * len(delays_s)

    async def one(i: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        sent[i] = time.perf_counter()
        q = await loop.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=1), 0)
        event = await asyncio.wait_for(q.get(), 5)
        assert event.output.finished

    try:
        await asyncio.gather(*(one(i, d) for i, d in enumerate(delays_s)))
    finally:
        await asyncio.to_thread(loop.stop)
    return engine, sent


@pytest.mark.asyncio
async def test_requests_sent_together_are_stepped_together_within_the_window():
    engine, _ = await _run(0.4, [0.0, 0.03, 0.06])
    assert [ids for _, ids in engine.steps] == [["r0", "r1", "r2"]]


@pytest.mark.asyncio
async def test_without_a_window_the_first_request_is_stepped_alone():
    engine, _ = await _run(0.0, [0.0, 0.03, 0.06])
    assert [ids for _, ids in engine.steps] == [["r0"], ["r1", "r2"]]
    assert "admission_wait" not in engine.loop.profile


@pytest.mark.asyncio
async def test_a_lone_request_waits_at_most_the_window():
    engine, sent = await _run(0.05, [0.0])
    (started, ids), = engine.steps
    assert ids == ["r0"]
    assert 0.04 < started - sent[0] < 0.05 + 0.1
    assert 0.03 < engine.loop.profile["admission_wait"] <= started - sent[0]  # in Stats.profile


@pytest.mark.asyncio
async def test_the_window_ends_once_the_waiting_requests_fill_a_step():
    # a step is full with 2 requests: the second's arrival starts it, not the 0.5 s window
    engine, sent = await _run(0.8, [0.0, 0.05, 0.1], full_at=2)
    (t0, first), (_, second) = engine.steps
    assert first == ["r0", "r1"] and second == ["r2"]
    assert t0 - sent[1] < 0.3  # the window would have run to 0.8 s after r0


@pytest.mark.asyncio
async def test_a_request_arriving_while_the_engine_is_busy_waits_for_no_window():
    # r1 arrives during r0's 0.5 s step (0.3-0.8 s): its window (to 0.65 s) has passed when the
    # step ends, so it runs at once; a window counted from then would start it 0.3 s later
    engine, _ = await _run(0.3, [0.0, 0.35], step_s=0.5)
    (t0, first), (t1, second) = engine.steps
    assert first == ["r0"] and second == ["r1"]
    assert t1 - t0 < 0.5 + 0.15


@pytest.mark.parametrize("window", [-1.0, MAX_ADMISSION_WINDOW_MS + 1, float("nan")])
def test_a_window_out_of_range_is_refused(window):
    with pytest.raises(ValueError, match="admission_window_ms"):
        VerifierConfig(model="m", admission_window_ms=window)


def test_the_window_defaults_to_none():
    assert VerifierConfig(model="m").admission_window_ms == 0
