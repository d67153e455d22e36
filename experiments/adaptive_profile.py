"""The adaptive policy's host work per step, profiled: the demo pair on the CPU, predictable
text, one request of 64 tokens, five requests after two warm ones (cProfile).

    PYTHONPATH=.:bench python experiments/adaptive_profile.py

Prints the engine step's and the policy's (to_draft, shape, observe_step) cumulative seconds
and the policy's share of the step.
"""

from __future__ import annotations

import cProfile
import pstats

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.types import SamplingParams

POLICY = ("to_draft", "shape", "observe_step")


def main() -> None:
    args = bench_adaptive.parse(["--batch", "1"])
    engines, tok = bench_adaptive.build(args)
    engine, params = engines["adaptive"], SamplingParams(max_tokens=64, ignore_eos=True)
    batch = bench_adaptive.prompts(tok, "predictable", 1, 1024)
    for _ in range(2):
        engine.generate(batch, params, budget=63)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        engine.generate(batch, params, budget=63)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    cum = {}
    for (path, _line, name), (_cc, calls, _tt, ct, _callers) in stats.items():
        if path.endswith("engine/engine.py") and name == "step":
            cum["step"] = (calls, ct)
        if path.endswith("engine/adaptive.py") and name in POLICY:
            cum[name] = (calls, ct)
    policy = sum(ct for name, (_, ct) in cum.items() if name in POLICY)
    for name, (calls, ct) in cum.items():
        print(f"{name:<13} {calls:4d} calls {ct * 1e3:8.1f} ms")
    print(f"policy / step: {policy / cum['step'][1]:.1%}")


if __name__ == "__main__":
    main()
