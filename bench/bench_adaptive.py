"""Adaptive speculation vs every fixed budget vs the chain vs plain decoding, in one run.

    python bench/bench_adaptive.py                       # the demo pair on the CPU
    python bench/bench_adaptive.py --device cuda --dtype bfloat16 --out adaptive.json
    python bench/bench_adaptive.py --model T --draft-model D --texts novel
    python bench/bench_adaptive.py --random-pair /tmp/pair8b --device cuda --dtype bfloat16

Builds one target and one DFlash drafter and, over them, three warmed engines: fixed budgets
(DDTree), the same drafter's argmax chain, and adaptive speculation (`EngineConfig.adaptive`,
the largest budget as its bound). For each text (predictable: the seed's repeated sentence;
novel: held-out stdlib sources; mix: half of each) and batch size it runs the same greedy
requests through every variant, the variants interleaved and repeated (`--warm-rounds`
untimed, then `--repeats`; each round starts one variant further along, so no variant always
runs last; a full garbage collection before each run, the objects alive after the build
frozen as the services do; the table gives the median, and adaptive / best fixed also round
by round, where drift common to a round cancels), and checks every variant's tokens equal
plain decoding's. Prints a table of tokens/s with adaptive / best fixed, adaptive / AR and
best tree / chain; writes JSON.
`--random-pair DIR` writes (once) and uses bench/bench_served.py's random Qwen3-8B-body pair
(`--tiny`: a small one): a drafter whose trees are never accepted, where speculation cannot pay.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from _e2e_common import host_probe_us  # bench/, beside this script

from specserve.config import EngineConfig
from specserve.demo.evaluate import novel_ids, predictable_ids
from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.engine import Engine
from specserve.engine.warmup import warm_up_drafter, warm_up_engine
from specserve.models.dflash import load_dflash
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams


@dataclass
class Run:
    tok_s: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    shapes: Counter = field(default_factory=Counter)
    lossless: bool = True  # every run's tokens equal plain decoding's

    def add(self, tok_s: float, steps) -> None:
        self.tok_s.append(tok_s)
        self.commit.append(sum(s.commit_len for s in steps) / max(len(steps), 1))
        self.shapes.update(s.shape for s in steps if s.shape)


def prompts(tok: Tokenizer, text: str, n: int, ctx: int) -> list[list[int]]:
    """`n` prompts of `ctx` tokens: predictable (shifted), novel (disjoint slices) or mixed."""
    if text == "mix":
        pred, novel = prompts(tok, "predictable", n, ctx), prompts(tok, "novel", n, ctx)
        return [(pred if i % 2 == 0 else novel)[i] for i in range(n)] if n > 1 else \
            [pred[0][: ctx // 2] + novel[0][: ctx - ctx // 2]]
    if text == "predictable":
        return [predictable_ids(tok, ctx + i)[i:] for i in range(n)]
    ids = novel_ids(tok, ctx * n + 1)
    return [ids[i * ctx : (i + 1) * ctx] for i in range(n)]


def build(args) -> tuple[dict[str, Engine], Tokenizer]:
    pages = math.ceil(args.batch_max * (max(args.contexts) + args.new_tokens + 160) / 16) + 64
    cfg = EngineConfig(args.model, dtype=args.dtype, device=args.device, num_pages=pages,
                       max_draft_tokens=max(args.budgets), max_num_seqs=args.batch_max,
                       max_num_batched_tokens=args.chunk)
    first = Engine(cfg)
    draft_model = load_dflash(args.draft_model, args.model, args.dtype, args.device)
    engines = {"fixed": first,
               "chain": Engine(cfg, model=first.runner.model, tokenizer=first.tokenizer),
               "adaptive": Engine(cfg.with_(adaptive=True), model=first.runner.model,
                                  tokenizer=first.tokenizer)}
    if args.redecide is not None:
        engines["adaptive-r"] = Engine(cfg.with_(adaptive=True), model=first.runner.model,
                                       tokenizer=first.tokenizer)
        engines["adaptive-r"].adaptive.redecide = args.redecide
    for name, engine in engines.items():
        drafter = DFlashDrafter(draft_model, num_pages=pages, tree=name != "chain")
        warm_up_drafter(drafter)
        engine.set_drafter(drafter)
        warm_up_engine(engine)
    return engines, first.tokenizer


def generate(engine: Engine, batch: list[list[int]], new: int, budget: int):
    steps: list = []
    engine.on_step = lambda _rid, s: steps.append(s)
    t0 = time.perf_counter()
    out = engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True), budget=budget)
    wall = time.perf_counter() - t0
    engine.on_step = None
    return out, sum(map(len, out)) / wall, steps


def variants(args) -> list[tuple[str, str, int]]:
    chain = args.chain_budget
    return ([("AR", "fixed", 0), (f"chain {chain}", "chain", chain)]
            + [(f"B={b}", "fixed", b) for b in args.budgets]
            + [(f"adaptive ≤{max(args.budgets)}", "adaptive", max(args.budgets))]
            + ([(f"adaptive ≤{max(args.budgets)} redecide {args.redecide}", "adaptive-r",
                 max(args.budgets))] if args.redecide is not None else []))


def measure(engines, tok, args) -> list[dict]:
    rows = []
    for ctx in args.contexts:
        for text in args.texts:
            for n in args.batch:
                runs, spreads, retaken = _rounds(engines, prompts(tok, text, n, ctx), args)
                rows.append(summarise(ctx, text, n, runs)
                            | {"host_spread": spreads, "retaken_rounds": retaken})
                print(line(rows[-1]), flush=True)
    return rows


def _rounds(engines, batch, args) -> tuple[dict[str, Run], list[float], int]:
    """Every variant over `batch`: `--warm-rounds` untimed, then `--repeats` timed rounds (the
    order rotated). The host's speed is probed before each run and after the round; with
    `--steady-host X` a timed round whose probes spread more than X × is dropped and run again
    (at most `--repeats` times). Returns the runs, each kept round's spread, the retakes."""
    runs = {name: Run() for name, _, _ in variants(args)}
    reference, spreads, retaken, i = None, [], 0, 0
    while i < args.warm_rounds + args.repeats:
        got, probes = {}, []
        for name, eng, budget in _rotated(variants(args), i + retaken):
            gc.collect()  # not inside the next variant's timing
            probes.append(host_probe_us())
            out, tok_s, steps = generate(engines[eng], batch, args.new_tokens, budget)
            reference = reference if reference is not None else out
            runs[name].lossless &= out == reference
            got[name] = (tok_s, steps)
        probes.append(host_probe_us())  # and after the round's last run
        spread = max(probes) / min(probes)
        timed = i >= args.warm_rounds  # else untimed: the batch's first pass
        if timed and args.steady_host and spread > args.steady_host and retaken < args.repeats:
            retaken += 1
            continue
        for name, (tok_s, steps) in got.items() if timed else ():
            runs[name].add(tok_s, steps)
        spreads += [round(spread, 3)] if timed else []
        i += 1
    return runs, spreads, retaken


def _rotated(items: list, i: int) -> list:
    """Round `i`'s order: the list started at its (i mod len)-th item."""
    k = i % len(items)
    return items[k:] + items[:k]


def summarise(ctx, text, n, runs: dict[str, Run]) -> dict:
    med = {k: statistics.median(r.tok_s) for k, r in runs.items()}
    fixed = {k: v for k, v in med.items() if k.startswith("B=")}
    best = max(fixed, key=fixed.get)
    adaptive = next(k for k in med if k.startswith("adaptive"))
    chain = next(k for k in med if k.startswith("chain"))
    paired = sorted(a / b for a, b in zip(runs[adaptive].tok_s, runs[best].tok_s, strict=True))
    return {"context": ctx, "text": text, "batch": n, "tok_s": med,
            "tok_s_all": {k: r.tok_s for k, r in runs.items()},
            "mean_commit": {k: statistics.median(r.commit) for k, r in runs.items()},
            "adaptive_shapes": dict(runs[adaptive].shapes),
            "lossless": all(r.lossless for r in runs.values()),
            "lossless_by_variant": {k: r.lossless for k, r in runs.items()},
            "best_fixed": best, "adaptive_vs_best": med[adaptive] / fixed[best],
            # round by round (the variants of a round run back to back): drift cancels
            "adaptive_vs_best_paired": statistics.median(paired),
            "adaptive_vs_best_paired_range": [paired[0], paired[-1]],
            "adaptive_vs_ar": med[adaptive] / med["AR"],
            "best_tree_vs_chain": fixed[best] / med[chain]}


def line(row: dict) -> str:
    cells = "  ".join(f"{k} {v:7.1f}" for k, v in row["tok_s"].items())
    return (f"{row['context']:>6} {row['text']:<11} ×{row['batch']:<2} {cells}  | adaptive/best "
            f"{row['adaptive_vs_best']:.3f} ({row['best_fixed']}; paired "
            f"{row['adaptive_vs_best_paired']:.3f}, "
            f"{'–'.join(f'{x:.2f}' for x in row['adaptive_vs_best_paired_range'])}), /AR "
            f"{row['adaptive_vs_ar']:.3f}, tree/chain {row['best_tree_vs_chain']:.3f}, lossless "
            f"{'yes' if row['lossless'] else _differ(row)}, shapes {row['adaptive_shapes']}, "
            f"host spread ≤ {max(row['host_spread'], default=1):.2f} "
            f"({row['retaken_rounds']} rounds run again)")


def _differ(row: dict) -> str:
    return "NO: " + ", ".join(k for k, ok in row["lossless_by_variant"].items() if not ok)


def table(rows: list[dict]) -> str:
    names = list(rows[0]["tok_s"])
    head = ("| ctx | text | batch | " + " | ".join(names)
            + " | adaptive / best fixed | adaptive / AR | best tree / chain | lossless |")
    out = [head, "|" + "---|" * (len(names) + 7)]
    for r in rows:
        cells = " | ".join(f"{r['tok_s'][k]:.1f}" for k in names)
        out.append(f"| {r['context']} | {r['text']} | {r['batch']} | {cells} | "
                   f"{r['adaptive_vs_best']:.3f} ({r['best_fixed']}) | {r['adaptive_vs_ar']:.3f}"
                   f" | {r['best_tree_vs_chain']:.3f} | {'yes' if r['lossless'] else 'NO'} |")
    return "\n".join(out)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/demo-target")
    ap.add_argument("--draft-model", default="checkpoints/demo-drafter")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--texts", nargs="+", default=["predictable", "novel", "mix"],
                    choices=["predictable", "novel", "mix"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[3, 7, 15, 31, 63])
    ap.add_argument("--chain-budget", type=int, default=15, help="the chain's most nodes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-rounds", type=int, default=1,
                    help="untimed rounds of every variant first (lossless still checked)")
    ap.add_argument("--chunk", type=int, default=2048, help="max-num-batched-tokens")
    ap.add_argument("--steady-host", type=float, default=None, metavar="X",
                    help="run a timed round again when the host's speed (a pure-Python probe "
                         "before each run) spread more than X × within it, e.g. 1.15")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redecide", type=int, default=None, metavar="N",
                    help="also an adaptive engine that weighs every shape each N steps (1: every "
                         "step), beside the default's")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--random-pair", default=None, metavar="DIR",
                    help="write and use the random 8B-body pair here (replaces --model)")
    ap.add_argument("--tiny", action="store_true", help="with --random-pair: a small shape")
    args = ap.parse_args(argv)
    args.batch_max = max(args.batch)
    return args


def random_pair(where: str, tiny: bool, device: str) -> tuple[str, str]:
    """(target, drafter) directories of bench_served's random pair, written once to `where`."""
    from pathlib import Path

    from _served_models import BODY_8B, TINY, write_pair  # bench/, beside this script

    taps = (1, 3) if tiny else (1, 9, 17, 25, 33)
    return tuple(map(str, write_pair(Path(where), TINY if tiny else BODY_8B, taps,
                                     device=device)))


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    if args.random_pair:
        args.model, args.draft_model = random_pair(args.random_pair, args.tiny, args.device)
    t0 = time.perf_counter()
    engines, tok = build(args)
    gc.collect()
    gc.freeze()  # as the services do once started: collections skip the models and graphs
    print(f"built and warmed 3 engines in {time.perf_counter() - t0:.1f} s "
          f"({engines['fixed'].runner.device_name})", flush=True)
    rows = measure(engines, tok, args)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": engines["fixed"].runner.device_name, "args": vars(args),
                       "rows": rows, "cost_model_ms": engines["adaptive"].cost.table()}, f,
                      indent=1)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
