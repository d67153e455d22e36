"""Adaptive speculation's per-request state: how calibrated the drafter has been (accepted
over expected, by shape), the last drafted tree's curves, the probing schedule, the target's
confidence on plain steps, its recent accepted length and the shape the request holds between
the policy's decisions; when a saturated hold is explored a size class up (`Explorer`); and
the arithmetic of a pick among rated rows (`choose`). The choosing itself is
engine/adaptive.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.engine.speculative import Planned
from specserve.spec import shapes
from specserve.spec.shapes import Choice
from specserve.spec.tree import DraftTree, verify_layout

EMPTY = DraftTree.empty()  # the root-only tree of a step without a draft

PRIOR = 2.0  # pseudo-tokens pulling a shape's calibration towards 1 (trust the drafter)
DECAY = 0.9
SHARED_DECAY = 0.99  # the calibration every request shares: a property of the drafter
STAY = 1.05  # a decision moves off the last one's rows only when expected this much faster
EXPLORE_WAIT = 16  # saturated held steps an exploration waits for, at most


@dataclass
class Ratios:
    """Accepted over expected by shape key, as decayed sums."""

    decay: float
    real: dict[tuple, float] = field(default_factory=dict)
    pred: dict[tuple, float] = field(default_factory=dict)
    deepest: int = 0  # the longest chain a drafted tree has held (the shared Ratios only)
    near: dict[tuple, float] = field(default_factory=dict)  # `nearest` until the next booking

    def book(self, key: tuple, real: int, expected: float) -> None:
        self.real[key] = self.decay * self.real.get(key, 0.0) + real
        self.pred[key] = self.decay * self.pred.get(key, 0.0) + expected
        self.near.clear()

    def ratio(self, key: tuple, prior: float = 1.0) -> float:
        return (self.real.get(key, 0.0) + PRIOR * prior) / (self.pred.get(key, 0.0) + PRIOR)

    def nearest(self, key: tuple) -> float:
        """The ratio of `key` = (kind, nodes) if booked, else of the booked shape nearest it: of
        its kind if any, the closest size by ratio of sizes (1 with nothing booked). A shape
        never verified is taken to be as calibrated as its nearest one: the drafter's over- or
        under-confidence carries over, where 1 would keep a larger tree looking as bad as the
        drafter alone says."""
        got = self.near.get(key)
        if got is None:
            got = self.near[key] = self._nearest(key)
        return got

    def _nearest(self, key: tuple) -> float:
        if key in self.pred:
            return self.ratio(key)
        booked = [b for b in self.pred if b[0] == key[0]] or list(self.pred)
        if not booked:
            return 1.0
        return self.ratio(min(booked, key=lambda b: abs(math.log(b[1] / key[1]))))


@dataclass
class State:
    # the drafter's calibration: this request's, pulled towards every request's (`shared`)
    shared: Ratios
    own: Ratios = field(default_factory=lambda: Ratios(DECAY))
    curve: shapes.Curves | None = None  # of the last drafted tree
    cut: np.ndarray | None = None  # its node indices that were verified, by verify row
    nodes: int | None = None  # nodes chosen at the last draft (None: not drafted yet)
    skipped: int = 0  # steps since the last draft
    gap: int = 2  # skipped steps before the next probe
    probing: bool = False  # drafted as a probe while plain decoding was winning
    kind: str | None = None  # the shape chosen at the policy's last decision (held until the next)
    decision: int | None = None  # the policy's last decision it took part in (or joined)
    ask: int | None = None  # the drafter budget that shape needs (a chain: the DDTree holding it)
    why: str = ""  # and why
    kept: tuple | None = None  # this held step's ((kind, nodes), verified tree), to book
    confidence: float | None = None  # moving mean of the target's top-1 probability, plain steps
    fresh: bool = False  # confidence read since the last probe decision
    recent: float | None = None  # moving mean of the accepted length on its drafted steps
    # gain() by (k, budget) until this request books or draws a new curve (the shared part
    # moves slowly: it is read again at the request's next booking)
    gains: dict[tuple[int, int], tuple[float, str]] = field(default_factory=dict)

    def take_curve(self, tree) -> None:
        """The curves of the request's newly drafted `tree` (DraftTree with scores)."""
        self.curve = shapes.curves(tree)
        self.gains.clear()
        self.shared.deepest = max(self.shared.deepest, len(self.curve.chain_nodes))

    def calibration(self, key: tuple) -> float:
        return self.own.ratio(key, self.shared.nearest(key))

    def gain(self, k: int, budget: int) -> tuple[float, str]:
        """Calibrated expected accepted length at `k` nodes (≤ budget) and its shape."""
        if self.curve is None or k <= 0:
            return 0.0, shapes.OFF
        got = self.gains.get((k, budget))
        if got is None:
            got = self.gains[(k, budget)] = self._gain(min(k, budget))
        return got

    def _gain(self, k: int) -> tuple[float, str]:
        cv = self.curve
        tree = min(self.calibration((shapes.TREE, k)) * cv.expected(shapes.TREE, k),
                   cv.depth(shapes.TREE, k))  # never past its depth
        chain = min(self.calibration((shapes.CHAIN, k)) * cv.expected(shapes.CHAIN, k),
                    cv.depth(shapes.CHAIN, k))
        if cv.chain_inside(k):  # the prefix holds the chain: it accepts at least as much
            return max(tree, chain), shapes.TREE
        return (chain, shapes.CHAIN) if chain > tree else (tree, shapes.TREE)

    def forecast_gain(self, k: int, budget: int) -> tuple[float, str]:
        """`gain` before drafting: the last curve, but at least what the request has been
        accepting at the size it holds (one shallow tree does not turn a request that has been
        accepting long paths over to plain decoding)."""
        gain, kind = self.gain(k, budget)
        if self.recent is not None and self.nodes is not None and min(k, budget) >= self.nodes:
            gain = max(gain, min(self.recent, k))
        return gain, kind

    def confident_gain(self, k: int, budget: int) -> tuple[float, str]:
        """What a chain would accept if the drafter were as sure as the target has been on
        the plain steps since the last draft: Σ c^d over its depths (0 without those steps),
        as deep as the longest chain the drafter has drafted (not the last one: the text may
        have turned predictable since)."""
        c = self.confidence
        if c is None or self.curve is None or k <= 0:
            return 0.0, shapes.OFF
        depth = min(k, budget, self.shared.deepest or k)
        gain = depth if c >= 1.0 else c * (1.0 - c ** depth) / (1.0 - c)  # Σ_{d ≤ depth} c^d
        return gain, shapes.CHAIN

    def book(self, key: tuple, real: int, expected: float) -> None:
        self.own.book(key, real, expected)
        self.shared.book(key, real, expected)
        self.gains.clear()

    def take_verified(self, accepted_rows: list[int]) -> tuple:
        """What a verified tree of this request leaves to book, taken at once (the next
        step's shaping overwrites `kept` and `cut`): (kept, cut, curve), the last arguments of
        `book_verified`; `kept` is set only after a held step. Its recent accepted length moves
        now."""
        n = len(accepted_rows)
        self.recent = n if self.recent is None else 0.5 * self.recent + 0.5 * n
        kept = None
        if self.cut is None and self.kept is not None:  # a held step
            kept, self.kept = self.kept, None
        return kept, self.cut, self.curve

    def book_verified(self, shape: str, classes, accepted_rows: list[int], kept, cut,
                      curve) -> None:
        """Book a verified tree of `shape` (accepted: its verify rows `accepted_rows`; the
        rest as `take_verified` took them): a held step its own shape only; a decided one what
        each candidate shape of the size `classes` inside it would have accepted."""
        if kept is not None:
            key, tree = kept
            self.book(key, len(accepted_rows), shapes.expected(tree))
            return
        if cut is None or curve is None:
            return
        accepted = cut[np.asarray(accepted_rows, dtype=np.int64) - 1].tolist()
        path, n, cv = curve.chain_nodes, len(cut), curve
        for k in classes:
            if shape == shapes.TREE and k <= n:
                self.book((shapes.TREE, k), shapes.realized_prefix(accepted, k),
                          cv.expected(shapes.TREE, k))
            on_chain = path[:k]
            if (k <= n if shape == shapes.CHAIN else
                    not len(on_chain) or int(on_chain.max()) < n):
                self.book((shapes.CHAIN, k), shapes.realized_chain(accepted, path, k),
                          cv.expected(shapes.CHAIN, k))


@dataclass
class Explorer:
    """When most held shapes are accepted to their deepest node, the hold ends and the next
    decision verifies a tree a size class above (once, where it would stay: the bigger shapes'
    calibrations may date from text less predictable, and only a verified tree books them). An
    exploration after which the decision stays doubles the saturated held steps the next one
    waits for (up to EXPLORE_WAIT); one that moves it up resets the wait."""

    wait: int = 1  # saturated held steps before the hold ends
    seen: int = 0  # saturated held steps since the last end
    due: int | None = None  # the held size the next decision goes above
    tried: int | None = None  # the held size the last decision explored above

    def saturated(self, nodes: int) -> bool:
        """A held step of `nodes` where most were accepted to the deepest: whether it ends."""
        self.seen += 1
        if self.seen < self.wait:
            return False
        self.seen, self.due = 0, nodes
        return True

    def at(self, best: int, drafted: int) -> int | None:
        """The nodes this decision (its `best` rows; trees of up to `drafted` nodes) verifies
        instead, or None: no exploration due, `best` already goes above, plain decoding won,
        or no tree bigger than the held size was drafted (drafts sent ahead for the hold: an
        exploration there would cost a step drafted at once, not ahead)."""
        if self.tried is not None:  # the decision after an exploration: did it move up?
            self.wait = 1 if best - 1 > self.tried else min(2 * self.wait, EXPLORE_WAIT)
            self.tried = None
        k, self.due = self.due, None
        if k is None or best <= 1 or drafted <= k:
            return None
        if best - 1 > k:
            self.wait = 1
            return None
        self.tried = k
        return min(2 * k + 1, drafted)


def read_confidence(plain: list[tuple[State, int]], logits: torch.Tensor) -> None:
    """After plain steps, how sure the target was of each token (its top-1 probability at each
    (state, row of `logits` [N, V]) of `plain`): one softmax and one transfer for the step."""
    if not plain:
        return
    index = torch.tensor([row for _, row in plain], device=logits.device)
    tops = torch.softmax(logits.index_select(0, index).float(), -1).amax(-1).tolist()
    for (st, _), top in zip(plain, tops, strict=True):
        st.confidence = top if st.skipped <= 1 or st.confidence is None else \
            0.5 * st.confidence + 0.5 * top
        st.fresh = True


def choose(rated: tuple | None, n: int, drafted: bool, margin: float, top: int,
           held: int | None = None) -> tuple[int, str]:
    """The pick among the rated rows of a step (engine/adaptive.py `_rated`): (rows, why).
    Once `drafted`, plain decoding's step carries the drafting time too (it is spent); plain
    decoding wins only by `margin`, and where rows `held` were chosen last, another rows count
    only by STAY (step times measured a few per cent apart are noise, not a reason to move)."""
    if rated is None:
        return top + 1, "unmeasured: the client's budget"
    rates, draft = _rates(rated, drafted), rated[1]
    weight = {1: 1.0 / margin} if held is None else {held: STAY, 1: 1.0 / margin}
    rate, rows, tokens, t = max(rates, key=lambda r: (r[0] * weight.get(r[1], 1.0), r[1]))
    return rows, (f"step rows {rows}: {tokens / n:.2f} tok/step in {t * 1e3:.2f} ms "
                  f"(+{draft * 1e3:.2f} draft) = {rate:.0f} tok/s; plain {rates[0][0]:.0f} tok/s")


def advantage(rated: tuple | None) -> float:
    """The best drafted rows' tokens/s over plain decoding's, the drafting still to pay (`choose`'s
    rates; 0 while a shape is unmeasured)."""
    if rated is None:
        return 0.0
    rates = _rates(rated, False)
    return max((r[0] for r in rates if r[1] > 1), default=0.0) / rates[0][0]


def _rates(rated: tuple, drafted: bool) -> list[tuple[float, int, float, float]]:
    """(tokens/s, rows, tokens, verify seconds) of each rated rows, plain decoding's first;
    `drafted`: the drafting is spent, so plain decoding's step carries it too."""
    verify, draft = rated
    return [(tokens / (t + (draft if rows > 1 or drafted else 0.0)), rows, tokens, t)
            for rows, tokens, t in verify]


def drafting(states: list[State]) -> list:
    """No request skips the drafter: their probes start over. Returns the skipping (none)."""
    for st in states:
        st.gap, st.probing = 2, False
    return []


def plain_plan(seq, st: State) -> Planned:
    """A root-only plan for `seq` (state `st`) skipping the drafter (its context rows stay)."""
    st.skipped += 1
    why = f"plain decoding expected faster; probe in {max(st.gap - st.skipped, 0)} steps"
    return Planned(seq, EMPTY, verify_layout(EMPTY, seq.last_token, seq.num_computed),
                   seq.budget, drafted=False, choice=Choice(shapes.OFF, 0, why))


def outside(p: Planned) -> Choice:
    """The shape of a plan the policy did not choose (no probabilities, budget 0, no draft)."""
    if n := p.tree.n:
        chain = np.array_equal(p.tree.depths, np.arange(1, n + 1))
        return Choice(shapes.CHAIN if chain else shapes.TREE, n, "as drafted: no probabilities")
    why = ("budget 0: plain decoding asked" if not p.seq.budget else
           f"drafter fallback: {p.fallback}" if p.fallback else "no draft this step")
    return Choice(shapes.OFF, 0, why)


