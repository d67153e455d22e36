"""The Drafter gRPC servicer: thin — convert, call the core in a worker thread, convert back.

Owns the stream lifecycle: each `Draft` stream remembers the requests it drafted for and
releases them when it ends for any reason (the verifier finished, disconnected or cancelled),
so a dropped verifier never leaks drafter cache. Model work always runs in a worker thread
(`asyncio.to_thread`); the event loop only moves messages. Errors go through the one status
table (services/common/errors.py): a bad entry or batch gets error strings and the stream goes
on; anything unexpected is logged with its request ids and ends the stream with that status.

Tracing: an entry whose `trace_context` names its request's `draft` span (the verifier sets it
on traced steps) gets that span's children here, timed by the batch's measurements:
`draft.forward` + `ddtree.build` (DFlash), or `ngram.draft` (n-gram prompt lookup).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from opentelemetry.trace import Status, StatusCode

from services.common import telemetry
from services.common.errors import status_for
from services.drafter import convert
from services.drafter.core import DFLASH, DrafterCore, DraftTimes, Entry, Result
from specserve.errors import InvalidRequest, SpecServeError
from specserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


def error_text(error: BaseException) -> str:
    """An error string for a Tree: the status code name the table gives, then the message."""
    return f"{status_for(error).name}: {error}"


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """`core` may be set after the server starts (models still loading: UNAVAILABLE)."""

    def __init__(self, core: DrafterCore | None = None, metrics=None) -> None:
        self.core = core
        self.metrics = metrics  # DrafterMetrics | None
        self._tracer = telemetry.tracer("specserve.drafter")

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[drafter_pb2.TreeBatch]:
        core = await self._ready(context)
        drafted: set[str] = set()
        try:
            async for batch in request_iterator:
                drafted.update(convert.request_ids(batch))
                yield await self._draft_batch(core, batch, context)
        finally:
            if drafted:  # shielded: the release must finish even if the handler is cancelled
                await asyncio.shield(asyncio.to_thread(core.release, sorted(drafted)))

    async def Release(
        self, request: drafter_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.ReleaseReply:
        core = await self._ready(context)
        await asyncio.shield(asyncio.to_thread(core.release, convert.release_ids(request)))
        return drafter_pb2.ReleaseReply()

    async def _ready(self, context: grpc.aio.ServicerContext) -> DrafterCore:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is loading its models")
        return self.core

    async def _draft_batch(self, core: DrafterCore, batch: drafter_pb2.DraftBatch,
                           context: grpc.aio.ServicerContext) -> drafter_pb2.TreeBatch:
        try:
            return await asyncio.to_thread(self._draft_step, core, batch)
        except SpecServeError as e:
            return convert.error_batch_to_pb(batch, error_text(e))
        except Exception as e:
            log.exception("draft step %d failed for requests %s", batch.step_id,
                          convert.request_ids(batch))
            await context.abort(status_for(e), f"draft step {batch.step_id} failed: {e}")


    def _draft_step(self, core: DrafterCore,
                    batch: drafter_pb2.DraftBatch) -> drafter_pb2.TreeBatch:
        """Runs in a worker thread: decode the entries, draft, encode the trees."""
        t0 = time.perf_counter()
        device, dtype = core.context_device, core.context_dtype
        entries: list[Entry | str] = []
        for msg in batch.entries:
            try:
                entries.append(convert.entry_from_pb(msg, device, dtype))
            except InvalidRequest as e:
                entries.append(error_text(e))
        results, times = core.draft_timed(entries)
        reply = convert.tree_batch_to_pb(batch, results, times)
        self._spans(batch, results, times)
        if self.metrics is not None and convert.is_feed(batch):
            self.metrics.feeds.inc(len(batch.entries))
        elif self.metrics is not None:
            self._metrics(results, times, time.perf_counter() - t0)
        return reply

    def _spans(self, batch: drafter_pb2.DraftBatch, results: Sequence[Result],
               times: DraftTimes) -> None:
        contexts = convert.trace_contexts(batch)
        if not any(contexts):
            return
        for g in times.groups:
            forward_end = g.start_ns + int(g.forward_s * 1e9)
            tree_end = forward_end + int(g.tree_build_s * 1e9)
            for i in g.indices:
                if not contexts[i]:
                    continue
                parent = telemetry.extract_map(contexts[i])
                attrs = {"request.id": batch.entries[i].request_id, "drafter": g.kind,
                         "batch.entries": len(batch.entries), "batch.step_id": batch.step_id}
                if g.kind == DFLASH:
                    self._span("draft.forward", parent, attrs, g.start_ns, forward_end)
                    self._span("ddtree.build", parent, attrs, forward_end, tree_end,
                               results[i])
                else:
                    self._span(f"{g.kind}.draft", parent, attrs, g.start_ns, tree_end,
                               results[i])

    def _span(self, name, parent, attrs, start_ns: int, end_ns: int,
              result: Result | None = None) -> None:
        span = self._tracer.start_span(name, parent, attributes=attrs, start_time=start_ns)
        if isinstance(result, str):
            span.set_status(Status(StatusCode.ERROR, result))
        elif result is not None:
            span.set_attribute("tree_size", result.n)
        span.end(end_time=max(start_ns, end_ns))

    def _metrics(self, results: Sequence[Result], times: DraftTimes, batch_s: float) -> None:
        m = self.metrics
        m.batches.inc()
        m.batch_seconds.observe(batch_s)
        drafted = set()
        for g in times.groups:
            if g.forward_s:
                m.phase.labels(phase="forward").observe(g.forward_s)
            m.phase.labels(phase="tree_build").observe(g.tree_build_s)
            for i in g.indices:
                drafted.add(i)
                ok = "error" if isinstance(results[i], str) else "ok"
                m.entries.labels(drafter=g.kind, result=ok).inc()
        for i, result in enumerate(results):
            if i not in drafted:  # rejected before drafting, or drafter "none"
                ok = "error" if isinstance(result, str) else "ok"
                m.entries.labels(drafter="none", result=ok).inc()
