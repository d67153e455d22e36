"""Adaptive against the fixed budget it committed like: where the loss to the best fixed budget
sits, the choice or the step.

    python experiments/adaptive_same_shape.py \
        experiments/results/adaptive_*_ab_h100_run*_[1-4]_*.json

Reads `bench/bench_adaptive.py` JSON (the `ab` rounds of bench/adaptive_h200.sh). For every
round-cell where adaptive's mean commit length equals a fixed budget's (within 0.03), prints by
cell the medians of adaptive / that budget (tokens/s at the same shapes: the per-step cost) and
that budget / the best fixed budget (what the choice costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

ADAPTIVE = "adaptive ≤63"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    same, choice, total = defaultdict(list), defaultdict(list), defaultdict(int)
    for path in args.files:
        for r in json.loads(Path(path).read_text())["rows"]:
            key = (r["text"], r["batch"])
            total[key] += 1
            commit, tok_s = r["mean_commit"], r["tok_s"]
            like = [k for k, v in commit.items()
                    if k.startswith("B=") and abs(v - commit[ADAPTIVE]) < 0.03]
            if like:
                same[key].append(tok_s[ADAPTIVE] / tok_s[like[0]])
                choice[key].append(tok_s[like[0]] / tok_s[r["best_fixed"]])
    print("| text | batch | round-cells | at a fixed budget's commit | adaptive / it "
          "(median [min, max]) | it / best fixed (median) |")
    print("|---|---|---|---|---|---|")
    for key in sorted(same):
        s = same[key]
        print(f"| {key[0]} | {key[1]} | {total[key]} | {len(s)} | {statistics.median(s):.3f} "
              f"[{min(s):.3f}, {max(s):.3f}] | {statistics.median(choice[key]):.3f} |")
    pooled = [x for v in same.values() for x in v]
    print(f"\nall: {len(pooled)} of {sum(total.values())} round-cells; adaptive / same budget "
          f"{statistics.median(pooled):.3f}, same / best "
          f"{statistics.median([x for v in choice.values() for x in v]):.3f} (medians)")


if __name__ == "__main__":
    main()
