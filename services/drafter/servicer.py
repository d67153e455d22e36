"""The Drafter gRPC servicer: thin — convert, call the core in a worker thread, convert back
(every protobuf field is read in convert.py: a DraftBatch arrives as a `convert.Batch`).

Owns the stream lifecycle: each `Draft` stream owns the requests it drafted for (another
connection cannot draft or release them), releases the ones a batch names (`release`) before
its entries, and releases all of them when it ends for any reason (the verifier finished,
disconnected or cancelled), so a dropped verifier never leaks drafter cache. Model work always
runs in a worker thread (`asyncio.to_thread`); the event loop only moves messages. Errors go
through the one status table (services/common/errors.py): a bad entry or batch gets error
strings and the stream goes on; anything unexpected is logged with its request ids and ends
the stream with that status.

A batch's decoding, drafting, spans and metrics are `steps.BatchRunner`'s, shared with the
same-host lane; `Attach` (a verifier on this host offering its context ring) is
`attach.Attachments`'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.common.errors import status_for
from services.drafter import convert
from services.drafter.attach import Attachments
from services.drafter.core import DrafterCore
from services.drafter.steps import BatchRunner, error_text
from specserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)
__all__ = ["DrafterServicer", "error_text"]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """`core` may be set after the server starts (models still loading: UNAVAILABLE)."""

    def __init__(self, core: DrafterCore | None = None, metrics=None,
                 lane_path: str | None = None) -> None:
        self.core = core
        self.runner = BatchRunner(metrics)
        self.attachments = Attachments(self.runner, lambda: self.core, lane_path)

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[drafter_pb2.TreeBatch]:
        core = await self._ready(context)
        owner = object()  # this stream: its requests are its own
        drafted: set[str] = set()
        try:
            async for msg in request_iterator:
                batch = convert.read_batch(msg)
                if batch.release:
                    await asyncio.to_thread(core.release, list(batch.release), owner)
                    drafted.difference_update(batch.release)
                    self.runner.observe_cache(core)
                drafted.update(batch.request_ids)
                reply, record = await self._draft_batch(core, batch, owner, context)
                yield reply
                if record is not None:  # spans and metrics once the reply is on its way
                    record()
        finally:
            if drafted:  # shielded: the release must finish even if the handler is cancelled
                await asyncio.shield(asyncio.to_thread(core.release, sorted(drafted), owner))
                self.runner.observe_cache(core)

    async def Attach(
        self, request: drafter_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.AttachReply:
        await self._ready(context)
        return await asyncio.to_thread(self.attachments.attach, request)

    async def _ready(self, context: grpc.aio.ServicerContext) -> DrafterCore:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is loading its models")
        return self.core

    async def _draft_batch(self, core: DrafterCore, batch: convert.Batch, owner,
                           context: grpc.aio.ServicerContext):
        """(the reply, what records its spans and metrics or None)."""
        try:
            return await asyncio.to_thread(self.runner.reply, core, batch, owner)
        except Exception as e:
            log.exception("draft step %d failed for requests %s", batch.step_id,
                          list(batch.request_ids))
            await context.abort(status_for(e), f"draft step {batch.step_id} failed: {e}")
