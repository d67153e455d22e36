"""The CPU-runnable parts of the experiments/ diagnostics, run as their docstrings say
(PYTHONPATH=.:bench: the repo's packages and bench/'s helpers by their bare names): the plot of
the committed H200 result, diag_knobs' variant parser, diag_dflash_step / diag_draft_batch on
the tiny CPU model, diag_fused_merge's sm_90 cross-compile check, overlap_bound's prices (and
its run on the tiny pair) and predraft_quality's arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
EXPERIMENTS = ROOT / "experiments"


def experiments_env(env=None) -> dict:
    """The environment an experiments/ script runs in: the repo root and bench/ on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(BENCH), env.get("PYTHONPATH"))
                                        if p)
    return env


def test_plot_of_the_committed_h200_result(tmp_path):
    """experiments/plot_e2e.py draws BENCHMARKS.md's figure from the committed run-9 JSON."""
    png = tmp_path / "e2e.png"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "plot_e2e.py"),
                           str(EXPERIMENTS / "results" / "e2e_h200_run9_final.json"), "--out",
                           str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_diag_knobs_parses_variants_and_sets_knobs_back():
    """experiments/diag_knobs.py (GPU-only) evaluates --variants: literals and range() only; a
    knob that does not exist fails before the run, and set_knobs returns what it replaced."""
    sys.path[:0] = [str(EXPERIMENTS), str(BENCH)]  # as PYTHONPATH=.:bench gives the script
    try:
        from diag_knobs import _literal, set_knobs
    finally:
        sys.path.remove(str(EXPERIMENTS))
        sys.path.remove(str(BENCH))
    from specserve.models import fused_layer

    got = _literal("{'a': {'specserve.models.fused_layer.LT_DOWN_ROWS': range(3, 5)}, 'b': {}}")
    assert got == {"a": {"specserve.models.fused_layer.LT_DOWN_ROWS": range(3, 5)}, "b": {}}
    for bad in ("{'a': __import__('os')}", "{'a': ().__class__}", "{'a': [x for x in ()]}"):
        with pytest.raises(ValueError, match="only literals"):
            _literal(bad)
    before = fused_layer.LT_DOWN_ROWS
    old = set_knobs(got["a"])
    assert range(3, 5) == fused_layer.LT_DOWN_ROWS
    set_knobs(old)
    assert fused_layer.LT_DOWN_ROWS is before
    with pytest.raises(ValueError, match="no knob"):
        set_knobs({"specserve.models.fused_layer.NOT_A_KNOB": 1})


@pytest.mark.parametrize("drafter", ["dflash", "replay"])
def test_diag_dflash_step_tiny(tmp_path, drafter):
    """experiments/diag_dflash_step.py on the tiny CPU model: every step phase, the timer pass
    and the profile land in its JSON; the bench setup's JSON goes beside it, not into the cwd."""
    out = tmp_path / "diag.json"
    new = "40" if drafter == "dflash" else "200"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_dflash_step.py"), "--tiny",
                           "--ctxs", "64", "--new", new, "--drafter", drafter, "--out", str(out),
                           "--replay-budget", "7"], cwd=tmp_path, env=experiments_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    med = row["median_ms"]
    assert row["ctx"] == 64 and row["steps"] >= 4
    assert med["wall"] > 0 and med["verify"] > 0 and med["draft"] > 0
    assert med["draft"] + med["verify"] + med["commit"] <= 1.1 * med["wall"] + 0.5  # inside
    assert row["timers_ms"]["ModelRunner.forward"] > 0 and row["profile"]["steps"] == 5
    assert ("DFlashDrafter._run" in row["timers_ms"]) == (drafter == "dflash")
    assert row["budget"] == (7 if drafter == "replay" else 15)  # BLOCK_SIZE - 1 for DFlash
    assert isinstance(row["profile"]["cuda_top"], list)  # kernels by GPU time (none on CPU)
    assert (tmp_path / "diag.bench.json").exists() and not (tmp_path / "bench_e2e.json").exists()
    spread = row["spread_ms"]["wall"]  # every step kept: mean / p90 / max beside the median
    assert len(row["step_ms"]) == row["steps"] and med["wall"] <= spread["p90"] <= spread["max"]


def test_diag_draft_batch_tiny(tmp_path):
    """experiments/diag_draft_batch.py on the tiny CPU model: a call mixing block lengths goes
    through one graph replay, the shorter block masked (the static path); its logits equal the
    eager path's."""
    out = tmp_path / "batch.json"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_draft_batch.py"), "--tiny",
                           "--ctx", "40", "--steps", "3", "--batch", "3", "--out", str(out)],
                          cwd=tmp_path, env=experiments_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["mix"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(m, g) for m in ("uniform", "mixed") for g in ("graphs", "eager")}
    block = 16  # the tiny drafter's block: full depth 15, the short request depth 4 → 5
    graphs = rows[("mixed", "graphs")]["graphs"]  # (batch bucket, block length) as lists; the
    # call's one replay: its three requests in bucket 4 at the full block
    assert [4, block] in graphs and rows[("mixed", "eager")]["graphs"] is None
    for mix in ("uniform", "mixed"):
        assert rows[(mix, "eager")]["max_diff_vs_graphs"] < 1e-4
        assert all(ms > 0 for ms in rows[(mix, "graphs")]["ms"])


def test_diag_fused_merge_keeps_one_wave_on_sm90():
    """experiments/diag_fused_merge.py's grid barrier needs every CTA resident (one wave, 2 per SM):
    its kernel, fused or not, cross-compiled for sm_90 (no GPU needed) fits two CTAs per SM and
    does not spill with the merge's largest tiles."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = experiments_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_fused_merge.py"),
                           "--compile-check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["fuse"], r["merge_rows"]) for r in report} == {(True, 2), (True, 16), (False, 2)}
    for r in report:
        assert 2 * (r["shared"] + 1024) <= 233_472 and r["regs"] * 128 * 2 <= 65_536
        assert r["spills"] == 0


def test_diag_draft_trees_tiny(tmp_path):
    """experiments/diag_draft_trees.py on the tiny CPU model: per batch size the draft call's
    forward and tree times, the call's trees beside a top-k per request, and the pieces."""
    out = tmp_path / "trees.json"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_draft_trees.py"), "--tiny",
                           "--ctx", "40", "--steps", "4", "--reps", "3", "--batches", "1,3",
                           "--out", str(out)],
                          cwd=tmp_path, env=experiments_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        parts = ("forward_ms", "tree_ms", "trees_call_ms", "trees_per_request_ms",
                 "topk_copy_ms", "heaps_ms")
        assert all(r[k] > 0 for k in parts), r


def test_diag_burst_tiny(tmp_path):
    """experiments/diag_burst.py on the tiny CPU pair: per context and burst, the first engine
    steps with their split, the prefill they carried (the burst's prompts, all of them) and the
    drafter's call."""
    out = tmp_path / "burst.json"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_burst.py"), "--tiny",
                           "--contexts", "40,70", "--batch", "3", "--rounds", "1", "--steps", "3",
                           "--new-tokens", "4", "--chunk", "128", "--out", str(out)],
                          cwd=tmp_path, env=experiments_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bursts = json.loads(out.read_text())
    assert [(b["ctx"], b["round"]) for b in bursts] == [(40, 0), (70, 0)]
    for b in bursts:
        steps = b["steps"]
        assert len(steps) == 3 and sum(s["prefill_tokens"] for s in steps) == 3 * b["ctx"]
        assert all(s["ms"] > 0 and s["verify_ms"] > 0 for s in steps)
        assert steps[-1]["prefill_tokens"] == 0 and steps[-1]["tree_ms"] > 0


def _import_experiment(name: str):
    sys.path[:0] = [str(EXPERIMENTS), str(BENCH)]  # as PYTHONPATH=.:bench gives the script
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))
        sys.path.remove(str(BENCH))


def test_overlap_bound_prices_the_two_overlaps_from_step_parts(tmp_path):
    """experiments/overlap_bound.py: alternating groups get (V(B) + D(B)) / (2 · max(V(B/2),
    D(B/2))), drafts made ahead (V + D) / V (hand-computed here); on the tiny CPU pair every
    batch's steady steps are split into V + D and an odd batch has no halved price."""
    bounds = _import_experiment("overlap_bound").bounds
    got = {r["batch"]: r for r in bounds({1: dict(verify_ms=6.0, draft_ms=2.0),
                                          2: dict(verify_ms=6.5, draft_ms=2.5),
                                          3: dict(verify_ms=7.0, draft_ms=7.5)})}
    assert got[1]["alternation_bound"] is None and got[1]["predraft_bound"] == 8.0 / 6.0
    assert got[2]["serial_ms"] == 9.0 and got[2]["alternation_bound"] == 9.0 / 12.0
    assert got[2]["predraft_bound"] == 9.0 / 6.5 and got[3]["alternation_bound"] is None
    out = tmp_path / "ob.json"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "overlap_bound.py"), "--tiny",
                           "--contexts", "37", "--batches", "1,2", "--new-tokens", "22",
                           "--out", str(out)], cwd=tmp_path, env=experiments_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ctx"], r["batch"]) for r in rows] == [(37, 1), (37, 2)]
    for r in rows:
        assert r["steps"] >= 4 and r["verify_ms"] > 0 and r["draft_ms"] > 0
        assert abs(r["serial_ms"] - r["verify_ms"] - r["draft_ms"]) < 1e-9
    assert rows[1]["alternation_bound"] > 0 and "alternation <=" in proc.stdout


def test_predraft_quality_ranks_outcomes_and_prices_hits():
    """experiments/predraft_quality.py's arithmetic: an outcome (k accepted, bonus b) ranks by
    P(first k drafted tokens) · P(b at k + 1), b never the drafted token; all accepted cannot
    be guessed; a hit costs V, a miss V + D, each step advancing by its draft's acceptance."""
    import torch

    pq = _import_experiment("predraft_quality")
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1]])  # [2 positions, 3 tokens]
    logits = probs.log()
    # (0, 1): 0.2; (0, 2): 0.1; (1, 1): 0.7 · 0.4 = 0.28; (1, 2): 0.07
    assert pq.outcome_rank(logits, 1, 1) == 0
    assert pq.outcome_rank(logits, 0, 1) == 1
    assert pq.outcome_rank(logits, 0, 2) == 2 and pq.outcome_rank(logits, 1, 2) == 3
    assert pq.outcome_rank(logits, 2, 0) is None  # every drafted token accepted
    steps = [dict(serial=3, ahead=1, rank=0), dict(serial=5, ahead=2, rank=3),
             dict(serial=4, ahead=4, rank=None)]
    one = pq.price(steps, 1, v=6.0, d=2.0)  # a hit (1 + 1 tokens in 6) and two misses
    serial = (4 + 6 + 5) / (3 * 8.0)
    assert one["hit_rate"] == 1 / 3 and abs(one["ratio"] - (2 + 6 + 5) / 22.0 / serial) < 1e-12
    four = pq.price(steps, 4, v=6.0, d=2.0)
    assert abs(four["ratio"] - (2 + 3 + 5) / 20.0 / serial) < 1e-12
