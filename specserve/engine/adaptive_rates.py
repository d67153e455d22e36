"""Adaptive speculation's arithmetic: a step's candidates rated by expected tokens per second.

Owns the rating of the candidates engine/adaptive.py lists for a step and the pick among them.
A candidate is (rows per request, kind, expected tokens of the step, verify seconds, drafting
seconds): plain decoding (rows 1, no drafting), and for each size class trees (each request the
better of its tree's first rows − 1 nodes and the chain inside them, the drafter's tree stage
priced at that size) and chains (every request its chain, drafted as a chain: no tree stage),
each priced by the cost model (engine/cost.py `StepPrices`).
"""

from __future__ import annotations

from specserve.spec import shapes

STAY = 1.05  # a decision moves off the last one's rows only when expected this much faster


def choose(rated: tuple | None, n: int, drafted: bool, margin: float, top: int,
           held: int | None = None) -> tuple[int, str, str]:
    """The pick among a step's rated candidates (`rated`: (candidates, the drafting spent)):
    (rows, kind, why). Once `drafted`, plain decoding's step carries the drafting spent too;
    plain decoding wins only by `margin`, and where rows `held` were chosen last, other rows
    count only by STAY (step times measured a few per cent apart are noise, not a reason to
    move). Ties go to more rows, then to trees."""
    if rated is None:
        return top + 1, shapes.TREE, "unmeasured: the client's budget"
    rates = _rates(rated, drafted)
    weight = {1: 1.0 / margin} if held is None else {held: STAY, 1: 1.0 / margin}
    rate, rows, kind, tokens, t, draft = max(
        rates, key=lambda r: (r[0] * weight.get(r[1], 1.0), r[1], r[2] == shapes.TREE))
    chains = " chains" if kind == shapes.CHAIN else ""
    return rows, kind, (f"step rows {rows}{chains}: {tokens / n:.2f} tok/step in "
                        f"{t * 1e3:.2f} ms (+{draft * 1e3:.2f} draft) = {rate:.0f} tok/s; "
                        f"plain {rates[0][0]:.0f} tok/s")


def advantage(rated: tuple | None) -> float:
    """The best drafted candidate's tokens/s over plain decoding's, the drafting still to pay
    (`choose`'s rates; 0 while a shape is unmeasured)."""
    if rated is None:
        return 0.0
    rates = _rates(rated, False)
    return max((r[0] for r in rates if r[1] > 1), default=0.0) / rates[0][0]


def _rates(rated: tuple, drafted: bool) -> list[tuple[float, int, str, float, float, float]]:
    """(tokens/s, rows, kind, tokens, verify seconds, drafting seconds) of each candidate,
    plain decoding's first; `drafted`: the drafting is spent, so plain decoding's step
    carries it too."""
    candidates, spent = rated
    out = []
    for rows, kind, tokens, t, draft in candidates:
        draft = draft if rows > 1 else spent if drafted else 0.0
        out.append((tokens / (t + draft), rows, kind, tokens, t, draft))
    return out
