"""The adaptive policy's host work per engine step, in µs, by call: wall-clock timers around
`Adaptive`'s methods (no profiler overhead), the demo pair on the CPU, 1k context, 64 new
tokens, predictable and novel text at batch 1 and 8 (two warm generations, three timed).

    PYTHONPATH=.:bench python experiments/adaptive_policy_us.py
    PYTHONPATH=.:bench:experiments python experiments/adaptive_policy_us.py \
        --random-pair /tmp/pairtiny --texts novel --plain   # every step plainly decoded

`--random-pair DIR`: the tiny random pair (bench_adaptive writes it if missing); `--plain`: the
cost model frozen to a 100-ms drafter (experiments/adaptive_sim.py), so plain decoding wins.

On a GPU a demo-pair step is 2–3 ms, so these µs are the policy's share of it there.
"""

from __future__ import annotations

import argparse
import collections
import time

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.engine import adaptive, engine
from specserve.types import SamplingParams

CALLS = ("to_draft", "draft_budgets", "shape", "observe_step", "book_pending", "skipped", "_shape",
         "_keep")
SECONDS: dict[str, float] = collections.defaultdict(float)
COUNT: collections.Counter = collections.Counter()


def _timed(cls, name: str) -> None:
    inner = getattr(cls, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - t0
            COUNT[name] += 1

    setattr(cls, name, call)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-pair", default=None, metavar="DIR")
    ap.add_argument("--texts", nargs="+", default=["predictable", "novel"])
    ap.add_argument("--plain", action="store_true", help="a drafter too dear to ever pay")
    args = ap.parse_args()
    pair = ["--random-pair", args.random_pair, "--tiny"] if args.random_pair else []
    for name in CALLS:
        if hasattr(adaptive.Adaptive, name):  # older commits lack some
            _timed(adaptive.Adaptive, name)
    _timed(engine.Engine, "step")
    _timed(engine.Engine, "_observe_cost")
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for batch in (1, 8):
        engines, tok = bench_adaptive.build(bench_adaptive.parse(pair + ["--batch", str(batch)]))
        eng = engines["adaptive"]
        if args.plain:
            from adaptive_sim import FrozenCost  # experiments/

            eng.cost = eng.adaptive.cost = FrozenCost((0.45, 0.12, 0.007, 100.0, 0.0))
        for text in args.texts:
            prompts = bench_adaptive.prompts(tok, text, batch, 1024)
            for _ in range(2):
                eng.generate(prompts, params, budget=63)
            SECONDS.clear()
            COUNT.clear()
            for _ in range(3):
                eng.generate(prompts, params, budget=63)
            steps = COUNT["step"]
            policy = sum(SECONDS[n] for n in ("to_draft", "draft_budgets", "shape",
                                              "observe_step", "skipped", "_observe_cost"))
            parts = ", ".join(f"{n} {SECONDS[n] / steps * 1e6:.0f}" for n in CALLS + (
                "_observe_cost",) if COUNT[n])
            print(f"batch {batch} {text:<11} {steps:3d} steps: policy {policy / steps * 1e6:4.0f} "
                  f"µs/step ({parts}; full decisions {COUNT['_shape']}, held {COUNT['_keep']})")


if __name__ == "__main__":
    main()
