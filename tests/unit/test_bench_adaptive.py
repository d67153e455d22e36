"""bench/bench_adaptive.py on the demo pair (CPU, small shapes): every variant's row, the
untimed warm rounds kept out of the timings, the round-by-round ratio consistent with the
rounds it pairs, and every variant's tokens equal plain decoding's."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_ab_section_alternates_a_baseline_and_this_tree(tmp_path):
    """bench/adaptive_h200.sh ab (on the CPU here): the demo pass four times, old new new old,
    the old rounds importing the baseline's package, and the report pairing the rounds."""
    import os
    import shutil

    work, out = tmp_path / "work", tmp_path / "out"
    base = work / ".baseline"
    base.mkdir(parents=True)
    for name in ("specserve", "bench", "checkpoints"):
        (work / name).symlink_to(ROOT / name)
    for name in ("specserve", "bench"):  # a copy: the old side's modules live elsewhere (and,
        shutil.copytree(ROOT / name, base / name,  # as after `prepare`, no demo drafter there)
                        ignore=shutil.ignore_patterns("__pycache__"))
    (base / "COMMIT").write_text("test-base\n")
    env = {**os.environ, "OUT": str(out), "GPU": "--device cpu", "CONTEXTS": "97",
           "DEMO_ARGS": "--texts predictable --batch 1 --budgets 3 --chain-budget 3 "
                        "--new-tokens 5 --repeats 2 --warm-rounds 0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "bench/adaptive_h200.sh", "ab"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "failed" not in proc.stdout, proc.stdout + proc.stderr
    sides = ["old", "new", "new", "old"]
    for i, side in enumerate(sides, 1):
        first = (out / f"adaptive_ab_{i}_{side}.log").read_text().splitlines()[0]
        where = base / "specserve" if side == "old" else work / "specserve"
        assert first == f"{side}: {where / 'engine' / 'adaptive.py'}"
    report = json.loads((out / "adaptive_ab.json").read_text())["cells"]
    ratios = [json.loads((out / f"adaptive_ab_{i}_{s}.json").read_text())["rows"][0]
              ["adaptive_vs_best_paired"] for i, s in enumerate(sides, 1)]
    assert len(report) == 1 and [r["ratio"] for r in report[0]["rounds"]] == ratios
    assert report[0]["old"] == statistics.mean([ratios[0], ratios[3]])
    assert report[0]["new"] == statistics.mean(ratios[1:3])
    assert "| 97 | predictable | 1 |" in (out / "adaptive_ab.md").read_text()


def test_the_ab_report_refuses_other_files_and_marks_missing_cells(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import adaptive_ab_report as report
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def rows(*cells):
        return {"rows": [{"context": c, "text": t, "batch": b, "adaptive_vs_best_paired": x}
                         for c, t, b, x in cells]}

    files = {"adaptive_ab_1_old.json": rows((211, "novel", 3, 0.913), (211, "mix", 1, 0.871)),
             "adaptive_ab_2_new.json": rows((211, "novel", 3, 0.958)),
             "adaptive_ab_3_new.json": rows((211, "novel", 3, 0.944), (211, "mix", 1, 0.902)),
             "adaptive_ab_4_old.json": rows((211, "mix", 1, 0.887), (211, "novel", 3, 0.931))}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    got = report.cells(report.load(sorted(str(p) for p in tmp_path.iterdir())))
    assert [(c["text"], c["old"], c["new"]) for c in got] == [
        ("novel", statistics.mean([0.913, 0.931]), statistics.mean([0.958, 0.944])),
        ("mix", statistics.mean([0.871, 0.887]), 0.902)]
    assert [r["ratio"] for r in got[1]["rounds"]] == [0.871, None, 0.902, 0.887]
    assert "| 211 | mix | 1 | 0.871 | — | 0.902 | 0.887 | 0.879 | 0.902 |" in report.table(got)
    (tmp_path / "adaptive_demo.json").write_text(json.dumps(rows()))
    with pytest.raises(ValueError, match="not named"):
        report.load([str(tmp_path / "adaptive_demo.json")])


def test_a_round_the_host_slowed_in_is_run_again(monkeypatch):
    """`--steady-host 1.15`: a timed round whose host probes spread more than 1.15 × is dropped
    and run again; the warm round is never retaken; the kept rounds' spreads are reported."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_adaptive as ba

    args = ba.parse(["--budgets", "3", "--repeats", "2", "--steady-host", "1.15"])
    assert len(ba.variants(args)) == 4  # AR, the chain, B=3, adaptive: 5 probes a round
    probes = iter([100, 210, 100, 100, 100,  # the warm round: spread, but untimed
                   100, 100, 100, 100, 100,  # kept
                   100, 100, 130, 100, 100,  # 1.3 ×: dropped, run again
                   101, 100, 100, 100, 100])  # kept
    monkeypatch.setattr(ba, "host_probe_us", lambda: next(probes))
    calls = []

    def fake_generate(engine, batch, new, budget):
        calls.append(engine)
        return [[7, 3]], float(len(calls)), []

    monkeypatch.setattr(ba, "generate", fake_generate)
    runs, spreads, retaken = ba._rounds({"fixed": "F", "chain": "C", "adaptive": "A"}, [[5]],
                                        args)
    assert retaken == 1 and spreads == [1.0, 1.01] and len(calls) == 16
    kept = sorted(x for r in runs.values() for x in r.tok_s)
    assert kept == [5, 6, 7, 8, 13, 14, 15, 16]  # the dropped round's runs (9–12) left out
    assert all(r.lossless for r in runs.values())
