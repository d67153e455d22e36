"""The step loop sets torch's thread count step by step (services/verifier/loop.py with a
`StepThreads`, the verifier's `--threads auto` on the CPU beside a drafter).

Against a fake engine whose step records the count torch has on the engine thread: a step
taken while a request waits or prefills gets the prefill count, a step of decoding requests
alone the decode count; without a `StepThreads` the count is left alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from services.common.device import StepThreads
from services.verifier.loop import StepLoop
from specserve.spec.metrics import RequestSpecStats
from specserve.types import RequestOutput, SamplingParams

STEPS = 4  # a request: one prefill step, then decode steps


class FakeEngine:
    """A request waits, prefills in its first step and decodes in the next STEPS − 1."""

    def __init__(self) -> None:
        self.requests: dict = {}
        self.waiting: deque = deque()
        self.running: list = []
        self.scheduler = self
        self.seen: list[tuple[bool, int]] = []  # (prefill step?, torch threads in it)
        self.last_step = None

    def add_request(self, request_id, prompt_ids, params, budget, drafter_kind=None) -> None:
        self.requests[request_id] = SimpleNamespace(spec_stats=RequestSpecStats())
        self.waiting.append(SimpleNamespace(request_id=request_id, in_prefill=True, steps=0))

    def abort(self, request_id) -> bool:
        return self.requests.pop(request_id, None) is not None

    @property
    def has_prompt_work(self) -> bool:
        return bool(self.waiting) or any(s.in_prefill for s in self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self.running += list(self.waiting)
        self.waiting.clear()
        self.seen.append((any(s.in_prefill for s in self.running), torch.get_num_threads()))
        outputs = []
        for seq in list(self.running):
            seq.in_prefill, seq.steps = False, seq.steps + 1
            done = seq.steps == STEPS
            if done:
                self.running.remove(seq)
            outputs.append(RequestOutput(seq.request_id, [5], "", "length" if done else None,
                                         2, seq.steps))
        return outputs


async def _run(threads: StepThreads | None) -> FakeEngine:
    engine = FakeEngine()
    loop = StepLoop(engine, threads=threads)
    loop.start()
    try:
        q = await loop.submit("r0", [1, 2, 3], SamplingParams(max_tokens=STEPS), 0)
        while not (await asyncio.wait_for(q.get(), 5)).output.finished:
            pass
    finally:
        await asyncio.to_thread(loop.stop)
    return engine


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.asyncio
async def test_prefill_steps_get_the_prefill_count_and_decode_steps_the_decode_count():
    engine = await _run(StepThreads(prefill=2, decode=1))
    assert engine.seen == [(True, 2)] + [(False, 1)] * (STEPS - 1)


@pytest.mark.asyncio
async def test_without_step_threads_the_count_is_left_alone():
    torch.set_num_threads(1)
    engine = await _run(None)
    assert [n for _, n in engine.seen] == [1] * STEPS
