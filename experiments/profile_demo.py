"""Where one speculative step of the demo pair spends its time, by context (in process).

The H200 commit probe (BENCHMARKS.md, issue 8) showed decode steps of the tiny demo pair growing
with context (17 ms at 1k → 144 ms at 128k) although every target layer attends to a 256-token
window: host work that grows with the context. This script runs the engine on the committed pair
at each context (one warm-up generation, then a timed one under cProfile) and prints ms per step
and the functions with the most own time.

    python3 experiments/profile_demo.py --device cuda --contexts 1024 131072 [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from specserve.demo.evaluate import commit_len, make_engine, novel_ids
from specserve.tokenizer import Tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="checkpoints")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tdir, ddir = Path(args.root) / "demo-target", Path(args.root) / "demo-drafter"
    tok = Tokenizer.from_dir(tdir)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = make_engine(tdir, ddir, max(args.contexts) + args.new_tokens, 16, args.device, dtype)
    rows = []
    for n in args.contexts:
        prompt = novel_ids(tok, n)
        commit_len(engine, prompt, 8)  # warm-up: compiles, allocator growth
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        r = commit_len(engine, prompt, args.new_tokens)
        prof.disable()
        wall = time.perf_counter() - t0
        step_ms = 1e3 * (wall - r["prefill_s"]) / max(1, r["steps"])
        print(f"== context {n}: {r['steps']} steps, commit_len {r['mean_commit_len']:.2f}, "
              f"prefill {r['prefill_s']:.3f} s, {step_ms:.1f} ms/step", flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue(), flush=True)
        rows.append({"context": n, "steps": r["steps"], "commit_len": r["mean_commit_len"],
                     "prefill_s": r["prefill_s"], "step_ms": step_ms})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
