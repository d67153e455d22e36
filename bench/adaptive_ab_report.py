"""Old code against new, alternated on one machine: bench_adaptive.py's JSON files of an
A/B (bench/adaptive_h200.sh ab: `adaptive_ab_<round>_<old|new>.json`) side by side — per cell
(context, text, batch) each round's adaptive / best fixed budget (paired) and the mean of each
side. Prints a markdown table; writes JSON.

    python3 bench/adaptive_ab_report.py out/adaptive_ab_*_*.json --out out/adaptive_ab.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

NAME = re.compile(r"adaptive_ab_(\d+)_(old|new)\.json$")


def load(paths: list[str]) -> list[tuple[int, str, dict]]:
    """(round, side, bench_adaptive JSON) of each file, by round; a file not named
    adaptive_ab_<round>_<old|new>.json is refused (ValueError)."""
    runs = []
    for p in paths:
        m = NAME.search(Path(p).name)
        if m is None:
            raise ValueError(f"{p}: not named adaptive_ab_<round>_<old|new>.json")
        runs.append((int(m.group(1)), m.group(2), json.loads(Path(p).read_text())))
    return sorted(runs, key=lambda r: r[0])


def cells(runs: list[tuple[int, str, dict]]) -> list[dict]:
    """Per cell: its key, each round's paired ratio (None where that run lacks the cell) and
    each side's mean over the rounds that have it."""
    ratios = [{(r["context"], r["text"], r["batch"]): r["adaptive_vs_best_paired"]
               for r in data["rows"]} for _, _, data in runs]  # per run: cell → its ratio
    keys = list(dict.fromkeys(k for run in ratios for k in run))  # first seen first
    out = []
    for key in keys:
        by_round = [(rnd, side, run.get(key))
                    for (rnd, side, _), run in zip(runs, ratios, strict=True)]
        means = {side: statistics.mean(v) if (v := [x for _, s, x in by_round
                                                    if s == side and x is not None]) else None
                 for side in ("old", "new")}
        out.append({"context": key[0], "text": key[1], "batch": key[2],
                    "rounds": [{"round": r, "side": s, "ratio": x} for r, s, x in by_round],
                    "old": means["old"], "new": means["new"]})
    return out


def table(rows: list[dict]) -> str:
    head = [f"{r['round']} {r['side']}" for r in rows[0]["rounds"]] if rows else []
    lines = ["| ctx | text | batch | " + " | ".join(head) + " | old mean | new mean |",
             "|---" * (5 + len(head)) + "|"]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    for c in rows:
        lines.append(f"| {c['context']} | {c['text']} | {c['batch']} | "
                     + " | ".join(fmt(r["ratio"]) for r in c["rounds"])
                     + f" | {fmt(c['old'])} | {fmt(c['new'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="adaptive_ab_<round>_<old|new>.json")
    ap.add_argument("--out", default=None, help="write the cells as JSON here")
    args = ap.parse_args(argv)
    rows = cells(load(args.files))
    print("adaptive / best fixed budget (paired), by round\n" + table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"cells": rows}, indent=1))


if __name__ == "__main__":
    main()
