"""The Drafter gRPC servicer: thin — convert, call the core in a worker thread, convert back.

Owns the stream lifecycle: each `Draft` stream remembers the requests it drafted for and
releases them when it ends for any reason (the verifier finished, disconnected or cancelled),
so a dropped verifier never leaks drafter cache. Model work always runs in a worker thread
(`asyncio.to_thread`); the event loop only moves messages. Errors go through the one status
table (services/common/errors.py): a bad entry or batch gets error strings and the stream goes
on; anything unexpected is logged with its request ids and ends the stream with that status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.common.errors import status_for
from services.drafter import convert
from services.drafter.core import DrafterCore, Entry
from specserve.errors import InvalidRequest, SpecServeError
from specserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


def error_text(error: BaseException) -> str:
    """An error string for a Tree: the status code name the table gives, then the message."""
    return f"{status_for(error).name}: {error}"


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """`core` may be set after the server starts (models still loading: UNAVAILABLE)."""

    def __init__(self, core: DrafterCore | None = None) -> None:
        self.core = core

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
            return await asyncio.to_thread(_draft_step, core, batch)
        except SpecServeError as e:
            return convert.error_batch_to_pb(batch, error_text(e))
        except Exception as e:
            log.exception("draft step %d failed for requests %s", batch.step_id,
                          convert.request_ids(batch))
            await context.abort(status_for(e), f"draft step {batch.step_id} failed: {e}")


def _draft_step(core: DrafterCore, batch: drafter_pb2.DraftBatch) -> drafter_pb2.TreeBatch:
    """Runs in a worker thread: decode the entries, draft, encode the trees."""
    device, dtype = core.context_device, core.context_dtype
    entries: list[Entry | str] = []
    for msg in batch.entries:
        try:
            entries.append(convert.entry_from_pb(msg, device, dtype))
        except InvalidRequest as e:
            entries.append(error_text(e))
    results, times = core.draft_timed(entries)
    return convert.tree_batch_to_pb(batch, results, times)
