"""The adaptive policy's host work per engine step, in µs, by call: wall-clock timers around
`Adaptive`'s methods (no profiler overhead), the demo pair on the CPU, 1k context, 64 new
tokens, predictable and novel text at batch 1 and 8 (two warm generations, three timed).

    PYTHONPATH=.:bench python experiments/adaptive_policy_us.py

On a GPU a demo-pair step is 2–3 ms, so these µs are the policy's share of it there.
"""

from __future__ import annotations

import collections
import time

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.engine import adaptive, engine
from specserve.types import SamplingParams

CALLS = ("to_draft", "draft_budgets", "shape", "observe_step", "skipped", "_shape", "_keep")
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
    for name in CALLS:
        if hasattr(adaptive.Adaptive, name):  # older commits lack some
            _timed(adaptive.Adaptive, name)
    _timed(engine.Engine, "step")
    _timed(engine.Engine, "_observe_cost")
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for batch in (1, 8):
        engines, tok = bench_adaptive.build(bench_adaptive.parse(["--batch", str(batch)]))
        eng = engines["adaptive"]
        for text in ("predictable", "novel"):
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
