"""How far overlapping drafting with verifying could take a step, from measured step parts.

Issue 23 item 4 asks the served path to go below the in-process serial step by overlapping the
drafter with the target. The two ways it names have ideal forms whose gain follows from two
numbers per batch size B, both measured here on the in-process engine (random Qwen3-8B-body
pair of bench/bench_served.py, budget 15, fixed-budget trees, the verifier's warm-up):

  V(B)  a decode step without its drafting (schedule, the verify forward, accept, commit);
  D(B)  its drafting (the DFlash forward and trees of B requests).

The serial step costs V(B) + D(B) for B requests. Two groups taking turns (`--overlap on`):
each step verifies B/2 requests while the drafter drafts the other B/2, at best
max(V(B/2), D(B/2)) a step with nothing slowed by the other — so a request waits two of them:

  alternation / serial tok/s ≤ (V(B) + D(B)) / (2 · max(V(B/2), D(B/2)))

Drafts made ahead for the verify's likely outcomes (SSD-style), every one a hit and free:

  pre-drafted / serial tok/s ≤ (V(B) + D(B)) / V(B)

Prints both bounds per (context, B) and writes JSON. In process only: the services add their
hops on top (bench/bench_served.py measures those).

    PYTHONPATH=.:bench python3 experiments/overlap_bound.py --out $OUT/overlap_bound.json
    PYTHONPATH=.:bench python3 experiments/overlap_bound.py --tiny     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _served_models import BODY_8B, TAPS_8B, TINY, write_pair
from _served_run import build_engine
from bench_served import TEXT, shifted_prompt


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--contexts", default="1024,4096")
    add("--batches", default="1,2,4,8", help="batch sizes; each even one is also priced halved")
    add("--new-tokens", type=int, default=48)
    add("--budget", type=int, default=15)
    add("--kv-memory-gb", type=float, default=24.0)
    add("--drafter-pages", type=int, default=16384)
    add("--tiny", action="store_true", help="a tiny random pair on the CPU (smoke run)")
    add("--out", default="overlap_bound.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.kv_memory_gb, args.drafter_pages = 0.05, 256
    return args


def step_parts(engine, prompts: list[list[int]], new: int, budget: int) -> dict:
    """Median ms of the steady steps (every request decoding, none within a block of its
    end) of one batch: the step's wall, its drafting D and the rest V."""
    from specserve.types import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params, budget)
    walls, drafts = [], []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outs = engine.step()
        wall, t = (time.perf_counter() - t0) * 1e3, engine.last_step
        steady = t is not None and not t.prefill and len(outs) == len(prompts) and all(
            not o.finished and o.stats is not None and o.stats.step is not None
            and o.stats.step.tree_size == budget for o in outs)
        if steady:
            walls.append(wall)
            drafts.append((t.draft_end_ns - t.start_ns) / 1e6)
    if len(walls) < 4:
        raise RuntimeError(f"{len(walls)} steady steps of {len(prompts)} requests: "
                           "raise --new-tokens")
    wall, draft = statistics.median(walls), statistics.median(drafts)
    return dict(steps=len(walls), wall_ms=wall, draft_ms=draft, verify_ms=wall - draft)


def bounds(parts: dict[int, dict]) -> list[dict]:
    """The two ideal overlaps' tok/s over the serial step's, per batch size."""
    rows = []
    for b, p in sorted(parts.items()):
        serial = p["verify_ms"] + p["draft_ms"]
        half = parts.get(b // 2) if b % 2 == 0 else None
        alt = (serial / (2 * max(half["verify_ms"], half["draft_ms"]))) if half else None
        rows.append(dict(batch=b, serial_ms=serial, verify_ms=p["verify_ms"],
                         draft_ms=p["draft_ms"], alternation_bound=alt,
                         predraft_bound=serial / p["verify_ms"]))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    from services.verifier.server import VerifierConfig
    from specserve.tokenizer import Tokenizer

    device = "cpu" if args.tiny else "cuda"
    root = Path(tempfile.gettempdir()) / ("overlap-bound-pair" + ("-tiny" if args.tiny else ""))
    model, draft = map(str, write_pair(root, TINY if args.tiny else BODY_8B,
                                       (1, 3) if args.tiny else TAPS_8B, device=device))
    vcfg = VerifierConfig(model, device=device, draft_model=draft, drafter="in-process",
                          kv_memory_gb=args.kv_memory_gb, default_budget=args.budget)
    engine = build_engine(vcfg, draft, args.drafter_pages, warmup=not args.tiny)
    base = Tokenizer.from_dir(model).encode(TEXT * 64)
    out = dict(args=vars(args), rows=[])
    for ctx in (int(c) for c in args.contexts.split(",")):
        once = [shifted_prompt(base, 0, ctx)]
        step_parts(engine, once, 4 + args.budget, args.budget)  # this context's shapes
        parts = {b: step_parts(engine, [shifted_prompt(base, i, ctx) for i in range(b)],
                               args.new_tokens, args.budget)
                 for b in map(int, args.batches.split(","))}
        for row in bounds(parts):
            out["rows"].append(dict(ctx=ctx, **row, steps=parts[row["batch"]]["steps"]))
            print(_line(out["rows"][-1]), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def _line(r: dict) -> str:
    alt = "-" if r["alternation_bound"] is None else f"{r['alternation_bound']:.3f}"
    return (f"ctx {r['ctx']:>6} x{r['batch']}: serial {r['serial_ms']:.2f} ms = V "
            f"{r['verify_ms']:.2f} + D {r['draft_ms']:.2f}; alternation <= {alt} x, "
            f"pre-drafted <= {r['predraft_bound']:.3f} x serial tok/s ({r['steps']} steps)")


if __name__ == "__main__":
    raise SystemExit(main())
