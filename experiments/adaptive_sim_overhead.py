"""Adaptive speculation priced with and without the rest of a step's cycle, on simulated time.

experiments/adaptive_sim.py's noise-free set-up (the demo pair's real drafts and acceptance on
the CPU, each decode step charged its `--table` time), with one more cost every step pays, plain
decoding too: `--overhead-ms` per step at batch 1 and 8 (the schedule, the policy, the loop —
on the H100, run 65's step less its drafting and verify part: about 0.15 ms at × 1). The
fixed budgets run once; adaptive twice priced as the code before 8da7e99 did (the overhead
unpriced) and twice as it does now (`CostModel.overhead`), in the order A B B A (the
calibration every request shares carries over from run to run, and a cell's first run starts
colder: run it with `--first` either side). Prints adaptive / best fixed by text and batch,
writes JSON with `--out`.

    PYTHONPATH=.:bench:experiments python experiments/adaptive_sim_overhead.py [--first priced]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import adaptive_sim as sim  # experiments/
import bench_adaptive  # bench/


class Frozen(sim.FrozenCost):
    """The table's times and a fixed rest of the cycle (0: unpriced)."""

    def __init__(self, table, overhead_ms: float) -> None:
        super().__init__(table)
        self.overhead_ms = overhead_ms

    def overhead_s(self, n: int) -> float:
        return self.overhead_ms / 1e3


def charge(engine, table, clock: list, overhead_ms: float) -> None:
    """Book each decode-only step's simulated ms, its overhead included, in clock[0]."""
    def observe(batch, draft_s, span):
        if batch.chunks or not batch.plans:
            return
        rows = span or max(p.layout.num_rows for p in batch.plans)
        drafted = sum(1 for p in batch.plans if p.budget and p.drafted)
        ms = sim.verify_ms(table, len(batch.plans), rows) + overhead_ms
        clock[0] += ms + (sim.draft_ms(table, drafted) if drafted else 0.0)
        clock[1].update(p.choice.shape if p.choice else "fixed" for p in batch.plans)
    engine._observe_cost = observe


def case(engines, tok, args, text: str, n: int, overhead_ms: float, clock: list,
         order: tuple[str, ...]) -> dict:
    batch = bench_adaptive.prompts(tok, text, n, args.contexts[0])
    fixed = {name: sim.run(engines[kind], batch, args.new_tokens, budget, clock)[0]
             for name, kind, budget in bench_adaptive.variants(args)[:-1]
             if name.startswith("B=")}
    best, row = max(fixed, key=fixed.get), {"text": text, "batch": n, "fixed": fixed}
    eng = engines["adaptive"]
    for label in order:  # the shared calibration carries over from run to run
        eng.cost = eng.adaptive.cost = eng.adaptive.prices.cost = Frozen(
            sim.TABLES["h200"], overhead_ms if label == "priced" else 0.0)
        eng.adaptive.prices._memo.clear()  # keyed by the model's epoch: a new one's is 0 too
        tok_s = sim.run(eng, batch, args.new_tokens, 63, clock)[0]
        row.setdefault(label, []).append(tok_s / fixed[best])
        row.setdefault(f"{label}_shapes", Counter()).update(clock[1])
    row["best"] = best
    print(f"{text:<11} × {n}  best {best}: adaptive / best, unpriced "
          f"{' '.join(f'{r:.3f}' for r in row['unpriced'])}, priced "
          f"{' '.join(f'{r:.3f}' for r in row['priced'])}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overhead-ms", type=float, nargs=2, default=[0.15, 0.40],
                    metavar=("X1", "X8"), help="the rest of a step's cycle at batch 1 and 8")
    ap.add_argument("--new-tokens", default="64")
    ap.add_argument("--out", default=None)
    ap.add_argument("--first", choices=["unpriced", "priced"], default="unpriced",
                    help="the side run first in each cell (then the other twice, then it)")
    own = ap.parse_args()
    other = "priced" if own.first == "unpriced" else "unpriced"
    order, rows = (own.first, other, other, own.first), []
    for n, overhead_ms in zip((1, 8), own.overhead_ms, strict=True):
        args = bench_adaptive.parse(["--new-tokens", own.new_tokens, "--batch", str(n)])
        engines, tok = bench_adaptive.build(args)
        clock: list = [0.0, Counter()]
        for e in engines.values():
            charge(e, sim.TABLES["h200"], clock, overhead_ms)
        rows += [case(engines, tok, args, text, n, overhead_ms, clock, order)
                 for text in ("predictable", "novel", "mix")]
    if own.out:
        with open(own.out, "w") as f:
            json.dump({"table": "h200", "overhead_ms": own.overhead_ms, "order": order,
                       "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
