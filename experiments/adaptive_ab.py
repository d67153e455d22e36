"""A/B of one request, novel text, 1k context, demo pair on the CPU: fixed DDTree budget 15 vs
adaptive speculation (bound 63), alternated three times; prints tok/s and, per step, (shape,
tree size, commit_len, ms).

    PYTHONPATH=.:bench python experiments/adaptive_ab.py   # bench_adaptive from bench/
"""

from __future__ import annotations

import time

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.types import SamplingParams


def run(engine, prompt: list[int], budget: int) -> tuple[float, list[tuple]]:
    records: list = []
    engine.on_step = lambda _rid, step: records.append(step)
    engine.add_request(f"ab-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=64, ignore_eos=True), budget=budget)
    rows, t_start = [], time.perf_counter()
    while engine.has_unfinished:
        before, t0 = len(records), time.perf_counter()
        engine.step()
        ms = round((time.perf_counter() - t0) * 1e3, 1)
        s = records[-1] if len(records) > before else None
        rows.append((s.shape, s.tree_size, s.commit_len, ms) if s else ("prefill", 0, 0, ms))
    engine.on_step = None
    return 64 / (time.perf_counter() - t_start), rows


def main() -> None:
    args = bench_adaptive.parse(["--texts", "novel", "--batch", "1"])
    engines, tok = bench_adaptive.build(args)
    prompt = bench_adaptive.prompts(tok, "novel", 1, 1024)[0]
    for name, budget in [("fixed", 15), ("adaptive", 63)] * 3:
        tok_s, rows = run(engines[name], prompt, budget)
        print(f"{name} {tok_s:.1f} tok/s, prefill {rows[0][3]} ms")
        print("  ", rows[1:])


if __name__ == "__main__":
    main()
