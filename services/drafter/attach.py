"""Same-host attachments on the drafter: the verifiers' context rings and their lanes.

Owns `Attach` (map the ring a verifier offers and check its nonce, hand out a lane token) and
the lane side of drafting: each lane connection's thread decodes DraftBatch / ReleaseRequest
frames, runs them through the same `BatchRunner` as the gRPC stream, answers with TreeBatch
frames, and releases every request it drafted for when the lane closes (as a Draft stream
does). Rings whose verifier has exited (their shared file is gone) are dropped at the next
attach, and at most `MAX_RINGS` are kept, the least recently used dropped first; the newest
`MAX_TOKENS` lane tokens are kept.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable

from services.common import lane
from services.common.ring import map_ring
from services.drafter import convert
from services.drafter.core import DrafterCore
from services.drafter.steps import BatchRunner

log = logging.getLogger(__name__)
MAX_RINGS = 8
MAX_TOKENS = 64


class Attachments:
    """`core()` gives the loaded DrafterCore; `lane_path` None: no lane (rings only)."""

    def __init__(self, runner: BatchRunner, core: Callable[[], DrafterCore | None],
                 lane_path: str | None) -> None:
        self.runner, self._core, self.lane_path = runner, core, lane_path
        self.max_message_bytes = 0  # what the drafter's server takes (0: unknown)
        self._tokens: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._server: lane.LaneServer | None = None

    def attach(self, request) -> object:
        """An AttachRequest → AttachReply (blocking: maps device memory)."""
        spec, attached, error = convert.ring_of(request), False, None
        if spec is not None:
            try:
                info = convert.ring_from_pb(spec)
                view = map_ring(info)
            except ValueError as e:
                error = str(e)
                log.warning("context ring not attached (rows go on the wire): %s", e)
            else:
                attached = True
                self._keep(info, view)
        return convert.attach_reply_to_pb(attached, error, *self._lane(), self.max_message_bytes)

    def _keep(self, info, view) -> None:
        """Hold a ring (a verifier whose ring is dropped while it lives is told so by its next
        entry and attaches again)."""
        with self._lock:  # attaches run on gRPC's threads
            gone = self.runner.rings.hold(info.generation, view, info.shm_path, MAX_RINGS)
        for gen in gone:
            log.info("context ring %d dropped", gen)

    def _lane(self) -> tuple[str | None, bytes]:
        if self.lane_path is None:
            return None, b""
        with self._lock:
            if self._server is None:
                try:
                    self._server = lane.LaneServer(self.lane_path, self._connect)
                except OSError as e:
                    log.warning("no lane at %s (steps stay on gRPC): %s", self.lane_path, e)
                    self.lane_path = None
                    return None, b""
            token = secrets.token_bytes(16)
            self._tokens[token] = None
            while len(self._tokens) > MAX_TOKENS:
                self._tokens.popitem(last=False)
        return self.lane_path, token

    def _connect(self, token: bytes):
        with self._lock:
            known = self._tokens.pop(token, False) is None
        core = self._core()
        if not known or core is None:
            return None
        drafted: set[str] = set()
        owner = object()  # this lane: its requests are its own

        def handle(kind: int, payload: bytes):
            if kind == lane.BATCH:
                batch = convert.read_batch_bytes(payload)
                drafted.update(batch.request_ids)
                reply, record = self.runner.reply(core, batch, owner)
                return lane.TREES, convert.tree_batch_bytes(reply), record
            if kind == lane.RELEASE:
                ids = convert.release_from_bytes(payload)
                core.release(ids, owner)
                drafted.difference_update(ids)
                self.runner.observe_cache(core)
                return None
            raise lane.LaneClosed(f"unexpected lane frame kind {kind}")

        def closed():
            if drafted:
                core.release(sorted(drafted), owner)
                self.runner.observe_cache(core)

        return handle, closed

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
