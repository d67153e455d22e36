"""The verifier's drafter client: a `Drafter` whose `draft` is one round trip on ONE long-lived
bidi `Draft` stream to the drafter service.

Owns what the verifier knows about the drafter's copy of each request. The engine thread calls
`draft` synchronously; the stream itself (`drafter_stream.DrafterStream`) lives on the asyncio
loop, reached with `run_coroutine_threadsafe` and waited on with a deadline. Only NEW
context rows and history tokens go out per step, but every context row and the whole history are
kept here: after a reconnect (a new drafter process has no state), a timeout or an entry error,
the request is released on the drafter and resent in full from position 0 — the DFlash drafter
needs its context contiguous from 0. That costs host memory of context rows × taps × hidden per
request (the price of surviving a drafter restart without losing speculation).

Failure is never the request's: a missing stream, a deadline or a broken stream raises (the
engine verifies root-only trees and records why); a per-entry error yields an empty tree and is
reported through `take_entry_errors`. Reconnects run in the background, at most one attempt per
`reconnect_s`, so steps never wait for one.

During prefill, `feed` sends each chunk's context rows at once (budget-0 entries whose reply is
not waited for; a later release waits for feeds in flight), so the drafter builds its context
while the target prefills.

With a `tracing` StepTracer set, each entry of a traced step carries the W3C context of its
request's `draft` span (`DraftEntry.trace_context`), so the drafter's spans nest under it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.verifier import convert
from services.verifier.drafter_stream import DrafterStream, DrafterTimeout, DrafterUnavailable
from specserve.drafters.base import DraftRequest
from specserve.spec.tree import DraftTree

# context chunks kept per request before the newer half is merged into one tensor (merging them
# all would copy a long prompt's rows every MAX_CHUNKS decode steps: 5.4 GB at 128k for the
# Qwen3-8B shape's raw taps)
MAX_CHUNKS = 64
FEED_DEADLINE = 10  # a prefill feed's deadline, in draft deadlines (timeout_s)
# events on each traced request's `draft` span (wall clock): the call began, its batch was built,
# written on the stream (event loop), the reply was in (event loop), taken (engine thread), and
# its trees converted — bench/trace_breakdown.py splits a step's drafter round trip by them
DRAFT_EVENTS = ("drafter.call", "batch.built", "batch.written", "reply.received",
                "reply.taken", "trees.ready")
__all__ = ["DrafterTimeout", "DrafterUnavailable", "RemoteDrafter"]


@dataclass(eq=False)
class _State:
    """One request as the verifier knows it (engine thread only)."""

    kind: str | None  # "dflash" | "ngram" | None (the drafter's default)
    chunks: list[torch.Tensor] = field(default_factory=list)  # CPU context rows [0, num_rows)
    num_rows: int = 0
    rows_sent: int = 0  # context rows the drafter holds
    history_sent: int = 0  # history tokens the drafter holds
    epoch: int = -1  # the connection the drafter's copy was built on
    resend: bool = False  # the drafter's copy is unknown: release it, send everything
    sent_once: bool = False

    def rows_since(self, start: int) -> torch.Tensor | None:
        out, pos = [], 0
        for chunk in self.chunks:
            if pos + chunk.shape[0] > start:
                out.append(chunk[max(0, start - pos):])
            pos += chunk.shape[0]
        if not out:
            return None
        return out[0] if len(out) == 1 else torch.cat(out)  # one chunk (a feed): no copy


class RemoteDrafter:
    """`Drafter` over the drafter service at `address`; `start()` it on the asyncio loop."""

    def __init__(self, address: str, target_layer_ids: Sequence[int] = (),
                 timeout_s: float = 2.0, reconnect_s: float = 0.5) -> None:
        if not address:
            raise ValueError("drafter address is empty")
        if timeout_s <= 0 or reconnect_s <= 0:
            raise ValueError(f"timeout_s and reconnect_s must be positive, got "
                             f"{timeout_s}, {reconnect_s}")
        self.address, self.timeout_s = address, timeout_s
        self.target_layer_ids = tuple(int(t) for t in target_layer_ids)
        self.needs_context = bool(self.target_layer_ids)  # else only n-gram drafting works
        self.stream = DrafterStream(address, timeout_s, reconnect_s)
        self._feed_failed: set[str] = set()  # requests whose feed failed: resend in full
        self._step_ids = itertools.count(1)
        self._states: dict[str, _State] = {}
        self._entry_errors: dict[str, str] = {}
        self.tracing = None  # a StepTracer: each entry carries its request's `draft` span

    @property
    def connected(self) -> bool:
        return self.stream.connected

    async def start(self) -> None:
        """Bind to the running loop and try to connect once (failure: retried in background)."""
        await self.stream.start()

    async def close(self) -> None:
        await self.stream.close()

    # ---- engine thread -----------------------------------------------------------------------
    def set_kind(self, request_id: str, kind: str | None) -> None:
        """Which drafter serves `request_id` (before its first draft)."""
        self._states[request_id] = _State(kind)

    def take_entry_errors(self) -> dict[str, str]:
        """request id → why its last draft was empty (a per-entry drafter error); then cleared."""
        errors, self._entry_errors = self._entry_errors, {}
        return errors

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        stream = self.stream
        if stream.loop is None or stream.closed:
            raise DrafterUnavailable("the drafter client is not running")
        called_ns = time.time_ns()
        epoch, batch, marks, release = stream.epoch, convert.draft_batch(), {}, []
        for req in requests:
            st = self._states.setdefault(req.request_id, _State(None))
            if self._entry(req, st, epoch, release, batch):
                marks[req.request_id] = (st.num_rows, len(req.history or ()))
        step_id = batch.step_id = next(self._step_ids)
        stamps = [called_ns, time.time_ns()]  # + written, reply in (event loop), then taken
        done = asyncio.run_coroutine_threadsafe(
            stream.exchange(step_id, epoch, batch, release, stamps=stamps), stream.loop)
        try:
            reply = done.result(self.timeout_s + 1.0)
            stamps.append(time.time_ns())
        except BaseException as e:
            done.cancel()
            for req in requests:  # the drafter may or may not have applied the batch
                self._states[req.request_id].resend = True
            if isinstance(e, concurrent.futures.TimeoutError):
                raise DrafterTimeout(f"no reply within {self.timeout_s} s") from None
            raise
        trees = self._trees(requests, reply, marks)
        if self.tracing and len(stamps) == len(DRAFT_EVENTS) - 1:  # the last one is now
            self.tracing.note_draft([r.request_id for r in requests],
                                    list(zip(DRAFT_EVENTS, [*stamps, time.time_ns()],
                                             strict=True)))
        return trees

    def feed(self, requests: Sequence[DraftRequest]) -> None:
        """Send prefill context rows now, as budget-0 entries whose reply is not waited for: the
        drafter builds its context cache while the target prefills, and the first draft carries
        no prompt rows. The rows are kept here as always; a feed that fails marks its requests
        for a full resend by their next draft."""
        rows = [r for r in requests if r.context is not None and r.context.shape[0]]
        if not rows:
            return
        stream = self.stream
        if stream.loop is None or stream.closed or not stream.connected:
            for req in rows:  # no stream: keep the rows for the first draft
                if not self._absorb(req, self._states.setdefault(req.request_id, _State(None))):
                    self._states[req.request_id].resend = True
            return
        epoch, batch, release = stream.epoch, convert.draft_batch(), []
        for req in rows:
            st = self._states.setdefault(req.request_id, _State(None))
            if st.kind == "ngram":  # the n-gram drafter takes no context
                continue
            if not self._entry(req, st, epoch, release, batch, traced=False):
                continue
            st.rows_sent = st.num_rows  # optimistic: a failure sets resend (see _feed)
        if batch.entries:
            step_id = batch.step_id = next(self._step_ids)
            ids = [r.request_id for r in rows]
            stream.loop.call_soon_threadsafe(
                lambda: stream.feed(self._feed(step_id, epoch, batch, release, ids)))

    async def _feed(self, step_id: int, epoch: int, batch, release: list[str],
                    ids: list[str]) -> None:
        try:
            # a prefill chunk's rows take longer than a step's draft: FEED_DEADLINE × timeout_s
            reply = await self.stream.exchange(step_id, epoch, batch, release,
                                               FEED_DEADLINE * self.timeout_s)
            failed = [rid for rid, tree in convert.trees_from_pb(reply).items()
                      if not isinstance(tree, DraftTree)]
        except Exception:  # noqa: BLE001 — any failure: the next draft resends everything
            failed = ids
        self._feed_failed.update(failed)

    def _entry(self, req: DraftRequest, st: _State, epoch: int, release: list[str], batch,
               traced: bool = True) -> bool:
        """Append the request's DraftEntry to `batch`; False (with an entry error, nothing
        appended) if it cannot be drafted."""
        if req.request_id in self._feed_failed:
            self._feed_failed.discard(req.request_id)
            st.resend = True
        if not self._absorb(req, st):
            self._entry_errors[req.request_id] = "drafter_entry_error: context gap"
            return False
        if st.resend or st.epoch != epoch:
            if st.sent_once:
                release.append(req.request_id)
            st.rows_sent = st.history_sent = 0
            st.epoch, st.resend = epoch, False
        st.sent_once = True
        context = st.rows_since(st.rows_sent) if st.rows_sent < st.num_rows else None
        history = list(req.history[st.history_sent:]) if req.history is not None else []
        trace_context = (self.tracing.open_draft(req.request_id)
                         if self.tracing and traced else None)
        convert.add_draft_entry(batch, req, st.kind, context, history, trace_context)
        return True

    def _absorb(self, req: DraftRequest, st: _State) -> bool:
        """Keep the context rows not seen before; False if they do not continue what is kept."""
        ctx = req.context
        if ctx is None or not self.needs_context or st.kind == "ngram" or not ctx.shape[0]:
            return True
        first = req.start - ctx.shape[0]  # the rows cover positions [first, start)
        if first > st.num_rows:
            return False
        rows = ctx[st.num_rows - first:].detach().to("cpu")
        if rows.shape[0]:
            st.chunks.append(rows)
            st.num_rows += rows.shape[0]
        if len(st.chunks) > MAX_CHUNKS:  # merge the newer half: the prompt's big chunks stay
            keep = len(st.chunks) // 2
            st.chunks = st.chunks[:keep] + [torch.cat(st.chunks[keep:])]
        return True

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
        if st is not None and st.sent_once and stream.loop is not None and not stream.closed:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                stream.loop.call_soon_threadsafe(stream.queue_release, request_id)
