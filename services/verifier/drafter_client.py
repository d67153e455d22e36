"""The verifier's drafter client: a `Drafter` whose `draft` is one round trip to the drafter
service per step, on the same-host lane or the gRPC stream (drafter_link.py).

Owns what the verifier knows about the drafter's copy of each request, and where its context
rows go:
- on one host, after `Attach`, new rows are written into the shared context ring and the entry
  names them (generation, offset, rows): they never cross protobuf;
- otherwise they go in the entry, fc-projected when the verifier has the drafter's projection
  (`projection`: hidden per token instead of taps × hidden), raw taps if not.
A request whose rows are kept on the host (`keep_context` "on"; "auto": when they go on the
wire, where the host copy is made anyway — fc-projected when it can be, 1/taps of the bytes)
survives a reconnect (a new drafter process has no state), a timeout or an entry error: it is
released on the drafter and resent in full from position 0 — the DFlash drafter needs its
context contiguous from 0. A request not kept (the ring's default: its rows never leave the
GPU) goes on with the n-gram drafter after such a loss (its history resent from 0: it needs
no rows); new requests speculate with DFlash.

Failure is never the request's: a missing stream, a deadline or a broken stream raises (the
engine verifies root-only trees and records why); a per-entry error yields an empty tree and is
reported through `take_entry_errors`. Reconnects run in the background, at most one attempt per
`reconnect_s`, so steps never wait for one.

During prefill, `feed` sends each chunk's context rows at once (budget-0 entries whose reply is
not waited for), so the drafter builds its context while the target prefills the next chunk.

With a `tracing` StepTracer set, each entry of a traced step carries the W3C context of its
request's `draft` span (`DraftEntry.trace_context`), so the drafter's spans nest under it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from services.common import lane
from services.common.ring import RING_UNKNOWN, ContextRing
from services.common.security import NONE, Security
from services.verifier import convert
from services.verifier.drafter_entries import DraftEntries
from services.verifier.drafter_link import GrpcLink, LaneLink
from services.verifier.drafter_stream import DrafterStream, DrafterTimeout, DrafterUnavailable
from specserve.drafters.base import Drafter, DraftRequest
from specserve.drafters.registry import NGRAM
from specserve.spec.tree import DraftTree

log = logging.getLogger(__name__)
# events on each traced request's `draft` span (wall clock): the call began, its batch was built,
# written, the reply was in, taken by the engine thread, and its trees converted —
# bench/trace_breakdown.py splits a step's drafter round trip by them
DRAFT_EVENTS = ("drafter.call", "batch.built", "batch.written", "reply.received",
                "reply.taken", "trees.ready")
__all__ = ["DRAFT_EVENTS", "DrafterTimeout", "DrafterUnavailable", "RemoteDrafter"]


class RemoteDrafter(Drafter):
    """`Drafter` over the drafter service at `address`; `start()` it on the asyncio loop.

    `ring`: the same-host context ring (None: rows on the wire); `projection`: the drafter's
    `hidden_norm(fc(·))` (models/dflash.ContextProjection) for rows that cross the wire and for
    the kept copies; `same_host=False` takes neither ring nor lane (the cross-host path);
    `security`: TLS to the drafter and the token sent to it."""

    asynchronous = True  # submit() sends now and waits later

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self._taps

    def __init__(self, address: str, target_layer_ids: Sequence[int] = (),
                 timeout_s: float = 2.0, reconnect_s: float = 0.5, *,
                 ring: ContextRing | None = None, projection=None, keep_context: str = "auto",
                 same_host: bool = True, security: Security = NONE) -> None:
        if not address:
            raise ValueError("drafter address is empty")
        if timeout_s <= 0 or reconnect_s <= 0:
            raise ValueError(f"timeout_s and reconnect_s must be positive, got "
                             f"{timeout_s}, {reconnect_s}")
        self.address, self.timeout_s = address, timeout_s
        self._taps = tuple(int(t) for t in target_layer_ids)
        self.needs_context = bool(self._taps)  # else only n-gram drafting works
        self.ring = ring
        self.entries = DraftEntries(self.needs_context, projection, keep_context, timeout_s)
        self.stream = DrafterStream(address, timeout_s, reconnect_s,
                                    ring=ring.info if ring is not None else None,
                                    same_host=same_host, security=security)
        self._grpc = GrpcLink(self.stream, timeout_s)
        self._lane: LaneLink | None = None
        self._lane_tried = 0  # the epoch whose lane was last tried
        self._ring_reattached = 0  # the epoch that last attached again for a lost ring
        self._step_ids = itertools.count(1)
        # seconds: building a step's batch, waiting for its reply, the drafter's own forward +
        # tree build (from the reply), turning the reply into trees
        self.profile: Counter = Counter()

    @property
    def tracing(self):
        """A StepTracer: each entry of a traced step carries its request's `draft` span."""
        return self.entries.tracing

    @tracing.setter
    def tracing(self, tracer) -> None:
        self.entries.tracing = tracer

    @property
    def context_rows(self) -> Counter:
        return self.entries.context_rows

    @property
    def connected(self) -> bool:
        return self.stream.connected

    @property
    def transport(self) -> str:
        """How the last steps reached the drafter: "lane" or "grpc", + "+ring" when context
        rows went by the ring."""
        lane_, link = self._lane, self._grpc
        if lane_ is not None and not lane_.broken and lane_.epoch == self.stream.epoch:
            link = lane_
        return link.kind + ("+ring" if link.ring is not None else "")

    async def start(self) -> None:
        """Bind to the running loop and try to connect once (failure: retried in background)."""
        await self.stream.start()

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        await self.stream.close()
        if self.ring is not None:
            self.ring.close()

    # ---- engine thread -----------------------------------------------------------------------
    def take_entry_errors(self) -> dict[str, str]:
        """request id → why its last draft was empty (a per-entry drafter error); then cleared."""
        errors, self.entries.errors = self.entries.errors, {}
        return errors

    def _link(self) -> GrpcLink | LaneLink:
        """The lane of the current epoch if it opens, else the stream (ring per attachment)."""
        stream, epoch = self.stream, self.stream.epoch
        if self._lane is not None and (self._lane.broken or self._lane.epoch != epoch):
            if self._lane.broken and self._lane.epoch == epoch:
                stream.loop.call_soon_threadsafe(stream.restart, "was restarted: its lane broke")
            self._lane.close()
            self._lane = None
        att = stream.attachment if stream.connected else None
        if att is not None and att.epoch == epoch:
            self.entries.max_inline_bytes = att.max_message_bytes
        ring = self.ring if att is not None and att.epoch == epoch and att.ring_attached else None
        if self._lane is None and att is not None and att.epoch == epoch and att.lane_path \
                and self._lane_tried != epoch:
            self._lane_tried = epoch
            try:
                client = lane.LaneClient(att.lane_path, att.lane_token, self.timeout_s)
                self._lane = LaneLink(client, epoch, ring, self.timeout_s)
            except lane.LaneClosed as e:
                log.warning("%s; steps go on the gRPC stream", e)
        if self._lane is not None:
            return self._lane
        self._grpc.ring, self._grpc.epoch = ring, epoch
        return self._grpc

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return self.submit(requests)()

    def submit(self, requests: Sequence[DraftRequest], ahead: bool = False
               ) -> Callable[[], list[DraftTree]]:
        """Send the step's batch now; the returned call waits for its trees (engine/overlap.py
        works on meanwhile: the last step's commit when `ahead`, another group's verify).
        Raises (and so does the call) as `draft` does."""
        stream = self.stream
        if stream.loop is None or stream.closed:
            raise DrafterUnavailable("the drafter client is not running")
        called_ns = time.time_ns()
        link, epoch, step_id = self._link(), stream.epoch, next(self._step_ids)
        batch, marks, release = convert.draft_batch(step_id), {}, []
        new = self.entries.absorb_all(requests, link)
        for req in requests:
            st = self.entries.states[req.request_id]
            if self.entries.entry(req, st, epoch, release, batch, link, new.get(req.request_id),
                                  ahead_ns=called_ns if ahead else None):
                marks[req.request_id] = (st.num_rows, len(req.history or ()))
        if link.ring is not None:
            link.ring.publish()
        stamps = [called_ns, time.time_ns()]  # + written, reply in, then taken
        try:
            started = link.start(step_id, epoch, batch, release, stamps)
        except BaseException:
            self._resend(requests)
            raise
        return lambda: self._collect(requests, link, started, marks, stamps)

    def _collect(self, requests, link, started, marks, stamps) -> list[DraftTree]:
        try:
            reply = link.wait(started, stamps)
            stamps.append(time.time_ns())
        except BaseException:
            self._resend(requests)
            raise
        trees = self.entries.trees(requests, reply, marks)
        if self.entries.errors:
            self._check_ring(self.entries.errors.values())
        self.profile.update(draft_build=(stamps[2] - stamps[0]) * 1e-9,
                            draft_wait=(stamps[3] - stamps[2]) * 1e-9,
                            drafter_work=reply.forward_s + reply.tree_build_s,
                            draft_trees=(time.time_ns() - stamps[4]) * 1e-9)
        if self.tracing and len(stamps) == len(DRAFT_EVENTS) - 1:  # the last one is now
            self.tracing.note_draft([r.request_id for r in requests],
                                    list(zip(DRAFT_EVENTS, [*stamps, time.time_ns()],
                                             strict=True)))
        return trees

    def _resend(self, requests) -> None:
        for req in requests:  # the drafter may or may not have applied the batch
            st = self.entries.states.get(req.request_id)
            if st is not None:
                st.resend = True

    def feed(self, requests: Sequence[DraftRequest]) -> bool:
        """Send prefill context rows now, as budget-0 entries whose reply is not waited for: the
        drafter builds its context cache while the target prefills, and the first draft carries
        no prompt rows. A feed that fails marks its requests for a full resend (the rows are
        taken either way)."""
        self._feed(requests)
        return True

    def _feed(self, requests: Sequence[DraftRequest]) -> None:
        rows = [r for r in requests if r.context is not None and r.context.shape[0]]
        if not rows:
            return
        stream = self.stream
        if stream.loop is None or stream.closed or not stream.connected:
            self.entries.absorb_all(rows, None)  # kept for the first draft, which resends in full
            for req in rows:
                self.entries.states[req.request_id].resend = True
            return
        link, epoch, step_id = self._link(), stream.epoch, next(self._step_ids)
        batch, release = convert.draft_batch(step_id), []
        new = self.entries.absorb_all(rows, link)
        for req in rows:
            st = self.entries.states[req.request_id]
            if st.kind == NGRAM or not self.entries.entry(req, st, epoch, release, batch, link,
                                                            new.get(req.request_id),
                                                            traced=False):
                continue
            st.rows_sent = st.num_rows  # optimistic: a failure sets resend (see _feed_done)
        if not batch.entries:
            return
        if link.ring is not None:
            link.ring.publish()
        ids = [e.request_id for e in batch.entries]
        link.feed(step_id, epoch, batch, release, ids,
                  lambda failed: self._feed_done(ids, failed))

    def _feed_done(self, ids: list[str], failed: dict[str, str] | None) -> None:
        self.entries.feed_failed.update(ids if failed is None else failed)
        if failed:
            self._check_ring(failed.values())

    def _check_ring(self, errors) -> None:
        """The drafter no longer holds our context ring (it dropped it, or it is a new drafter
        process behind the same stream): attach again, once per stream epoch. Requests whose
        rows only the ring had decode plainly; new ones speculate again."""
        stream = self.stream
        if self._ring_reattached == stream.epoch or stream.loop is None or \
                not any(RING_UNKNOWN in e for e in errors):
            return
        self._ring_reattached = stream.epoch
        log.warning("the drafter does not hold our context ring: attaching again")
        with contextlib.suppress(RuntimeError):  # the loop is closed
            stream.loop.call_soon_threadsafe(stream.restart, "lost our context ring")

    def release(self, request_id: str) -> None:
        """Forget the request here and (fire-and-forget) on the drafter."""
        st, stream = self.entries.states.pop(request_id, None), self.stream
        self.entries.feed_failed.discard(request_id)
        if st is None or not st.sent_once or stream.loop is None or stream.closed:
            return
        link = self._lane if self._lane is not None and not self._lane.broken else self._grpc
        with contextlib.suppress(RuntimeError):  # the loop is closed
            link.release(request_id)
