"""The adaptive policy's host work per engine step, in µs, by call: wall-clock timers around
`Adaptive`'s methods, the per-request state's and the cost model's (no profiler overhead;
nested calls are counted in their callers too), the demo pair, 1k context, 128 new tokens,
predictable and novel text at batch 1 and 8 (two warm generations, three timed), beside the
step time of the fixed budget B=63 on the same engine build; and the garbage collector's
pauses by generation (`gc0` … `gc2`) in both.

    PYTHONPATH=.:bench python experiments/adaptive_policy_us.py
    PYTHONPATH=.:bench python experiments/adaptive_policy_us.py --device cuda --dtype bfloat16
    PYTHONPATH=.:bench:experiments python experiments/adaptive_policy_us.py \
        --random-pair /tmp/pairtiny --texts novel --plain   # every step plainly decoded

`--random-pair DIR`: the tiny random pair (bench_adaptive writes it if missing); `--plain`: the
cost model frozen to a 100-ms drafter (experiments/adaptive_sim.py), so plain decoding wins.
On the CPU a forward's `meanwhile` work (bookings) is not overlapped with anything; on a GPU it
runs while the verify forward is on the device.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.engine import adaptive, adaptive_state, cost, engine, postprocess
from specserve.types import SamplingParams

CALLS = {adaptive.Adaptive: ("to_draft", "draft_budgets", "shape", "observe_step",
                             "book_pending", "skipped", "_shape", "_keep", "_skipping", "_rated",
                             "_cut", "observe", "ahead"),
         adaptive_state.State: ("take_curve", "book_verified", "take_verified", "_gain"),
         engine.Engine: ("step", "_observe_cost", "_run", "_draft_plan"),
         cost.StepPrices: ("__call__",)}
FUNCTIONS = {adaptive: ("choose", "read_confidence"),
             postprocess: ("settle_trees", "commit_trees")}
# the policy's own calls on the engine's path (the bookings run inside `_run`'s forward)
POLICY = ("to_draft", "draft_budgets", "shape", "observe_step", "skipped", "_observe_cost")
SECONDS: dict[str, float] = collections.defaultdict(float)
COUNT: collections.Counter = collections.Counter()


def _timed(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - t0
            COUNT[label] += 1

    setattr(owner, name, call)


class _Pauses:
    """The garbage collector's pauses (gc.callbacks), as SECONDS["gc"] / COUNT["gc"]."""

    def __init__(self) -> None:
        self.t0 = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            SECONDS[f"gc{info['generation']}"] += time.perf_counter() - self.t0
            COUNT[f"gc{info['generation']}"] += 1


def _instrument() -> None:
    _Pauses()
    for cls, names in CALLS.items():
        for name in names:
            if hasattr(cls, name):  # older commits lack some
                _timed(cls, name, name if cls is not adaptive_state.State else f"State.{name}")
    for module, names in FUNCTIONS.items():
        for name in names:
            _timed(module, name, name)


def _measure(eng, prompts, params) -> dict:
    for _ in range(2):
        eng.generate(prompts, params, budget=63)
    SECONDS.clear()
    COUNT.clear()
    for _ in range(3):
        eng.generate(prompts, params, budget=63)
    steps = COUNT["step"]
    return {"steps": steps, "us_per_step": {n: SECONDS[n] / steps * 1e6 for n in SECONDS},
            "calls": dict(COUNT)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-pair", default=None, metavar="DIR")
    ap.add_argument("--texts", nargs="+", default=["predictable", "novel"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--plain", action="store_true", help="a drafter too dear to ever pay")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    pair = ["--random-pair", args.random_pair, "--tiny"] if args.random_pair else []
    _instrument()
    params, rows = SamplingParams(max_tokens=128, ignore_eos=True), []
    for batch in args.batch:
        engines, tok = bench_adaptive.build(bench_adaptive.parse(
            pair + ["--batch", str(batch), "--device", args.device, "--dtype", args.dtype]))
        gc.collect()
        gc.freeze()  # as the services and bench_adaptive do
        eng = engines["adaptive"]
        if args.plain:
            from adaptive_sim import FrozenCost  # experiments/

            eng.cost = eng.adaptive.cost = FrozenCost((0.45, 0.12, 0.007, 100.0, 0.0))
        for text in args.texts:
            prompts = bench_adaptive.prompts(tok, text, batch, 1024)
            got = _measure(eng, prompts, params)
            fixed = _measure(engines["fixed"], prompts, params)
            rows.append({"batch": batch, "text": text, "adaptive": got, "B=63": fixed})
            us, n = got["us_per_step"], got["calls"]
            policy = sum(us.get(k, 0.0) for k in POLICY)
            print(f"batch {batch} {text:<11} {got['steps']:3d} steps ({n.get('_shape', 0)} "
                  f"decisions, {n.get('_keep', 0)} held plans): step {us['step']:.0f} µs "
                  f"(B=63: {fixed['us_per_step']['step']:.0f} µs, {fixed['steps']} steps), "
                  f"policy on the path {policy:.0f} µs")
            print("    " + ", ".join(f"{k} {v:.0f}" for k, v in us.items() if k != "step"))
            print("    B=63: " + ", ".join(f"{k} {v:.0f}" for k, v in fixed["us_per_step"].items()
                                           if k[0] == "_" or "trees" in k or k[:2] == "gc"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
