"""bench/bench_e2e.py on CPU with --tiny: the same code paths as the H200 run, small shapes.

Checks that every verify / decode row lands in the JSON, that the benchmark-only replay drafter
reaches its target commit length (±1) through the real engine, that one failing section does not
lose the others, and that the watchdog writes the JSON and exits instead of hanging. Also the
CPU-runnable parts of the experiments/ diagnostics built on bench/'s helpers (they run with
PYTHONPATH=.:bench, as their docstrings say), the served bench and the trace breakdown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def run_bench(tmp_path: Path, *extra: str, timeout: int = 120):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_e2e.py"), "--tiny", "--out",
                           str(out), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    proc, res = run_bench(tmp_path_factory.mktemp("e2e"), "--sections", "verify,decode")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, res


def test_verify_rows(tiny_run):
    stdout, res = tiny_run
    assert res["status"] == "complete" and res["meta"]["device"] == "cpu"
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_TFLOPs"] > 0
    ver = res["verify"]
    assert ver["status"] == "ok"
    rows = ver["rows"]
    assert {(r["ctx"], r["batch"], r["budget"]) for r in rows} == {
        (c, b, n) for c in (64, 256) for b in (1, 8) for n in (16, 64, 256)}
    measured = [r for r in rows if "ms" in r]
    skipped = [r for r in rows if "skipped" in r]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and r["x_floor"] > 0 and r["rows"] ==
               r["batch"] * (r["budget"] + 1) for r in measured)
    # max(a + b, c + d) ≤ max(a, c) + max(b, d): the dependent-op floor is never below the other
    assert all(r["floor_dep_ms"] >= r["floor_ms"] * (1 - 1e-9) and r["x_floor_dep"] <=
               r["x_floor"] * (1 + 1e-9) and 0 < r["attn_TFLOP"] < r["TFLOP"] for r in measured)
    # the KV budget holds 6 requests at the longest context: batch 8 there is skipped
    assert skipped and all(r["batch"] == 8 and r["ctx"] == 256 for r in skipped)
    assert ver["kv_pool"]["max_batch_at_max_ctx"] == 6
    assert {(g["batch"], g["budget"]) for g in ver["growth"]} >= {(1, 16), (1, 64), (1, 256)}
    assert "| ctx | batch | budget |" in stdout and "### decode" in stdout


def test_decode_rows_and_replay_commit_len(tiny_run):
    _, res = tiny_run
    dec = res["decode"]
    assert dec["status"] == "ok"
    rows = {(r.get("ctx"), r["impl"]): r for r in dec["rows"]}
    for ctx in (64, 256):
        for impl in ("ours_ar", "ours_spec_replay", "ours_dflash"):
            r = rows[(ctx, impl)]
            assert "error" not in r, r
            assert r["tok_per_s"] > 0 and r["ms_per_step"] > 0 and r["new_tokens"] == 64
            ms = r["step_ms"]  # every timed step: its median, p90 and max are the row's
            assert len(ms) == r["timed_steps"] and max(ms) == pytest.approx(r["ms_per_step_max"],
                                                                            abs=1e-3)
            assert min(ms) <= r["ms_per_step"] <= r["ms_per_step_p90"] <= r["ms_per_step_max"]
        ar, spec = rows[(ctx, "ours_ar")], rows[(ctx, "ours_spec_replay")]
        assert ar["commit_len"] == 1.0 and ar["steps"] == 63
        assert spec["benchmark_only"] is True and spec["fallbacks"] == 0
        assert abs(spec["commit_len"] - 8) <= 1, spec
        assert spec["head_tokens"] == ar["head_tokens"]  # lossless: same greedy tokens
    # the peers ran on the same weights (or say why not)
    for impl in ("hf_generate", "dflash_generate"):
        peer = [r for r in dec["rows"] if r["impl"] == impl]
        assert peer and all("ms_per_step" in r or "not available" in r.get("error", "")
                            for r in peer), peer
    hf = next(r for r in dec["rows"] if r["impl"] == "hf_generate")
    if "ms_per_step" in hf:  # fp32 on CPU: transformers agrees with our greedy tokens
        assert hf["tokens_agreeing_with_ours"] == hf["new_tokens"]
    assert res["acceptance"], "acceptance checks are computed from the rows"


def test_failing_section_keeps_the_others(tmp_path):
    proc, res = run_bench(tmp_path, "--sections", "verify,decode", "--no-peers", "--kv-gb",
                          "1e-7", "--decode-ctxs", "64", "--new-tokens", "24", "--unfused-drafter")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["verify"]["status"] == "error" and "budget" in res["verify"]["error"]
    assert res["decode"]["status"] == "ok"
    rows = {r["impl"]: r for r in res["decode"]["rows"]}
    assert set(rows) == {"ours_ar", "ours_spec_replay", "ours_dflash", "ours_dflash_unfused"}
    assert rows["ours_dflash"]["fused_layers"] and not rows["ours_dflash_unfused"]["fused_layers"]
    assert rows["ours_dflash_unfused"]["tok_per_s"] > 0


def test_watchdog_writes_json_and_exits(tmp_path):
    proc, res = run_bench(tmp_path, "--sections", "decode", "--hard-s", "4",
                          "--new-tokens", "4000", "--decode-ctxs", "256", timeout=60)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res is not None and res["status"].startswith("watchdog")


def test_replay_drafter_unit():
    sys.path.insert(0, str(BENCH))
    from replay_drafter import ReplayDrafter, expected_commit, solve_p

    from specserve.drafters.base import DraftRequest

    for budget, commit in ((16, 8.0), (64, 8.0), (15, 3.5)):
        assert expected_commit(solve_p(commit, budget), budget) == pytest.approx(commit)
    with pytest.raises(ValueError):
        solve_p(20.0, 16)
    ref = list(range(100, 140))
    d = ReplayDrafter(vocab_size=1000, budget=16, commit_len=5, mode="fixed")
    d.set_reference("r", 3, ref)
    history = [1, 2, 3, *ref[:4]]  # 4 outputs committed; the root is ref[3]
    (tree,) = d.draft([DraftRequest("r", ref[3], 6, 16, 10, history=history)])
    assert tree.n == 10 and tree.max_depth == 10  # a chain, clipped to max_depth
    assert list(tree.token_ids[:4]) == ref[4:8] and tree.token_ids[4] != ref[8]
    assert "r" not in d.diverged_at
    (tree,) = d.draft([DraftRequest("r", 7, 6, 16, 10, history=[1, 2, 3, 100, 101, 7, 103])])
    assert d.diverged_at["r"] == 2
    # the mean of the low-discrepancy schedule sits on the target after a handful of steps
    g = ReplayDrafter(vocab_size=1000, budget=16, commit_len=8.0)
    assert abs(1 + np.mean([g.planned_depth(99) for _ in range(12)]) - 8) < 0.5


def test_replay_drafter_is_not_a_serving_option():
    for path in (ROOT / "specserve").rglob("*.py"):
        assert "replay_drafter" not in path.read_text(), path


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
    through one graph per length (the static path), its logits equal the eager path's."""
    out = tmp_path / "batch.json"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "diag_draft_batch.py"), "--tiny",
                           "--ctx", "40", "--steps", "3", "--batch", "3", "--out", str(out)],
                          cwd=tmp_path, env=experiments_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["mix"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(m, g) for m in ("uniform", "mixed") for g in ("graphs", "eager")}
    block = 16  # the tiny drafter's block: full depth 15, the short request depth 4 → 5
    graphs = rows[("mixed", "graphs")]["graphs"]  # (batch bucket, block length) as lists
    assert [1, 5] in graphs and rows[("mixed", "eager")]["graphs"] is None
    for mix in ("uniform", "mixed"):
        assert rows[(mix, "eager")]["max_diff_vs_graphs"] < 1e-4
        assert all(ms > 0 for ms in rows[(mix, "graphs")]["ms"])
    assert [2, block] in graphs  # the two full-depth requests: one replay of bucket 2


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


def test_bench_served_tiny(tmp_path):
    """bench/bench_served.py on a tiny random pair on the CPU: the same requests in process and
    through the three services (same host: ring + lane), every row timed and its rows' path
    from the verifier's Stats."""
    out = tmp_path / "served.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_served.py"), "--tiny",
                           "--ckpt-dir", str(tmp_path / "pair"), "--contexts", "48,130",
                           "--batch8-contexts", "", "--new-tokens", "6", "--variants", "auto",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["path"]) for r in rows] == [
        ("48 x1", "in-process"), ("130 x1", "in-process"), ("48 x1", "served auto"),
        ("130 x1", "served auto")]
    for r in rows:
        s = r["summary"]
        assert s["ttft_ms"] > 0 and s["steady_p50_ms"] > 0 and s["steps"] == 5
        assert r["floor"]["step_ms"] > 0 and r["ratio"]["ttft"] > 0
    served = [r for r in rows if r["path"] == "served auto"]
    assert all(r["verifier"]["transport"] == "lane+ring" for r in served)
    assert served[-1]["verifier"]["context_rows"]["ring"] >= 48 + 130
    assert {"draft_wait", "drafter_work", "engine_step"} <= set(served[-1]["profile_ms"])


def test_trace_breakdown_splits_each_step(tmp_path):
    from services.verifier.drafter_client import DRAFT_EVENTS

    """bench/trace_breakdown.py on spans written the way the services write them: the parts of
    each step are the differences of their own stamps (irregular ms, two processes' files)."""
    def stamp(ms):
        return f"2026-12-02T01:00:{ms / 1e3:09.6f}Z"

    def span(name, start, end, trace="0xab12", events=()):
        return json.dumps({"name": name, "context": {"trace_id": trace},
                           "start_time": stamp(start), "end_time": stamp(end),
                           "events": [{"name": n, "timestamp": stamp(t)} for n, t in events]})

    verifier, drafter = [], []
    for k, t0 in enumerate((100.0, 161.25, 170.5)):
        fwd0 = t0 + 1.5 + 7 * (k == 0)
        marks = zip(DRAFT_EVENTS, (t0 + 0.25, t0 + 0.5, t0 + 1.0, fwd0 + 2.0, fwd0 + 2.5,
                                   fwd0 + 3.0), strict=True)
        verifier += [span("step", t0, t0 + 6.75 + 8 * (k == 0)),
                     span("draft", t0, fwd0 + 3.25, events=marks),
                     span("verify", fwd0 + 3.25, fwd0 + 4.0), span("commit", fwd0 + 4.0,
                                                                   fwd0 + 4.5)]
        drafter += [span("draft.forward", fwd0, fwd0 + 0.75),
                    span("ddtree.build", fwd0 + 0.75, fwd0 + 1.25)]
    drafter.append(span("draft.forward", 5.0, 6.0, trace="0xother"))  # a one-step request
    (tmp_path / "verifier.jsonl").write_text("\n".join(verifier) + "\n")
    (tmp_path / "drafter.jsonl").write_text("\n".join(drafter) + "\n")
    out = tmp_path / "tb.json"
    proc = subprocess.run([sys.executable, str(BENCH / "trace_breakdown.py"), str(tmp_path),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    (req,) = got["requests"]
    assert req["steps"] == 3
    want_first = dict(step=14.75, to_drafter=8.5, forward=0.75, tree_build=0.5, back=2.0,
                      verify=0.75, commit=0.5)
    want_rest = dict(want_first, step=6.75, to_drafter=1.5)
    for part, ms in want_first.items():
        assert abs(req["first"][part] - ms) < 1e-3 and abs(req["rest"][part] - want_rest[part]) \
            < 1e-3
    assert got["steady_median_ms"] == req["rest"]
    detail = dict(prep=0.25, build=0.25, loop_write=0.5, wire_in=0.5, wire_out=0.75, wake=0.5,
                  trees=0.5, layout=0.25)  # the rest; the first step waits 7 ms more on the wire
    for part, ms in detail.items():
        assert abs(req["rest"][part] - ms) < 1e-3, part
    assert abs(req["first"]["wire_in"] - 7.5) < 1e-3
