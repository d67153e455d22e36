"""Step by step, adaptive against the fixed budget B=63 on the same engine build: each step's
phase times (µs) with what it carried (requests, rows span, nodes asked of the drafter and
verified, prefill chunks), to find where an adaptive step spends more than the fixed one's
beyond the policy's own calls (experiments/adaptive_policy_us.py). Demo pair, 1k context,
128 new tokens, three timed generations after two warm.

    PYTHONPATH=.:bench:experiments python experiments/adaptive_step_trace.py --device cuda \
        --dtype bfloat16 --batch 8 --text predictable --out /tmp/trace.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import adaptive_policy_us  # experiments/: its timers
import bench_adaptive  # bench/: it builds the engines and the prompts
from _e2e_common import host_probe_us  # bench/: the host's own speed

from specserve.engine import engine, postprocess
from specserve.types import SamplingParams

PHASES = ("_run",)  # and _draft_plan, wrapped in main
CURRENT = adaptive_policy_us.SECONDS  # this step's seconds by phase


def _steps(eng, prompts, params) -> list[dict]:
    out, step = [], engine.Engine.step

    def traced(self):
        CURRENT.clear()
        t0 = time.perf_counter()
        got = step(self)
        row = {k: round(v * 1e6) for k, v in CURRENT.items()}
        row["step"] = round((time.perf_counter() - t0) * 1e6)
        plans = getattr(self, "_last_plans", [])
        row["n"], row["asked"] = len(plans), sorted({p.budget for p in plans})
        row["nodes"] = sorted({p.tree.n for p in plans})
        row["prefill"] = bool(self.last_step is not None and self.last_step.prefill)
        out.append(row)
        return got

    engine.Engine.step = traced
    try:
        for _ in range(3):
            eng.generate(prompts, params, budget=63)
            out.append({"probe_us": round(host_probe_us(5), 1), "prefill": True, "n": 0})
    finally:
        engine.Engine.step = step
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--text", default="predictable")
    ap.add_argument("--out", default=None)
    ap.add_argument("--order", default="fixed,adaptive,fixed,adaptive",
                    help="the engines' passes, in order")
    args = ap.parse_args()
    for name in PHASES:
        adaptive_policy_us._timed(engine.Engine, name, name)
    adaptive_policy_us._timed(postprocess, "commit_trees", "commit_trees")
    plan = engine.Engine._draft_plan

    def keep(self, work):  # the step's plans, for the trace
        got = plan(self, work)
        self._last_plans = got[0]
        return got

    engine.Engine._draft_plan = keep
    adaptive_policy_us._timed(engine.Engine, "_draft_plan", "_draft_plan")
    engines, tok = bench_adaptive.build(bench_adaptive.parse(
        ["--batch", str(args.batch), "--device", args.device, "--dtype", args.dtype]))
    gc.collect()
    gc.freeze()
    prompts = bench_adaptive.prompts(tok, args.text, args.batch, 1024)
    params, rows = SamplingParams(max_tokens=128, ignore_eos=True), []
    for name in args.order.split(","):
        for _ in range(2):
            engines[name].generate(prompts, params, budget=63)
        rows.append((name, _steps(engines[name], prompts, params)))
    for name, steps in rows:
        decode = [s for s in steps if not s["prefill"] and s["n"]]
        med = {k: statistics.median(s.get(k, 0) for s in decode)
               for k in ("step", "_draft_plan", "_run", "commit_trees")}
        print(f"{name}: {len(decode)} decode steps, medians {med}")
        for s in sorted(decode, key=lambda s: -s["step"])[:6]:
            print("   slow:", s)
        print("   first 12:", [(s["step"], s["n"], s["asked"], s["nodes"])
                                 for s in steps[:12] if "asked" in s])
        print("   host probe µs after each generation:",
              [s["probe_us"] for s in steps if "probe_us" in s])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
