"""Where a step's host time goes, by phase: the chain vs fixed budgets vs adaptive (held / every
step).

    PYTHONPATH=.:bench python experiments/adaptive_phases.py --device cuda --dtype bfloat16 \
        --out phases.json [--random-pair /tmp/pair8b --text novel]

On the H200 the demo pair's steps are host-bound and adaptive ran 0.76–0.88× the best fixed
budget at batch 8 (BENCHMARKS.md, "Run 5") while committing as much per step. This wraps the
engine's phases in wall-clock timers (no synchronisation added: a phase that waits on the GPU
shows the wait) and runs the same greedy requests through each variant (two warm generations,
then `--repeats` timed), printing µs per decode step by phase and the steps' batch sizes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import bench_adaptive  # bench/: it builds the engines and the prompts
from adaptive_policy_us import COUNT as CALLS  # experiments/: its wall-clock timers
from adaptive_policy_us import SECONDS as TOTAL
from adaptive_policy_us import _timed as wrap

from specserve.drafters.dflash import DFlashDrafter
from specserve.engine import adaptive, engine, postprocess, speculative
from specserve.types import SamplingParams

PHASES = [(engine.Engine, "step"), (engine.Engine, "_schedule"), (engine.Engine, "_draft_plan"),
          (adaptive.Adaptive, "to_draft"), (speculative, "plan"), (DFlashDrafter, "draft"),
          (DFlashDrafter, "_trees"), (adaptive.Adaptive, "shape"), (engine.Engine, "_run"),
          (postprocess, "commit_trees"), (adaptive.Adaptive, "observe_step"),
          (postprocess, "end_chunks"), (postprocess, "settle_trees"),
          (engine.Engine, "_observe_cost"), (adaptive.Adaptive, "_shape"),
          (adaptive.Adaptive, "_skipping"), (adaptive.Adaptive, "book_pending")]


def run(eng, batch, budget: int, new: int, repeats: int) -> dict:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for _ in range(2):
        eng.generate(batch, params, budget=budget)
    sizes: Counter = Counter()
    eng.on_step = lambda _rid, s: sizes.update([1])
    TOTAL.clear()
    CALLS.clear()
    t0 = time.perf_counter()
    for _ in range(repeats):
        eng.generate(batch, params, budget=budget)
    wall = time.perf_counter() - t0
    eng.on_step = None
    steps = CALLS["step"]
    return {"steps": steps, "tok_s": repeats * len(batch) * new / wall,
            "request_steps_per_step": sum(sizes.values()) / max(steps, 1),
            "us_per_step": {k: TOTAL[k] / steps * 1e6 for k in TOTAL},
            "calls_per_step": {k: CALLS[k] / steps for k in CALLS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--text", default="predictable")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random-pair", default=None, metavar="DIR",
                    help="bench_adaptive's random pair (speculation cannot pay), not the demo's")
    ap.add_argument("--tiny", action="store_true", help="with --random-pair: its small shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bargs = bench_adaptive.parse(["--device", args.device, "--dtype", args.dtype,
                                  "--contexts", str(args.context), "--redecide", "1"])
    if args.random_pair:
        bargs.model, bargs.draft_model = bench_adaptive.random_pair(
            args.random_pair, args.tiny, args.device)
    engines, tok = bench_adaptive.build(bargs)
    for owner, name in PHASES:
        wrap(owner, name, name)
    out = []
    for n in args.batch:
        batch = bench_adaptive.prompts(tok, args.text, n, args.context)
        for name, eng, budget in [("AR", "fixed", 0), ("chain 15", "chain", 15),
                                  ("B=15", "fixed", 15), ("B=31", "fixed", 31),
                                  ("B=63", "fixed", 63), ("adaptive", "adaptive", 63),
                                  ("adaptive every step", "adaptive-r", 63)]:
            r = run(engines[eng], batch, budget, args.new_tokens, args.repeats)
            r.update(name=name, batch=n)
            out.append(r)
            us = "  ".join(f"{k} {v:.0f}" for k, v in r["us_per_step"].items())
            print(f"×{n} {name:<20} {r['tok_s']:8.0f} tok/s {r['steps']:4d} steps "
                  f"{r['request_steps_per_step']:.2f} req/step | µs/step: {us}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
