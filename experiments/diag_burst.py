"""What each engine step of a burst of requests costs, in process (issue 23 diagnostic).

Writes bench_served's random pair (the Qwen3-8B body; `--tiny`: tiny shapes on the CPU), builds
the verifier's engine with the in-process DFlash drafter as `bench/bench_served.py` does, then
for each context runs `--rounds` bursts of `--batch` requests added at once and records every
engine step of the first `--steps`: wall ms, its draft / verify / commit split (the step's
`StepTimes`), the prefill tokens it carried, the requests it decoded and the drafter's call
(new context rows, forward and tree ms). Shows whether a burst's first decode step is slow
(its context rows, a shape met the first time) and whether the second burst pays it again.

    PYTHONPATH=.:bench python3 experiments/diag_burst.py [--contexts 1024,4096] [--out F]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _served_models import BODY_8B, TAPS_8B, TINY, write_pair
from _served_run import build_engine

from services.verifier.config import VerifierConfig
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams


def step_row(engine, wall_s: float) -> dict:
    t, d = engine.last_step, engine.drafter.last_stats
    row = dict(ms=wall_s * 1e3, prefill_tokens=sum(n for _, _, n in t.prefill) if t else 0,
               decoding=len(engine.scheduler.running))
    if t is not None:
        row.update(draft_ms=(t.draft_end_ns - t.start_ns) / 1e6,
                   verify_ms=(t.verify_end_ns - t.draft_end_ns) / 1e6,
                   commit_ms=(t.end_ns - t.verify_end_ns) / 1e6)
    if d is not None:
        row.update(context_rows=d.context_rows, forward_ms=d.forward_s * 1e3,
                   tree_ms=d.tree_s * 1e3)
    return row


def burst(engine, prompts, new: int, budget: int, steps: int) -> list[dict]:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"burst-{time.monotonic_ns()}-{i}", p, params, budget)
    rows = []
    while engine.has_unfinished:
        engine.drafter.last_stats = None
        t0 = time.perf_counter()
        engine.step()
        if len(rows) < steps:
            rows.append(step_row(engine, time.perf_counter() - t0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    ckpt = Path(tempfile.gettempdir()) / ("specserve-bench-pair" + ("-tiny" if args.tiny else ""))
    model, draft = map(str, write_pair(ckpt, TINY if args.tiny else BODY_8B,
                                       (1, 3) if args.tiny else TAPS_8B, device=dev, log=print))
    vcfg = VerifierConfig(model, device=dev, draft_model=draft, drafter="in-process",
                          kv_memory_gb=0.05 if args.tiny else 24.0,
                          max_num_batched_tokens=args.chunk)
    engine = build_engine(vcfg, draft, 256 if args.tiny else 16384, warmup=not args.tiny)
    base = Tokenizer.from_dir(model).encode("The cat sat on the mat. " * 64)
    out = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        prompts = [((base[i:] + base) * (ctx // len(base) + 2))[:ctx] for i in range(args.batch)]
        for r in range(args.rounds):
            rows = burst(engine, prompts, args.new_tokens, 15, args.steps)
            out.append(dict(ctx=ctx, round=r, steps=rows))
            print(f"ctx {ctx} round {r}")
            for row in rows:
                print("  " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
