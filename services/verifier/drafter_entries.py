"""The verifier's side of each request's drafter state, and the entries a step sends.

Owns `DraftEntries`: per request what the verifier knows of the drafter's copy
(context_rows.RequestRows), the entry errors of the last step, the requests whose feed failed,
and how a request's new context rows go out — named in the shared ring when the link has one
(and room), else inline, fc-projected when there is a projection (what crosses hosts), raw
taps if not — with the host copies kept for a resend (`keep_context`). The drafter client
(drafter_client.py) owns the links and the calls; this module, what goes in them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import torch

from services.verifier import convert
from services.verifier.context_rows import New, RequestRows, project
from specserve.drafters.base import DraftRequest
from specserve.drafters.registry import NGRAM
from specserve.spec.tree import DraftTree

log = logging.getLogger(__name__)
CONTEXT_LOST = "drafter_context_lost"
KEEP = ("auto", "on", "off")


class DraftEntries:
    """Engine thread only. `room_s`: how long to wait for the ring to free a segment."""

    def __init__(self, needs_context: bool, projection=None, keep_context: str = "auto",
                 room_s: float = 2.0) -> None:
        if keep_context not in KEEP:
            raise ValueError(f"keep_context must be one of {KEEP}, got {keep_context!r}")
        self.needs_context, self.projection = needs_context, projection
        self.keep_context, self.room_s = keep_context, room_s
        self.states: dict[str, RequestRows] = {}
        self.errors: dict[str, str] = {}  # request id → why its last draft was empty
        self.feed_failed: set[str] = set()  # requests whose feed failed: resend in full
        self.context_rows: Counter = Counter()  # rows sent, by path (ring / inline_*)
        self.tracing = None  # a StepTracer (set by the client)
        self.max_inline_bytes = 0  # the drafter's message bound (0: unknown, not checked)

    def absorb_all(self, requests: Sequence[DraftRequest], link) -> dict[str, New]:
        """Take each request's rows not seen before (a gap: an entry error); keep them on the
        host if asked; fc-project them once for all requests where the wire or the kept copy
        wants it (the drafter's own grouping: its fc runs over the same rows)."""
        new: dict[str, torch.Tensor] = {}
        for req in requests:
            st = self.states.get(req.request_id)
            if st is None:  # its first entry names its drafter for good
                st = self.states[req.request_id] = RequestRows(req.kind)
            ctx = req.context
            if ctx is None or not self.needs_context or st.kind == NGRAM or not ctx.shape[0]:
                continue
            first = req.start - ctx.shape[0]  # the rows cover positions [first, start)
            if first > st.num_rows:
                self.errors[req.request_id] = "drafter_entry_error: context gap"
                continue
            rows = ctx[st.num_rows - first:].detach()
            if rows.shape[0]:
                new[req.request_id] = rows
                st.num_rows += rows.shape[0]
        if not new:
            return {}
        on_wire = link is None or link.ring is None
        for rid in new:
            st = self.states[rid]
            if st.keep is None:  # decided once: a request's rows are all kept, or none
                st.keep = self.keep_context == "on" or (self.keep_context == "auto" and on_wire)
        kept = [rid for rid in new if self.states[rid].keep]
        wanted = self.projection is not None and (bool(kept) or on_wire)
        fused = dict(zip(new, project(self.projection, list(new.values())), strict=True)) \
            if wanted else {}
        host = {}
        if kept:  # one copy to the host for all of them, split (the wire sends these)
            rows = [fused.get(rid, new[rid]) for rid in kept]
            both = (rows[0] if len(rows) == 1 else torch.cat(rows)).cpu()
            host = dict(zip(kept, both.split([r.shape[0] for r in rows]), strict=True))
            for rid in kept:
                self.states[rid].keep_rows(host[rid])
        return {rid: New(rows, fused.get(rid), host.get(rid)) for rid, rows in new.items()}

    def entry(self, req: DraftRequest, st: RequestRows, epoch: int, release: list[str], batch,
               link, new: New | None, traced: bool = True, ahead_ns: int | None = None
               ) -> bool:
        """Append the request's DraftEntry to `batch`; False (with an entry error, nothing
        appended) if it cannot be drafted. `ahead_ns`: when a draft for the next step was
        asked for (traces: StepTracer.open_draft)."""
        held_before = st.num_rows - (new.raw.shape[0] if new is not None else 0)
        if not self._draftable(req.request_id, st, epoch, release, held_before):
            return False
        rows, fused, ref = None, False, None
        if st.kind == NGRAM:
            pass  # no rows: the n-gram drafter reads the tokens only
        elif st.rows_sent < held_before:  # a resend: every kept row, on the wire
            rows, fused = st.rows_since(st.rows_sent), self.projection is not None
        elif new is not None:  # in the ring when it has room, else inline
            ref = self._ring_segment(new, link, batch.step_id)
            if ref is None:
                rows = next(r for r in (new.host, new.fused, new.raw) if r is not None)
                fused = new.fused is not None
        if not self._fits(batch, rows):
            st.lost = True
            self.errors[req.request_id] = (f"{CONTEXT_LOST}: its rows are more than the "
                                           "drafter takes in one message (--max-message-mb)")
            return False
        st.sent_once = True
        history = list(req.history[st.history_sent:]) if req.history is not None else []
        trace_context = (self.tracing.open_draft(req.request_id, ahead_ns)
                         if self.tracing and traced else None)
        entry = convert.add_draft_entry(batch, req, st.kind, rows, history, trace_context,
                                        fused=fused)
        if ref is not None:
            convert.set_context_ref(entry, link.ring.generation, *ref)
            self.context_rows["ring"] += ref[1]
        self._count(rows, fused)
        return True

    def _draftable(self, rid: str, st: RequestRows, epoch: int, release: list[str],
                   held_before: int) -> bool:
        """Bring `st` to the drafter's current copy (a new connection or a failed feed: release
        it and send everything again). A request whose rows are lost goes on with the n-gram
        drafter, which needs only its tokens: released there and its history sent from 0."""
        if rid in self.errors:  # a context gap, found by _absorb_all
            return False
        if rid in self.feed_failed:
            self.feed_failed.discard(rid)
            st.resend = True
        if st.resend or st.epoch != epoch:
            if st.sent_once:
                release.append(rid)
            st.rows_sent = st.history_sent = 0
            st.epoch, st.resend = epoch, False
        if st.rows_sent < held_before and not st.keep:
            st.lost = True  # the drafter lost rows nobody kept
        if st.lost and st.kind != NGRAM:
            if st.sent_once and rid not in release:
                release.append(rid)
            st.kind, st.rows_sent, st.history_sent = NGRAM, 0, 0
            log.info("request %r: its context rows are lost; it is drafted by n-gram now", rid)
        return True

    def _ring_segment(self, new: New, link, step_id: int) -> tuple[int, int] | None:
        """(first row, rows) of the new rows written into the link's ring, or None (no ring, or
        no room in it within `room_s`)."""
        ring, n = link.ring, new.raw.shape[0]
        if ring is None:
            return None
        start = ring.alloc(n, step_id)
        while start is None and link.make_room(self.room_s):
            start = ring.alloc(n, step_id)
        if start is None:
            return None
        ring.write(start, new.raw)
        return start, n

    def _fits(self, message, rows: torch.Tensor | None) -> bool:
        if not self.max_inline_bytes or rows is None:
            return True
        nbytes = rows.numel() * rows.element_size()
        return message.ByteSize() + nbytes + (64 << 10) <= self.max_inline_bytes

    def _count(self, rows: torch.Tensor | None, fused: bool) -> None:
        if rows is not None:
            self.context_rows["inline_fused" if fused else "inline_raw"] += rows.shape[0]

    def trees(self, requests, reply, marks) -> list[DraftTree]:
        got = convert.trees_from_pb(reply)
        trees = []
        for req in requests:
            rid, st = req.request_id, self.states.get(req.request_id)
            if st is None:  # released while its draft was in flight
                trees.append(DraftTree.empty())
                continue
            tree = got.get(rid, "no tree in the drafter's reply") if rid in marks else None
            if isinstance(tree, DraftTree):
                st.rows_sent, st.history_sent = marks[rid]
                trees.append(tree)
                continue
            if tree is not None:
                self.errors[rid] = f"drafter_entry_error: {tree}"
            st.resend = True
            trees.append(DraftTree.empty())
        return trees

