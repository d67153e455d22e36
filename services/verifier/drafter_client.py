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
GPU) drafts no more after such a loss (`drafter_context_lost`); new requests speculate.

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
from collections.abc import Sequence

import torch

from services.common import lane
from services.common.ring import ContextRing
from services.verifier import convert
from services.verifier.context_rows import New, RequestRows, project
from services.verifier.drafter_link import GrpcLink, LaneLink
from services.verifier.drafter_stream import DrafterStream, DrafterTimeout, DrafterUnavailable
from specserve.drafters.base import DraftRequest
from specserve.spec.tree import DraftTree

log = logging.getLogger(__name__)
# events on each traced request's `draft` span (wall clock): the call began, its batch was built,
# written, the reply was in, taken by the engine thread, and its trees converted —
# bench/trace_breakdown.py splits a step's drafter round trip by them
DRAFT_EVENTS = ("drafter.call", "batch.built", "batch.written", "reply.received",
                "reply.taken", "trees.ready")
CONTEXT_LOST = "drafter_context_lost"
KEEP = ("auto", "on", "off")
__all__ = ["DRAFT_EVENTS", "DrafterTimeout", "DrafterUnavailable", "RemoteDrafter"]


class RemoteDrafter:
    """`Drafter` over the drafter service at `address`; `start()` it on the asyncio loop.

    `ring`: the same-host context ring (None: rows on the wire); `projection`: the drafter's
    `hidden_norm(fc(·))` (models/dflash.ContextProjection) for rows that cross the wire and for
    the kept copies; `same_host=False` asks for no attachment (the cross-host path)."""

    def __init__(self, address: str, target_layer_ids: Sequence[int] = (),
                 timeout_s: float = 2.0, reconnect_s: float = 0.5, *,
                 ring: ContextRing | None = None, projection=None, keep_context: str = "auto",
                 same_host: bool = True) -> None:
        if not address:
            raise ValueError("drafter address is empty")
        if keep_context not in KEEP:
            raise ValueError(f"keep_context must be one of {KEEP}, got {keep_context!r}")
        if timeout_s <= 0 or reconnect_s <= 0:
            raise ValueError(f"timeout_s and reconnect_s must be positive, got "
                             f"{timeout_s}, {reconnect_s}")
        self.address, self.timeout_s = address, timeout_s
        self.target_layer_ids = tuple(int(t) for t in target_layer_ids)
        self.needs_context = bool(self.target_layer_ids)  # else only n-gram drafting works
        self.ring, self.projection, self.keep_context = ring, projection, keep_context
        self.stream = DrafterStream(address, timeout_s, reconnect_s,
                                    ring=ring.info if ring is not None else None,
                                    same_host=same_host)
        self._grpc = GrpcLink(self.stream, timeout_s)
        self._lane: LaneLink | None = None
        self._lane_tried = 0  # the epoch whose lane was last tried
        self._feed_failed: set[str] = set()  # requests whose feed failed: resend in full
        self._step_ids = itertools.count(1)
        self._states: dict[str, RequestRows] = {}
        self._entry_errors: dict[str, str] = {}
        self.context_rows: Counter = Counter()  # rows sent, by path (ring / inline_*)
        # seconds: building a step's batch, waiting for its reply, the drafter's own forward +
        # tree build (from the reply), turning the reply into trees
        self.profile: Counter = Counter()
        self.tracing = None  # a StepTracer: each entry carries its request's `draft` span

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
    def set_kind(self, request_id: str, kind: str | None) -> None:
        """Which drafter serves `request_id` (before its first draft)."""
        self._states[request_id] = RequestRows(kind)

    def take_entry_errors(self) -> dict[str, str]:
        """request id → why its last draft was empty (a per-entry drafter error); then cleared."""
        errors, self._entry_errors = self._entry_errors, {}
        return errors

    def _link(self) -> GrpcLink | LaneLink:
        """The lane of the current epoch if it opens, else the stream (ring per attachment)."""
        stream, epoch = self.stream, self.stream.epoch
        if self._lane is not None and (self._lane.broken or self._lane.epoch != epoch):
            if self._lane.broken and self._lane.epoch == epoch:
                stream.loop.call_soon_threadsafe(stream.restart, "its lane broke")
            self._lane.close()
            self._lane = None
        att = stream.attachment if stream.connected else None
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
        stream = self.stream
        if stream.loop is None or stream.closed:
            raise DrafterUnavailable("the drafter client is not running")
        called_ns = time.time_ns()
        link, epoch, step_id = self._link(), stream.epoch, next(self._step_ids)
        batch, marks, release = convert.draft_batch(step_id), {}, []
        new = self._absorb_all(requests, link)
        for req in requests:
            st = self._states[req.request_id]
            if self._entry(req, st, epoch, release, batch, link, new.get(req.request_id)):
                marks[req.request_id] = (st.num_rows, len(req.history or ()))
        if link.ring is not None:
            link.ring.publish()
        stamps = [called_ns, time.time_ns()]  # + written, reply in, then taken
        try:
            reply = link.exchange(step_id, epoch, batch, release, stamps)
            stamps.append(time.time_ns())
        except BaseException:
            for req in requests:  # the drafter may or may not have applied the batch
                self._states[req.request_id].resend = True
            raise
        trees = self._trees(requests, reply, marks)
        self.profile.update(draft_build=(stamps[2] - stamps[0]) * 1e-9,
                            draft_wait=(stamps[3] - stamps[2]) * 1e-9,
                            drafter_work=reply.forward_s + reply.tree_build_s,
                            draft_trees=(time.time_ns() - stamps[4]) * 1e-9)
        if self.tracing and len(stamps) == len(DRAFT_EVENTS) - 1:  # the last one is now
            self.tracing.note_draft([r.request_id for r in requests],
                                    list(zip(DRAFT_EVENTS, [*stamps, time.time_ns()],
                                             strict=True)))
        return trees

    def feed(self, requests: Sequence[DraftRequest]) -> None:
        """Send prefill context rows now, as budget-0 entries whose reply is not waited for: the
        drafter builds its context cache while the target prefills, and the first draft carries
        no prompt rows. A feed that fails marks its requests for a full resend."""
        rows = [r for r in requests if r.context is not None and r.context.shape[0]]
        if not rows:
            return
        stream = self.stream
        if stream.loop is None or stream.closed or not stream.connected:
            self._absorb_all(rows, None)  # kept for the first draft, which resends in full
            for req in rows:
                self._states[req.request_id].resend = True
            return
        link, epoch, step_id = self._link(), stream.epoch, next(self._step_ids)
        batch, release = convert.draft_batch(step_id), []
        new = self._absorb_all(rows, link)
        for req in rows:
            st = self._states[req.request_id]
            if st.kind == "ngram" or not self._entry(req, st, epoch, release, batch, link,
                                                     new.get(req.request_id), traced=False):
                continue
            st.rows_sent = st.num_rows  # optimistic: a failure sets resend (see _feed_done)
        if not batch.entries:
            return
        if link.ring is not None:
            link.ring.publish()
        ids = [e.request_id for e in batch.entries]
        link.feed(step_id, epoch, batch, release, ids,
                  lambda failed: self._feed_failed.update(ids if failed is None else failed))

    # ---- entries -----------------------------------------------------------------------------
    def _absorb_all(self, requests: Sequence[DraftRequest], link) -> dict[str, New]:
        """Take each request's rows not seen before (a gap: an entry error); keep them on the
        host if asked; fc-project them once for all requests where the wire or the kept copy
        wants it (the drafter's own grouping: its fc runs over the same rows)."""
        new: dict[str, torch.Tensor] = {}
        for req in requests:
            st = self._states.setdefault(req.request_id, RequestRows(None))
            ctx = req.context
            if ctx is None or not self.needs_context or st.kind == "ngram" or not ctx.shape[0]:
                continue
            first = req.start - ctx.shape[0]  # the rows cover positions [first, start)
            if first > st.num_rows:
                self._entry_errors[req.request_id] = "drafter_entry_error: context gap"
                continue
            rows = ctx[st.num_rows - first:].detach()
            if rows.shape[0]:
                new[req.request_id] = rows
                st.num_rows += rows.shape[0]
        if not new:
            return {}
        on_wire = link is None or link.ring is None
        for rid in new:
            st = self._states[rid]
            if st.keep is None:  # decided once: a request's rows are all kept, or none
                st.keep = self.keep_context == "on" or (self.keep_context == "auto" and on_wire)
        kept = [rid for rid in new if self._states[rid].keep]
        wanted = self.projection is not None and (bool(kept) or on_wire)
        fused = dict(zip(new, project(self.projection, list(new.values())), strict=True)) \
            if wanted else {}
        host = {}
        if kept:  # one copy to the host for all of them, split (the wire sends these)
            rows = [fused.get(rid, new[rid]) for rid in kept]
            both = (rows[0] if len(rows) == 1 else torch.cat(rows)).cpu()
            host = dict(zip(kept, both.split([r.shape[0] for r in rows]), strict=True))
            for rid in kept:
                self._states[rid].keep_rows(host[rid])
        return {rid: New(rows, fused.get(rid), host.get(rid)) for rid, rows in new.items()}

    def _entry(self, req: DraftRequest, st: RequestRows, epoch: int, release: list[str], batch,
               link, new: New | None, traced: bool = True) -> bool:
        """Append the request's DraftEntry to `batch`; False (with an entry error, nothing
        appended) if it cannot be drafted."""
        if req.request_id in self._entry_errors:  # a context gap, found by _absorb_all
            return False
        if req.request_id in self._feed_failed:
            self._feed_failed.discard(req.request_id)
            st.resend = True
        if st.resend or st.epoch != epoch:
            if st.sent_once:
                release.append(req.request_id)
            st.rows_sent = st.history_sent = 0
            st.epoch, st.resend = epoch, False
        held_before = st.num_rows - (new.raw.shape[0] if new is not None else 0)
        if st.rows_sent < held_before and not st.keep:
            st.lost = True  # the drafter lost rows nobody kept
        if st.lost and st.kind != "ngram":
            self._entry_errors[req.request_id] = f"{CONTEXT_LOST}: its rows were not kept"
            return False
        st.sent_once = True
        history = list(req.history[st.history_sent:]) if req.history is not None else []
        trace_context = (self.tracing.open_draft(req.request_id)
                         if self.tracing and traced else None)
        if st.rows_sent < held_before:  # a resend: every kept row, on the wire
            rows = st.rows_since(st.rows_sent)
            fused = self.projection is not None
            entry = convert.add_draft_entry(batch, req, st.kind, rows, history, trace_context,
                                            fused=fused)
            self._count(rows, fused)
        else:
            entry = convert.add_draft_entry(batch, req, st.kind, None, history, trace_context)
            if new is not None:
                self._put_rows(entry, new, link, batch.step_id)
        return True

    def _put_rows(self, entry, new: New, link, step_id: int) -> None:
        """The new rows into the ring (named by the entry) when it has room, else inline."""
        ring, n = link.ring, new.raw.shape[0]
        if ring is not None:
            start = ring.alloc(n, step_id)
            while start is None and link.make_room(self.timeout_s):
                start = ring.alloc(n, step_id)
            if start is not None:
                ring.write(start, new.raw)
                convert.set_context_ref(entry, ring.generation, start, n)
                self.context_rows["ring"] += n
                return
        rows = next(r for r in (new.host, new.fused, new.raw) if r is not None)
        convert.fill_context(entry, rows, fused=new.fused is not None)
        self._count(rows, new.fused is not None)

    def _count(self, rows: torch.Tensor | None, fused: bool) -> None:
        if rows is not None:
            self.context_rows["inline_fused" if fused else "inline_raw"] += rows.shape[0]

    def _trees(self, requests, reply, marks) -> list[DraftTree]:
        got = convert.trees_from_pb(reply)
        trees = []
        for req in requests:
            rid, st = req.request_id, self._states[req.request_id]
            tree = got.get(rid, "no tree in the drafter's reply") if rid in marks else None
            if isinstance(tree, DraftTree):
                st.rows_sent, st.history_sent = marks[rid]
                trees.append(tree)
                continue
            if tree is not None:
                self._entry_errors[rid] = f"drafter_entry_error: {tree}"
            st.resend = True
            trees.append(DraftTree.empty())
        return trees

    def release(self, request_id: str) -> None:
        """Forget the request here and (fire-and-forget) on the drafter."""
        st, stream = self._states.pop(request_id, None), self.stream
        self._feed_failed.discard(request_id)
        if st is None or not st.sent_once or stream.loop is None or stream.closed:
            return
        link = self._lane if self._lane is not None and not self._lane.broken else self._grpc
        with contextlib.suppress(RuntimeError):  # the loop is closed
            link.release(request_id)
