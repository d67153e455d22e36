"""Where a batch-8 step's host time goes: fixed budgets vs adaptive, the demo pair on the CPU.

    PYTHONPATH=.:bench python experiments/adaptive_host_b8.py [--text predictable] [--batch 8]

On the H200 the demo pair's step is host-bound (a 1k verify of 8 trees is ~2 ms on the GPU, the
step 10–17 ms) and adaptive ran 0.76–0.88× the best fixed budget at batch 8. This profiles the
same requests through each engine (cProfile, two warm generations first) and prints, per decode
step, the step's cumulative ms, the target's and the drafter's model forwards, the rest (host
work), and the specserve functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.types import SamplingParams

MODEL = (("engine/runner.py", "run_local"), ("drafters/dflash.py", "draft_logits"))


def profile(engine, batch, budget: int, new: int) -> pstats.Stats:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for _ in range(2):
        engine.generate(batch, params, budget=budget)
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(batch, params, budget=budget)
    prof.disable()
    return pstats.Stats(prof)


def report(name: str, stats: pstats.Stats, top: int) -> None:
    st = stats.stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    cum = {}
    for (path, _line, fn), (_cc, calls, _tt, ct, _callers) in st.items():
        if path.endswith("engine/engine.py") and fn == "step":
            cum["step"] = (calls, ct)
        for suffix, want in MODEL:
            if path.endswith(suffix) and fn == want:
                cum[want] = (calls, ct)
    steps = cum["step"][0]
    model = sum(cum.get(w, (0, 0.0))[1] for _, w in MODEL)
    parts = "  ".join(f"{k} {ct / steps * 1e3:6.2f}" for k, (_c, ct) in cum.items())
    print(f"\n== {name}: {steps} steps; ms/step: {parts}  host rest "
          f"{(cum['step'][1] - model) / steps * 1e3:6.2f}")
    own = sorted(((tt, fn, path, nc) for (path, _l, fn), (_cc, nc, tt, _ct, _c) in st.items()
                  if "specserve" in path or "numpy" in path), reverse=True)[:top]
    for tt, fn, path, nc in own:
        print(f"   {tt / steps * 1e6:8.1f} µs/step  {nc / steps:6.1f} calls  "
              f"{path.split('specserve/')[-1]}:{fn}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default="predictable")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    bargs = bench_adaptive.parse(["--batch", str(args.batch), "--contexts", str(args.context)])
    engines, tok = bench_adaptive.build(bargs)
    batch = bench_adaptive.prompts(tok, args.text, args.batch, args.context)
    for name, eng, budget in [("B=15", "fixed", 15), ("B=63", "fixed", 63),
                              ("adaptive ≤63", "adaptive", 63)]:
        report(name, profile(engines[eng], batch, budget, args.new_tokens), args.top)


if __name__ == "__main__":
    main()
