"""The verifier's step cost model: measured seconds by shape, kept current while serving.

Owns two tables of recent samples, filled from the engine's own steps (the warm-up's steps
first: one tree per rows bucket, for one request and for each batch bucket): the verify part of a
decode step (batched forward + accept + commit, the time a step costs without drafting) keyed by
(batch bucket, rows per request, context class), and the drafter call (its forward, trees and,
for the drafter service, the round trip) keyed by (batch bucket, context class). A context class
is the context's bit length (…, 1k, 2k, 4k, …). An entry's value is the lower quartile of its
last WINDOW samples: step times are floored by the work and spiked by what else runs (a first
launch's compile or graph capture, the host, a neighbour on the GPU), so a low quantile follows
the cost and ignores the spikes. No shape costs more than a measured one with at least as many
rows per request at a context class at least as long (the envelope) until it has TRUSTED samples
of its own: one spiked entry never rules a shape out for good, and a shape measured often is
not priced by another measured elsewhere (the warm-up's steps run without a request's host
work). A shape never measured is estimated from the
nearest ones measured: at a context class already seen, the rows count measured there scaled
by how another class grew between the two rows counts; else linear in rows, flat when nothing
larger is known (optimistic: the policy then tries it and measures it). A third table keeps,
by batch bucket, the rest of a step's cycle (`StepCycle`: scheduling, the policy's host work,
the outputs' delivery between steps), which every shape pays, plain decoding too; the prices
add it to each verify time. No policy here (engine/adaptive.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.cudagraph import BATCH_BUCKETS, bucket_of

WINDOW = 8  # recent samples an entry keeps
TRUSTED = 4  # samples past which an entry is its own lower quartile, not capped by others
REFRESH = 16  # verify observations between re-estimates (envelope and shapes not measured)
STEADY_ROWS = 32  # context rows per drafted request past which a draft is not a steady one


def context_class(ctx: int) -> int:
    return max(int(ctx), 1).bit_length()


def batch_bucket(n: int) -> int:
    return bucket_of(n, BATCH_BUCKETS) or n


@dataclass
class Samples:
    """An entry's last WINDOW seconds; `value` their lower quartile."""

    value: float
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        self.recent.append(self.value)

    def add(self, x: float) -> None:
        self.recent.append(x)
        self.value = sorted(self.recent)[(len(self.recent) - 1) // 4]


@dataclass
class CostModel:
    verify: dict[tuple[int, int, int], Samples] = field(default_factory=dict)  # (n, rows, cls)
    draft: dict[tuple[int, int], Samples] = field(default_factory=dict)  # (n, cls)
    overhead: dict[int, Samples] = field(default_factory=dict)  # n: the rest of a step's cycle
    # envelopes of measured shapes, capped estimates of the others; recomputed after a new
    # shape or REFRESH observations
    _memo: dict[tuple[int, int, int], float | None] = field(default_factory=dict)
    _seen: int = 0
    epoch: int = 0  # bumped whenever the memo is dropped: callers may cache on it
    graph_builds: int = 0  # the runner's CUDA graph builds when a step was last observed
    pending: tuple | None = None  # a step `observe_step(defer=True)` left to `book_pending`

    def observe_verify(self, n: int, rows: int, ctx: int, seconds: float) -> None:
        key = (batch_bucket(n), rows, context_class(ctx))
        self._seen += 1
        if key not in self.verify or self._seen % REFRESH == 0:
            self._memo.clear()
            self.epoch += 1
        _add(self.verify, key, seconds)

    def book_pending(self) -> None:
        """Book the step `observe_step(defer=True)` left (the engine: in the next forward's
        wait for the GPU, off the step's path)."""
        if self.pending is not None:
            args, self.pending = self.pending, None
            observe_step(self, *args)

    def clear(self, verify: bool = True, draft: bool = True) -> None:
        """Forget the measured times, a step's not yet booked too (callers caching on `epoch`
        see it move); the rest of the cycle goes with the drafting times (the warm-up's steps
        run in its own loop, not the one that serves)."""
        for table, chosen in ((self.verify, verify), (self.draft, draft),
                              (self.overhead, draft)):
            if chosen:
                table.clear()
        self.pending = None
        self._memo.clear()
        self.epoch += 1

    def observe_draft(self, n: int, ctx: int, seconds: float) -> None:
        """Book a drafter call; callers caching on `epoch` see it move with the entry's value."""
        self._book(self.draft, (batch_bucket(n), context_class(ctx)), seconds)

    def observe_overhead(self, n: int, seconds: float) -> None:
        """Book the rest of a step's cycle (`StepCycle`) for a batch of `n`."""
        self._book(self.overhead, batch_bucket(n), seconds)

    def _book(self, table: dict, key, seconds: float) -> None:
        before = table[key].value if key in table else None
        _add(table, key, seconds)
        if key in table and table[key].value != before:
            self.epoch += 1

    def verify_s(self, n: int, rows: int, ctx: int) -> float | None:
        """Seconds of a decode step of `n` requests, `rows` rows each, longest context `ctx`."""
        key = (batch_bucket(n), rows, context_class(ctx))
        got = self.verify.get(key)
        if key not in self._memo:  # measured: the envelope; else the estimate capped by it
            cap = self._envelope(*key)
            own = cap if got is not None else self._estimate(*key)
            self._memo[key] = None if own is None else min(own, cap)
        cap = self._memo[key]
        if got is None:
            return cap
        return got.value if len(got.recent) >= TRUSTED else min(got.value, cap)

    def _envelope(self, nb: int, rows: int, cls: int) -> float:
        """The cheapest other measured entry of this batch bucket that costs at least as much."""
        return min((e.value for (m, r, c), e in self.verify.items()
                    if m == nb and r >= rows and c >= cls and (r, c) != (rows, cls)),
                   default=float("inf"))

    def _estimate(self, nb: int, rows: int, cls: int) -> float | None:
        for key_n in _nearest(nb, {k[0] for k in self.verify}):
            at = {(r, c): e.value for (m, r, c), e in self.verify.items() if m == key_n}
            if (est := _by_rows(at, rows, cls)) is not None:
                return est
        return None

    def draft_s(self, n: int, ctx: int) -> float | None:
        """Seconds of one drafter call for `n` requests at longest context `ctx`."""
        nb, cls = batch_bucket(n), context_class(ctx)
        for key_n in _nearest(nb, {k[0] for k in self.draft}):
            classes = {c: e.value for (m, c), e in self.draft.items() if m == key_n}
            c = min(classes, key=lambda c: (abs(c - cls), -c))
            return classes[c]
        return None

    def overhead_s(self, n: int) -> float:
        """Seconds of a step's cycle outside drafting and verify for `n` requests (0: none
        measured)."""
        near = _nearest(batch_bucket(n), set(self.overhead))
        return self.overhead[near[0]].value if near else 0.0

    def table(self) -> dict[str, float]:
        """Every measured entry in ms, for Stats / benchmarks: "verify n=1 rows=16 ctx<=2^11"."""
        out = {f"verify n={n} rows={r} ctx<=2^{c}": e.value * 1e3
               for (n, r, c), e in sorted(self.verify.items())}
        out.update({f"draft n={n} ctx<=2^{c}": e.value * 1e3
                    for (n, c), e in sorted(self.draft.items())})
        out.update({f"overhead n={n}": e.value * 1e3 for n, e in sorted(self.overhead.items())})
        return out


class StepPrices:
    """A decode step's price by the model: seconds by rows per request (padded as the runner
    pads a tree: its verify and the rest of the step's cycle) and the drafting seconds, cached
    until the model moves (the adaptive policy reads them at each of its decisions)."""

    def __init__(self, cost: CostModel, pad_rows) -> None:
        self.cost, self.pad_rows = cost, pad_rows  # pad_rows(rows) → rows a tree occupies
        self._memo: dict[tuple, tuple | None] = {}

    def __call__(self, n: int, ctx: int, rows: tuple[int, ...]) -> tuple | None:
        """([(rows, verify seconds)] for each of `rows`, drafting seconds) for `n` requests at
        longest context `ctx`, or None while one of `rows` is unmeasured."""
        key = (batch_bucket(n), context_class(ctx), rows, self.cost.epoch)
        if key not in self._memo:
            if len(self._memo) > 256:
                self._memo.clear()
            verify = [(r, self.cost.verify_s(n, self.pad_rows(r), ctx)) for r in rows]
            rest = self.cost.overhead_s(n)
            self._memo[key] = None if any(t is None for _, t in verify) else \
                ([(r, t + rest) for r, t in verify], self.cost.draft_s(n, ctx) or 0.0)
        return self._memo[key]


class StepCycle:
    """The rest of an engine step's cycle: from the last step's end to this one's, less this
    step's drafting and its verify part (forward, accept, commit) — the schedule, the policy's
    host work and, between steps, the outputs' delivery (through the services, the stream to
    the gateway). Measured only across steps that share a request: a wait for work between
    two batches is not a step's."""

    def __init__(self) -> None:
        self._end: int | None = None  # the last step's end (time.time_ns())
        self._ids: frozenset = frozenset()  # its requests

    def rest(self, times, batch, draft_s: float | None) -> float | None:
        """Seconds of this step's cycle (`times`: its StepTimes; `batch`: its StepBatch)
        outside drafting and verify, or None: no last step sharing a request, or no drafting
        time of the step's own."""
        ids = frozenset(p.seq.request_id for p in batch.plans) | {
            w.seq.request_id for w in batch.chunks}
        end, shared = self._end, bool(ids & self._ids)
        self._end, self._ids = times.end_ns, ids
        if end is None or not shared or draft_s is None:
            return None
        return (times.draft_end_ns - end) / 1e9 - draft_s


def observe_step(cost: CostModel, plans, rows: int, verify_s: float, draft_s: float | None,
                 draft_rows: int, graph_builds: int = 0, overhead_s: float | None = None,
                 defer: bool = False) -> None:
    """Book one decode-only engine step: its `plans` (engine.speculative.Planned), the rows
    each tree occupied (0: each its own), the verify + commit seconds, and the drafting
    seconds (None: not the step's own, as with overlap) with the context rows it carried. A
    draft that also took a prompt's or a skipped stretch's rows costs more once, not every
    step: only steady drafts are booked (none where a request had its first tree: its prompt's
    context, fed to the drafter during the prefill, is taken in then) and none where a chain
    was asked for (`Ask`: no tree stage; the price is a tree's, which decisions draft). A step
    that built a CUDA graph (the runner's count of builds, `graph_builds`, moved since the last
    step) timed the capture: nothing is booked (a shape booked once at its capture's cost was
    never chosen again, so never measured). `overhead_s`: the rest of the step's cycle
    (`StepCycle`; None: not measured). `defer`: kept for `CostModel.book_pending`."""
    if defer:
        cost.book_pending()
        cost.pending = (plans, rows, verify_s, draft_s, draft_rows, graph_builds, overhead_s)
        return
    if graph_builds != cost.graph_builds:
        cost.graph_builds = graph_builds
        return
    if overhead_s is not None:
        cost.observe_overhead(len(plans), overhead_s)
    ctx = max(p.start for p in plans)
    cost.observe_verify(len(plans), rows or max(p.layout.num_rows for p in plans), ctx, verify_s)
    drafted = sum(1 for p in plans if p.budget and p.drafted)
    if drafted and draft_s is not None and draft_rows <= STEADY_ROWS * drafted \
            and not any(p.first or p.chain for p in plans):
        cost.observe_draft(drafted, ctx, draft_s)


def _add(table: dict, key, seconds: float) -> None:
    if seconds <= 0:
        return
    if key in table:
        table[key].add(seconds)
    else:
        table[key] = Samples(seconds)


def _nearest(n: int, have: set[int]) -> list[int]:
    return sorted(have, key=lambda m: (abs(m - n), -m))


def _by_rows(at: dict[tuple[int, int], float], rows: int, cls: int) -> float | None:
    """Estimate (rows, cls) from one batch bucket's measured (rows, cls) → seconds: at the
    same class, the rows measured there nearest to `rows`, scaled by how the nearest other class
    that measured both rows counts grows between them (no such class: linear between the
    measured rows, flat past the ends)."""
    same = {r: v for (r, c), v in at.items() if c == cls}
    if rows in same:
        return same[rows]
    classes = sorted({c for _, c in at}, key=lambda c: (abs(c - cls), -c))
    if not same:
        return _interpolate({r: v for (r, c), v in at.items() if c == classes[0]}, rows)
    r0 = min(same, key=lambda r: (abs(r - rows), -r))
    for c in classes:
        if c != cls and (rows, c) in at and (r0, c) in at:
            return same[r0] * at[(rows, c)] / at[(r0, c)]
    return _interpolate(same, rows)


def _interpolate(by_rows: dict[int, float], rows: int) -> float:
    """Linear between the measured rows around `rows`; flat past the ends."""
    known = sorted(by_rows)
    lo = max((r for r in known if r <= rows), default=None)
    hi = min((r for r in known if r >= rows), default=None)
    if lo is None or hi is None or lo == hi:
        return by_rows[lo if hi is None else hi]
    t = (rows - lo) / (hi - lo)
    return by_rows[lo] + t * (by_rows[hi] - by_rows[lo])
