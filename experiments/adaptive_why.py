"""Per-step reasons of adaptive speculation beside the fixed budget and the chain: one request
(or a batch) on each text, the variants alternated; prints tok/s, each fixed run's commits and
each adaptive step's (shape, nodes, commit_len, why), then the cost model's table.

    PYTHONPATH=.:bench python experiments/adaptive_why.py --texts novel --batch 1
    PYTHONPATH=.:bench python experiments/adaptive_why.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.types import SamplingParams


def run(engine, batch: list[list[int]], new: int, budget: int):
    records: list = []
    engine.on_step = lambda _rid, step: records.append(step)
    t0 = time.perf_counter()
    engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True), budget=budget)
    tok_s = new * len(batch) / (time.perf_counter() - t0)
    engine.on_step = None
    return tok_s, records


def show(name: str, tok_s: float, records: list, batch: int) -> None:
    print(f"  {name:<9} {tok_s:8.1f} tok/s  steps/request {len(records) / batch:.1f}  "
          f"mean commit {sum(r.commit_len for r in records) / max(len(records), 1):.2f}")
    if name != "adaptive":
        print("    commits", [r.commit_len for r in records][:48])
        return
    if batch > 1:
        print("    shapes", dict(Counter(r.shape for r in records)))
    for r in records[: 40 if batch == 1 else 16]:
        print(f"    {r.shape:<5} n={r.tree_size:<3} commit={r.commit_len:<2} {r.why}")


def main(argv=None) -> None:
    args = bench_adaptive.parse(argv)
    engines, tok = bench_adaptive.build(args)
    for ctx in args.contexts:
        for text in args.texts:
            for n in args.batch:
                print(f"== ctx {ctx} {text} × {n}", flush=True)
                batch = bench_adaptive.prompts(tok, text, n, ctx)
                for name, budget in [("AR", 0), ("fixed", 63), ("chain", 15),
                                     ("adaptive", 63)] * 2:
                    eng = "fixed" if name == "AR" else name
                    show(name, *run(engines[eng], batch, args.new_tokens, budget), n)
    for k, v in engines["adaptive"].cost.table().items():
        print(f"  {k}: {v:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
