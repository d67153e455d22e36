"""Adaptive speculation's policy on a fixed cost table: real drafts, real acceptance, simulated
time. Noise-free: the same choices give the same figure, so a policy change reads at once.

    PYTHONPATH=.:bench python experiments/adaptive_sim.py --table h200 [--texts novel]

Builds bench_adaptive's engines on the demo pair (CPU), freezes the adaptive engine's cost model
to `--table`, and books each decode step the table's time: verify(n, rows) plus, when the
drafter was called, draft(n drafted) (the context rows a draft after skipped steps carries are
not charged: on the H200 they cost little beside the call). Prefill steps are left out (the
same for every variant). Tokens/s are the generated tokens over that simulated time; adaptive
runs `--repeats` times (its shared calibration carries over, as in a server). Tables: `h200`
fitted to run 3's cost model on the H200 (`experiments/results/adaptive_demo_h200_run3.json`:
plain step 0.58 ms, a drafter call 1.5 ms at batch 1, 5.9 ms at 8), `cpu` fitted to this VM's
(`bench/bench_adaptive.py --out`, 2026-12-04). `--believe RUN.json`: the policy chooses by the
cost model a real run measured (frozen; the steps are still charged the table's times), to see
what that model made it do. Prints a table, writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.engine.cost import CostModel
from specserve.types import SamplingParams

# ms: verify = a + b·n + c·n·rows; draft = d + e·n
TABLES = {"h200": (0.45, 0.12, 0.007, 0.85, 0.63), "cpu": (3.5, 0.6, 0.16, 4.5, 2.75)}


def verify_ms(table, n: int, rows: int) -> float:
    a, b, c = table[:3]
    return a + b * n + c * n * rows


def draft_ms(table, n: int) -> float:
    d, e = table[3:]
    return d + e * n


class Believed(CostModel):
    """A cost model as measured elsewhere (`cost_model_ms` of a bench_adaptive JSON), frozen:
    the policy chooses by it while the steps are charged the table's times."""

    def __init__(self, path: str, drop_above: float | None) -> None:
        super().__init__()
        with open(path) as f:
            run = json.load(f)
        entries, warm_class = run["cost_model_ms"], (run["args"]["chunk"] + 37).bit_length()
        for key, ms in entries.items():
            if drop_above is not None and key.startswith("verify") and ms > drop_above:
                continue  # a graph capture's time: today's engine does not book it
            kv = dict(part.split("=") for part in key.split()[1:])
            cls = 2 ** int(kv["ctx<"].split("^")[1]) - 1  # its class's longest context
            # the warm-up's class (its prompt: a chunk + 37 tokens) was booked once a shape,
            # the requests' classes at every step
            for _ in range(1 if cls.bit_length() == warm_class else 8):
                if key.startswith("verify"):
                    super().observe_verify(int(kv["n"]), int(kv["rows"]), cls, ms / 1e3)
                else:
                    super().observe_draft(int(kv["n"]), cls, ms / 1e3)

    def observe_verify(self, *a) -> None:
        pass

    def observe_draft(self, *a) -> None:
        pass


class FrozenCost(CostModel):
    """The table's times; nothing the engine measures moves them."""

    def __init__(self, table) -> None:
        super().__init__()
        self.t = table

    def observe_verify(self, *a) -> None:
        pass

    def observe_draft(self, *a) -> None:
        pass

    def verify_s(self, n, rows, ctx):
        return verify_ms(self.t, n, rows) / 1e3

    def draft_s(self, n, ctx):
        return draft_ms(self.t, n) / 1e3


def instrument(engine, table, clock: list) -> None:
    """Book each decode-only step's simulated ms in clock[0] (and its shapes in clock[1])."""
    def observe(batch, draft_s, span):
        if batch.chunks or not batch.plans:
            return
        rows = span or max(p.layout.num_rows for p in batch.plans)
        drafted = [p for p in batch.plans if p.budget and p.drafted]
        ms = verify_ms(table, len(batch.plans), rows)
        if drafted:
            ms += draft_ms(table, len(drafted))
        clock[0] += ms
        clock[1].update(p.choice.shape if p.choice else "fixed" for p in batch.plans)
    engine._observe_cost = observe


def run(engine, batch, new: int, budget: int, clock: list) -> tuple[float, list]:
    clock[0], clock[1] = 0.0, Counter()
    out = engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True), budget=budget)
    return sum(map(len, out)) / (clock[0] / 1e3), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", choices=sorted(TABLES), default="h200")
    ap.add_argument("--texts", nargs="+", default=["predictable", "novel", "mix"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--believe", default=None, metavar="JSON",
                    help="the policy sees this run's measured cost model instead of the table")
    ap.add_argument("--drop-above", type=float, default=None, metavar="MS",
                    help="with --believe: leave out verify entries dearer than this")
    ap.add_argument("--out", default=None)
    own, rest = ap.parse_known_args()
    args = bench_adaptive.parse(rest + ["--batch", *map(str, own.batch)])
    engines, tok = bench_adaptive.build(args)
    table = TABLES[own.table]
    cost = Believed(own.believe, own.drop_above) if own.believe else FrozenCost(table)
    engines["adaptive"].cost = engines["adaptive"].adaptive.cost = cost
    engines["adaptive"].adaptive.prices.cost = cost  # its prices read the frozen model
    clock: list = [0.0, Counter()]
    for e in engines.values():
        instrument(e, table, clock)
    rows = []
    for text in own.texts:
        for n in own.batch:
            rows.append(case(engines, tok, args, own, text, n, clock))
    if own.out:
        with open(own.out, "w") as f:
            json.dump({"table": own.table, "coefficients": table, "rows": rows}, f, indent=1)


def case(engines, tok, args, own, text: str, n: int, clock: list) -> dict:
    batch = bench_adaptive.prompts(tok, text, n, args.contexts[0])
    res, ref = {}, None
    for name, kind, budget in bench_adaptive.variants(args)[:-1]:
        res[name], out = run(engines[kind], batch, args.new_tokens, budget, clock)
        ref = ref or out
    fixed = {k: v for k, v in res.items() if k.startswith("B=")}
    best = max(fixed, key=fixed.get)
    ad, shapes, same = [], Counter(), True
    for _ in range(own.repeats):
        tok_s, out = run(engines["adaptive"], batch, args.new_tokens, max(args.budgets), clock)
        ad.append(tok_s)
        shapes += clock[1]
        same &= out == ref
    cells = "  ".join(f"{k} {v:6.0f}" for k, v in res.items())
    ratios = " ".join(f"{a / fixed[best]:.3f}" for a in ad)
    print(f"{text:<11} ×{n}  {cells}  | adaptive {' '.join(f'{a:.0f}' for a in ad)}: / best "
          f"({best}) {ratios}; lossless {same}; {dict(shapes)}", flush=True)
    return {"text": text, "batch": n, "tok_s": res, "adaptive": ad, "best": best,
            "adaptive_vs_best": [a / fixed[best] for a in ad], "shapes": dict(shapes),
            "lossless": same}


if __name__ == "__main__":
    main()
