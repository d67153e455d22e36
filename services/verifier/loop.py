"""The verifier's step loop: the one thread that owns the `Engine`.

The engine is synchronous and single-threaded, so every call into it (add, abort, step) happens
on a dedicated thread. The asyncio side talks to it through a thread-safe inbox of commands;
the thread drains the inbox, runs `engine.step()` while there is work (sleeping on the inbox
when idle; woken by a request, it waits up to `admission_window_s` for more to prefill with
it) and hands the step's outputs to their requests' asyncio queues with one
`call_soon_threadsafe` (one wake-up of the event loop a step). Per-request queues are bounded
by the request's max_tokens (the engine thread must never block on one slow client). No grpc
here.

A request that fails inside the engine (an output with `error`) gets that exception on its
queue and nothing else happens to the others; only a step that raises fails every request.

After each step, once the outputs are on their way, the thread records the step's spans
(`StepTracer`, services/verifier/tracing.py) and Prometheus metrics (`VerifierMetrics`):
both are optional and cost nothing when absent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

from services.common.metrics import fallback_kind
from services.verifier.events import LoopStats, StepEvent
from specserve.engine.engine import Engine
from specserve.errors import RequestAborted
from specserve.spec.metrics import RequestSpecStats
from specserve.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    queue: asyncio.Queue
    spec_stats: RequestSpecStats


class StepLoop:
    """Runs `engine` on its own thread; `submit`/`abort`/`stats` are called from asyncio."""

    def __init__(self, engine: Engine, metrics=None, tracer=None,
                 admission_window_s: float = 0.0, threads=None) -> None:
        self.engine = engine
        self.threads = threads  # StepThreads | None: torch's thread count by step
        self.admission_window_s = admission_window_s  # see _drain
        self.metrics = metrics  # VerifierMetrics | None
        self.tracer = tracer  # StepTracer | None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (put at, command) | None
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the counters below
        self._fallbacks: Counter = Counter()
        self._steps = 0
        # seconds in engine_step / deliver / observe, and admission_wait (the window's waits)
        self.profile: Counter = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- asyncio side ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._update_gauges()  # the pool's pages from the start, not from the first step
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     budget: int, drafter_kind: str | None = None,
                     trace_context=None) -> asyncio.Queue:
        """Add a request; returns the queue its `StepEvent`s arrive on (an exception instead if
        the engine fails the request or its whole step). Raises what `engine.add_request`
        raises (InvalidRequest, CapacityExhausted); nothing is queued then. `trace_context` (an
        OTel Context holding the request's span) parents its prefill and step spans."""
        if self._stopping or self._thread is None:
            raise RequestAborted("the verifier is not running (shutting down)")
        q: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(partial(self._add, request_id, list(prompt_ids), params, budget,
                          drafter_kind, q, done, trace_context))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id, owner=q)  # it may have been added meanwhile
            raise
        return q

    async def call(self, fn, *args):
        """`fn(*args)` on the engine thread, between steps; its result. The warm-up runs here:
        torch keeps cuDNN's attention plans per thread (built on another, requests rebuild them)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(partial(_settle, done, fn, args))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str, owner: asyncio.Queue | None = None) -> None:
        """Cancel a request and free its pages (and drafter state) at the next inbox drain.
        With `owner`, only if the request is still the one that `submit` returned it for."""
        self._put(partial(self._abort, request_id, owner, time.time_ns()))

    def stats(self) -> LoopStats:
        blocks, sched = self.engine.blocks, self.engine.scheduler
        with self._lock:
            fallbacks, steps = dict(self._fallbacks), self._steps
        return LoopStats(pages_used=blocks.num_used_pages, pages_free=blocks.num_free_pages,
                         pages_total=blocks.num_pages, pages_reserved=blocks.num_reserved_pages,
                         preempted=sched.num_preempted, active=len(sched.running),
                         waiting=len(sched.waiting), fallbacks=fallbacks, steps=steps,
                         max_model_len=self.engine.max_model_len)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, end the thread (blocking: call via asyncio.to_thread)."""
        self._stopping = True
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout_s)

    def _put(self, command) -> None:
        self._inbox.put((time.perf_counter(), command))

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while self._drain(block=not self.engine.has_unfinished):
            if self.engine.has_unfinished:
                self._step()
        for request_id in list(self._requests):
            self._fail(request_id, RequestAborted("the verifier shut down"))

    def _drain(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once stop was asked. Woken
        from idle by new work, it goes on taking commands until `admission_window_s` after that
        work arrived, so that requests sent together are prefilled in one step — or until the
        waiting requests fill that step (a long prompt alone waits for nothing)."""
        deadline = waited_from = None
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    item = self._inbox.get(block=block, timeout=timeout)
                except queue.Empty:
                    return True
                if item is None:
                    return False
                put_at, command = item
                command()
                if block and deadline is None and self.admission_window_s > 0 \
                        and self.engine.has_unfinished:
                    deadline, waited_from = put_at + self.admission_window_s, time.perf_counter()
                block = deadline is not None and deadline > time.perf_counter() \
                    and not self.engine.scheduler.next_step_full
        finally:
            if waited_from is not None:
                self.profile["admission_wait"] += time.perf_counter() - waited_from

    def _add(self, request_id, prompt_ids, params, budget, kind, q, done, trace_context=None
             ) -> None:
        if not done.set_running_or_notify_cancel():
            return  # the caller went away first
        try:
            self.engine.add_request(request_id, prompt_ids, params, budget, drafter_kind=kind)
        except Exception as e:  # InvalidRequest / CapacityExhausted → the caller
            done.set_exception(e)
            return
        self._requests[request_id] = _Request(q, self.engine.requests[request_id].spec_stats)
        if self.tracer is not None:
            self.tracer.add(request_id, trace_context)
        self._update_gauges()
        done.set_result(None)

    def _abort(self, request_id: str, owner: asyncio.Queue | None, asked_ns: int) -> None:
        req = self._requests.get(request_id)
        if owner is not None and (req is None or req.queue is not owner):
            return
        self._requests.pop(request_id, None)
        self.engine.abort(request_id)
        if self.tracer is not None:  # its spans end when the abort was asked, inside the
            self.tracer.remove(request_id, asked_ns)  # request's (the step may run on past it)
        self._update_gauges()

    def _step(self) -> None:
        if self.threads is not None:  # a step that carries prompt tokens gets every core
            self.threads.use(self.engine.scheduler.has_prompt_work)
        if self.tracer is not None:
            self.tracer.begin_step(time.time_ns())
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # a broken step fails its requests, never the thread
            log.exception("engine step failed")
            if self.tracer is not None:
                self.tracer.abandon_step(f"engine step failed: {e}")
            for request_id in list(self._requests):
                self._fail(request_id, e)
            return
        with self._lock:
            self._steps += 1
        t1 = time.perf_counter()
        finished = {}  # request id -> when its final event was handed over
        events = []  # (queue, event): handed to the event loop at once, one wake-up a step
        for out in outputs:
            if out.finished:
                finished[out.request_id] = time.time_ns()
            self._deliver(out, events)
        self._post_all(events)
        t2 = time.perf_counter()
        self._observe(outputs, finished)  # after delivery: off the tokens' path
        self.profile.update(engine_step=t1 - t0, deliver=t2 - t1,
                            observe=time.perf_counter() - t2)

    def _deliver(self, out: RequestOutput, events: list) -> None:
        if out.error is not None:  # the engine already ended it; the others go on
            self._fail(out.request_id, out.error)
            return
        step = out.stats.step if out.stats is not None else None
        if step is not None and step.fallback:
            self._count_fallback(step.fallback)
        req = self._requests.pop(out.request_id) if out.finished else \
            self._requests.get(out.request_id)
        if req is None:
            return
        if self.metrics is not None and step is None:  # prefill done: its first token
            self.metrics.phase.labels(phase="prefill").observe(req.spec_stats.prefill_s)
        snapshot = copy.deepcopy(req.spec_stats) if out.finished else None
        events.append((req.queue, StepEvent(out, step, snapshot)))

    def _observe(self, outputs: list[RequestOutput], finished: dict[str, int]) -> None:
        """The step's spans and metrics (engine thread, after the outputs went out)."""
        times = self.engine.last_step
        if self.tracer is not None:
            self.tracer.end_step(outputs, times)
            for request_id, handed_over_ns in finished.items():
                self.tracer.remove(request_id, handed_over_ns)
        if self.metrics is None:
            return
        steps = [out.stats.step for out in outputs if out.stats is not None]
        for step in steps:
            self.metrics.record_step(step)
        if times is not None:
            self.metrics.record_engine_step(times, decoded=bool(steps))
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            blocks, sched = self.engine.blocks, self.engine.scheduler
            self.metrics.set_pages(blocks.num_used_pages, blocks.num_free_pages,
                                   len(self._requests), blocks.num_reserved_pages,
                                   sched.num_preempted, len(sched.waiting))

    def _count_fallback(self, reason: str) -> None:
        with self._lock:  # by kind: the server-wide counter names no request
            self._fallbacks[fallback_kind(reason)] += 1
        if self.metrics is not None:
            self.metrics.record_fallback(reason)

    def _fail(self, request_id: str, error: BaseException) -> None:
        req = self._requests.pop(request_id, None)
        if self.tracer is not None:
            self.tracer.remove(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)
        if req is not None:
            self._post(req.queue, error)

    def _post_all(self, events: list[tuple[asyncio.Queue, object]]) -> None:
        if events:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(_put_all, events)

    def _post(self, q: asyncio.Queue, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self._loop.call_soon_threadsafe(q.put_nowait, item)


def _put_all(events: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in events:
        q.put_nowait(item)


def _settle(done: concurrent.futures.Future, fn, args) -> None:
    if done.set_running_or_notify_cancel():
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 — the caller's, whatever it is
            done.set_exception(e)
