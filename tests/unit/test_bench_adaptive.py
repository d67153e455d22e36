"""bench/bench_adaptive.py on the demo pair (CPU, small shapes): every variant's row, the
untimed warm rounds kept out of the timings, the round-by-round ratio consistent with the
rounds it pairs, and every variant's tokens equal plain decoding's."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_adaptive_rows_and_paired_ratio(tmp_path):
    out = tmp_path / "adaptive.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_adaptive.py", "--texts", "predictable", "novel",
         "--batch", "3", "--budgets", "3", "7", "--chain-budget", "7", "--new-tokens", "9",
         "--repeats", "3", "--warm-rounds", "1", "--contexts", "211", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["text"], r["batch"], r["context"]) for r in rows] == \
        [("predictable", 3, 211), ("novel", 3, 211)]
    for r in rows:
        assert r["lossless"] and set(r["tok_s"]) == {"AR", "chain 7", "B=3", "B=7",
                                                     "adaptive ≤7"}
        assert all(len(v) == 3 for v in r["tok_s_all"].values())  # the warm round left out
        best, ada = r["tok_s_all"][r["best_fixed"]], r["tok_s_all"]["adaptive ≤7"]
        paired = [a / b for a, b in zip(ada, best, strict=True)]
        assert r["adaptive_vs_best_paired"] == statistics.median(paired)
        assert r["adaptive_vs_best_paired_range"] == [min(paired), max(paired)]
        assert r["tok_s"][r["best_fixed"]] == max(r["tok_s"][k] for k in ("B=3", "B=7"))
    assert rows[0]["mean_commit"]["B=7"] > rows[1]["mean_commit"]["B=7"]  # predictable pays


def test_every_variant_runs_last_in_one_round_of_each_cycle():
    """Rounds start one variant further along, so no variant always runs last (after all the
    others' garbage and warmth); round 0 starts with plain decoding, the losslessness reference."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_adaptive

    names = ["AR", "chain 7", "B=3", "B=7", "adaptive ≤7"]
    orders = [bench_adaptive._rotated(names, i) for i in range(7)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders[0] == names and orders[5] == names and orders[6][0] == "chain 7"
    assert sorted(o[-1] for o in orders[:5]) == sorted(names)
