"""Adaptive speculation: each step's trees chosen by expected committed tokens per second.

Owns the choice and the per-request state behind it (docs/internals.md walks through it). A
step's candidates are its rows per request R (one rows bucket a step under CUDA graphs): R = 1
is plain decoding, else each request takes the better of its drafted tree's first R − 1 nodes
(the DDTree of that budget) and the chain inside it. For every R:

    tokens/s(R) = Σ_requests (1 + ĉ · E[accepted]) / (verify(R) + draft)

with E from the drafter's own path probabilities (spec/shapes.py), ĉ the request's running
ratio of accepted to expected for that shape (every verified tree books its counterfactuals;
engine/adaptive_state.py), and times from the cost model (engine/cost.py). Before drafting,
with last step's curves: if plain decoding wins by SKIP_MARGIN nobody is drafted (B = 0, no
drafter call) but requests without a curve and probes (after 2, 4, … 32 steps, or once the
target's confidence on plain steps, read every CONFIDENCE_EVERY, says a chain would pay).
After drafting, the choice is made again with the fresh curves and the trees are cut to it
(the client's budget bounds it; the drafter is asked for a size class above it). A decision to
draft, once every cost is measured, holds for REDECIDE steps (a repeat: twice as long, up to
HOLD_GROWTH × REDECIDE), each request keeping its shape (a held chain drafted as a chain but on
the hold's last step); a grown batch, a skipped request or a step where most held shapes were
accepted to their deepest node (then explored a size class up: `Explorer`) ends it. Bookings
wait for the next step's verify forward. Trees without probabilities (n-gram) are kept as
drafted. Lossless: only which draft tokens are verified changes; the acceptance walk is not.
"""

from __future__ import annotations

import numpy as np

from specserve.engine.adaptive_state import (
    EMPTY,
    SHARED_DECAY,
    Explorer,
    Ratios,
    State,
    advantage,
    choose,
    drafting,
    outside,
    plain_plan,
    read_confidence,
)
from specserve.engine.cost import CostModel, StepPrices, batch_bucket, context_class
from specserve.engine.speculative import Ask, Planned
from specserve.engine.warmup import candidates, size_classes
from specserve.spec import shapes
from specserve.spec.shapes import Choice

MAX_PROBE_GAP = 32
CONFIDENCE_EVERY = 4  # plain steps between readings of the target's confidence (softmax, copy)
# skip the drafter only when plain decoding is expected this much faster (a wrong skip also
# loses the next curve, a wrong draft costs at most the margin)
SKIP_MARGIN = 1.1
WIDE = 1.25  # drafting found this much faster spares the next steps the forecast before it
REDECIDE = 8  # steps a decision holds (each request keeps its shape): its host work paid once
HOLD_GROWTH = 4  # a decision repeating the last holds twice as long, up to this × redecide


class Adaptive:
    """Per-engine policy state (engine thread only)."""

    def __init__(self, cost: CostModel, pad_rows, redecide: int = REDECIDE) -> None:
        if redecide < 1:
            raise ValueError(f"redecide must be >= 1, got {redecide}")
        self.cost, self.prices = cost, StepPrices(cost, pad_rows)
        self.state: dict[str, State] = {}
        self.shared, self.redecide = Ratios(SHARED_DECAY), redecide
        self._hold = 0  # steps the last decision to draft still holds
        self._span = redecide  # steps it held for from the start
        self.explorer = Explorer()  # a size class above a saturated hold, verified once
        self._wide = False  # it found drafting WIDE × faster than plain decoding
        self._rows: int | None = None  # the rows per request it chose (None: plain decoding)
        self._held: tuple[int, int, str] | None = None  # its (batch bucket, nodes, why)
        self._decision = 0  # decisions made (State.decision: the last one a request took part in)
        self._fast = False  # this step keeps the held shapes
        self._prior: dict[str | None, State] = {}  # by drafter kind: the last request drafted
        self._moved = 0  # bumped by each step with drafts and each booking: a forecast's inputs
        self._plain_at: tuple | None = None  # (batch, context class, costs, moved) last skipped
        self._pending: list[tuple[State, tuple]] = []  # deferred bookings (`book_pending`)

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def to_draft(self, seqs) -> tuple[list, list]:
        """Split speculating requests into (drafted now, skipping: B = 0 this step). Requests
        without a curve (drafted without probabilities, or the first of their drafter) are
        drafted; the others are decided among themselves."""
        states = [self._state(s) for s in seqs]
        known = [(s, st) for s, st in zip(seqs, states, strict=True) if st.curve is not None]
        self._fast = self._holds(len(seqs), [st for _, st in known])
        self._hold = self._hold - 1 if self._fast else 0  # else: decided afresh
        skip = self._skipping(*zip(*known, strict=True)) if known and not self._fast else []
        out = {s.request_id for s in skip}
        return [s for s in seqs if s.request_id not in out], skip

    def _state(self, seq) -> State:
        """The request's state; a new one starts from its drafter's last curve and probe gap
        (a drafter that has not paid for the requests before is not drafted at once)."""
        st = self.state.get(seq.request_id)
        if st is None:
            st = self.state[seq.request_id] = State(self.shared)
            prior = self._prior.get(seq.drafter_kind)
            if prior is not None:
                st.curve, st.gap, st.skipped = prior.curve, prior.gap, 1
        return st

    def _holds(self, n: int, states: list[State]) -> bool:
        """Whether this step keeps the last decision to draft: it holds, for a batch no bigger
        than it was priced for, and each request with a curve took part in it or is new."""
        if self._hold <= 0 or not states or batch_bucket(n) > self._held[0]:
            return False
        return all(st.decision == self._decision or st.kind is None for st in states)

    def _skipping(self, seqs, states) -> list:
        """Which of `seqs` (each with a curve) skip the drafter this step. The forecast is read
        again only when its inputs moved: a draft, the cost model, the batch, its context class."""
        if self._wide and all(st.decision in (self._decision, None) for st in states):
            return drafting(states)
        self.book_pending()
        at = (tuple(s.request_id for s in seqs),
              context_class(max(s.num_computed for s in seqs)), self.cost.epoch, self._moved)
        if at != self._plain_at and self._best(seqs, states, margin=SKIP_MARGIN,
                                               gain=State.forecast_gain)[0] > 1:
            return drafting(states)
        self._plain_at = at
        for st in states:
            if st.skipped == 0:  # drafted last step, plain decoding wins again: back off
                st.gap = min(2 * st.gap, MAX_PROBE_GAP) if st.probing else 2
        due = [st.skipped + 1 >= st.gap or (st.fresh and st.skipped > 1 and self._best(
            [s], [st], gain=State.confident_gain)[0] > 1)  # probes
            for s, st in zip(seqs, states, strict=True)]
        if any(due):  # those half-way to their probe ride along: one drafter call, not several
            due = [d or (st.skipped > 0 and 2 * (st.skipped + 1) >= st.gap)
                   for d, st in zip(due, states, strict=True)]
        for st, d in zip(states, due, strict=True):
            st.probing, st.fresh = st.probing or d, False
        return [s for s, d in zip(seqs, due, strict=True) if not d]

    def ahead(self, seqs) -> dict[str, Ask] | None:
        """The next step's asks for `seqs` if the decision to draft holds for it, else None."""
        states = [self.state.get(s.request_id) for s in seqs]
        if not self._holds(len(seqs), [st for st in states if st and st.curve is not None]):
            return None
        return self.draft_budgets(seqs, held=True)

    def draft_budgets(self, seqs, held: bool | None = None) -> dict[str, Ask]:
        """What to ask the drafter for: a size class above the last choice (trees grow a class
        a step; a budget never chosen is not paid for); in a held step the tree holding the held
        shape (joining it: the held size), a chain as a chain (no tree stage) but on the hold's
        last step, whose tree is the next forecast's curve."""
        out, fast = {}, self._fast if held is None else held
        last = self._hold <= (1 if held else 0)  # `ahead` asks for the step after this one
        for s in seqs:
            st = self.state.get(s.request_id)  # None: a request new to the policy
            if not s.budget or not (fast or (st is not None and st.nodes is not None)):
                continue
            kept = st.ask if st is not None and st.decision == self._decision else None
            chain = bool(fast and kept and st.kind == shapes.CHAIN and not last)
            ask = st.nodes if chain else (kept or self._held[1]) if fast else 2 * st.nodes + 1
            out[s.request_id] = Ask(min(s.budget, ask), chain)
        return out

    def skipped(self, seq) -> Planned:
        """A root-only plan for a request that skips drafting (its context rows stay)."""
        return plain_plan(seq, self.state[seq.request_id])

    def shape(self, plans: list[Planned]) -> None:
        """Cut the drafted trees of `plans` to this step's choice (the drafting is spent)."""
        scored = [p for p in plans if p.tree.n and p.tree.scores is not None and p.choice is None]
        self._moved += bool(scored)
        if self._fast:  # a held step
            for p in scored:
                st = self._state(p.seq)
                if st.decision != self._decision:  # new: it joins with the held size's prefix
                    _, nodes, why = self._held
                    st.kind, st.nodes, st.ask, st.why = shapes.TREE, nodes, nodes, f"joined: {why}"
                    st.decision = self._decision
                self._keep(p, st)
            scored = [p for p in scored if p.choice is None]
        self._fast = False
        if scored:
            self._shape(scored)
        for p in plans:  # the rest say why they are outside the choice (counted, traced)
            if p.choice is None:
                p.choice = outside(p)

    def _shape(self, scored: list[Planned]) -> None:
        self.book_pending()
        for p in scored:
            st = self._state(p.seq)
            st.take_curve(p.tree)
            self._prior[p.seq.drafter_kind] = st
        seqs, states = [p.seq for p in scored], [self.state[p.seq.request_id] for p in scored]
        rated, top = self._rated(seqs, states), max(s.budget for s in seqs)
        best, why = choose(rated, len(seqs), True, 1.0, top, self._rows)
        if (explore := self.explorer.at(best, max(p.tree.n for p in scored))) is not None:
            best, why = explore + 1, f"explore: {self.explorer.tried} held nodes saturated; {why}"
        self._wide, self._rows = advantage(rated) >= WIDE, (best if best > 1 else None)
        for p, st in zip(scored, states, strict=True):
            self._cut(p, st, best - 1, why)
        # hold only if drafting pays with its cost to come, priced (a fresh engine's is 0 s)
        hold = explore is None and best > 1 and rated is not None and rated[1] > 0 and \
            choose(rated, len(seqs), False, SKIP_MARGIN, top)[0] > 1
        same = hold and self._held is not None and self._held[1] == best - 1
        self._span = min(2 * self._span, HOLD_GROWTH * self.redecide) if same else self.redecide
        self._hold, self._decision = self._span - 1 if hold else 0, self._decision + 1
        self._held = (batch_bucket(len(scored)), best - 1, why) if hold else None
        for st in states:
            st.decision = self._decision

    def _keep(self, p: Planned, st: State) -> None:
        """Cut `p`'s tree to the shape its request holds, kept for `observe` to book (the
        calibration of the shape in use keeps learning). On the hold's last step the drafted
        tree also gives the request its curve: the next decision reads this step's drafter,
        not the one that made the last decision."""
        if self._hold == 0:
            st.take_curve(p.tree)
        st.skipped, st.cut, k = 0, None, min(st.nodes, p.budget)
        if st.kind == shapes.TREE and k < p.tree.n:  # else the tree as asked is the shape
            p.tree = shapes.subtree(p.tree, shapes.prefix(p.tree, k))
            p.layout = shapes.prefix_layout(p.layout, p.tree.n)
        elif st.kind == shapes.CHAIN and len((chain := shapes.chain(p.tree, k)).nodes) < p.tree.n:
            p.tree = shapes.subtree(p.tree, chain)
            p.layout = shapes.chain_layout(p.layout, chain.nodes)
        p.choice = Choice(st.kind, p.tree.n, f"held: {st.why}")
        st.kept = ((st.kind, st.nodes), p.tree)  # booked by `observe`

    def _cut(self, p: Planned, st: State, k: int, why: str) -> None:
        st.skipped = 0
        _, kind = st.gain(k, p.budget)
        st.cut = None
        if k <= 0 or kind == shapes.OFF:  # the next draft asks as much as the last choice did
            p.tree, p.choice = EMPTY, Choice(shapes.OFF, 0, why)
        else:
            if k > p.budget:
                why = f"{why}; this request: its budget, {p.budget} nodes"
            st.nodes = k = min(k, p.budget)
            nodes = (np.arange(min(k, p.tree.n)) if kind == shapes.TREE
                     else st.curve.chain_nodes[:k])
            cut = shapes.Shape(kind, nodes, st.curve.expected(kind, k))
            p.tree, p.choice = shapes.subtree(p.tree, cut), Choice(kind, len(nodes), why)
            st.cut = nodes
            st.ask = int(nodes.max()) + 1 if len(nodes) else None  # a DDTree holding the shape
        st.kind, st.why = p.choice.shape, why  # held until the next decision
        p.layout = shapes.chain_layout(p.layout, st.cut) if p.choice.shape == shapes.CHAIN \
            else shapes.prefix_layout(p.layout, p.tree.n)  # a prefix's rows lead the layout

    def _best(self, seqs, states, margin: float = 1.0, gain=State.gain) -> tuple[int, str]:
        """The step's rows per request maximising expected tokens per second before drafting,
        and why (`choose`); `gain`: `forecast_gain`, for probes `confident_gain`."""
        return choose(self._rated(seqs, states, gain), len(seqs), False, margin,
                      max(s.budget for s in seqs))

    def _rated(self, seqs, states, gain=State.gain) -> tuple | None:
        """([(rows, expected tokens of the step, verify seconds)] for plain decoding and each
        size class, drafting seconds), or None while a shape is unmeasured."""
        times = self.prices(len(seqs), max(s.num_computed for s in seqs),
                            candidates(max(s.budget for s in seqs)))
        if times is None:
            return None
        verify, draft = times
        pairs = list(zip(states, (s.budget for s in seqs), strict=True))
        return [(rows, sum(1 + gain(st, rows - 1, budget)[0] for st, budget in pairs), t)
                for rows, t in verify], draft

    def observe_step(self, verified: list[tuple[Planned, list[int], int]], logits,
                     defer: bool = False) -> None:
        """Book a step's verified trees: (plan, accepted verify rows, its root row in `logits`
        [N, V]) each; `defer`: what they leave is taken now, booked by `book_pending`."""
        read_confidence([(st, row) for p, _, row in verified
                         if p.choice and p.choice.shape == shapes.OFF
                         and (st := self.state.get(p.seq.request_id)) is not None
                         and st.skipped % CONFIDENCE_EVERY == 1], logits)
        held = [s for s in (self.observe(p, rows, defer) for p, rows, _ in verified)
                if s is not None]
        if held and 2 * sum(held) > len(held) and self._held is not None \
                and self.explorer.saturated(self._held[1]):  # most were too small
            self._hold = 0  # decided afresh next step, a size class up asked and explored

    def observe(self, p: Planned, accepted_rows: list[int], defer: bool = False) -> bool | None:
        """Book what each candidate shape inside the verified tree would have accepted; a held
        shape: whether it was accepted to its deepest node with room to grow (else None)."""
        st = self.state.get(p.seq.request_id)
        if st is None or p.choice is None or p.choice.shape == shapes.OFF:
            return None
        kept, cut, curve = st.take_verified(accepted_rows)
        classes = size_classes(p.budget) if kept is None else ()  # a held shape books itself
        self._pending.append((st, (p.choice.shape, classes, accepted_rows, kept, cut, curve)))
        if not defer:
            self.book_pending()
        held = kept is not None  # a held step's own shape
        return p.tree.n < p.seq.budget and len(accepted_rows) >= p.tree.max_depth if held \
            else None

    def book_pending(self) -> None:
        """Book what verified trees left (`observe_step`) and the last step's times (the
        engine's deferred cost sample): the calibrations and the cost model move."""
        for st, args in self._pending:
            st.book_verified(*args)
        self._moved += len(self._pending)
        self._pending.clear()
        self.cost.book_pending()
