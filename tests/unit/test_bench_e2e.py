"""bench/bench_e2e.py on CPU with --tiny: the same code paths as the H200 run, small shapes.

Checks that every verify / decode row lands in the JSON, that the benchmark-only replay drafter
reaches its target commit length (±1) through the real engine, that one failing section does not
lose the others, and that the watchdog writes the JSON and exits instead of hanging. Also the
served bench and the trace breakdown (experiments/ scripts: test_experiments.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


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


def test_bench_served_tiny(tmp_path):
    """bench/bench_served.py on a tiny random pair on the CPU: the same requests in process and
    through the three services (same host: ring + lane), every row timed and its rows' path
    from the verifier's Stats; a prompt sent late, while 7 others decode, with their steps
    meanwhile; each batch-1 case also in interleaved rounds (`--paired`)."""
    out = tmp_path / "served.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_served.py"), "--tiny",
                           "--ckpt-dir", str(tmp_path / "pair"), "--contexts", "48,130",
                           "--batch8-contexts", "", "--new-tokens", "6", "--variants", "auto",
                           "--interference", "150", "--paired", "3", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [p["case"] for p in data["paired"]] == ["48 x1", "130 x1"]  # batch 1 only
    for p in data["paired"]:
        assert len(p["in_process_p50_ms"]) == len(p["served_p50_ms"]) == 3 == p["rounds"]
        assert len(p["host_spreads"]) == 3 and all(x >= 1 for x in p["host_spreads"])
        for r, s, i in zip(p["ratios"], p["served_p50_ms"], p["in_process_p50_ms"],
                           strict=True):  # each round: served over in process, same round
            assert abs(r - s / i) < 1e-3 * r
        assert p["ratio_min"] <= p["ratio_median"] <= p["ratio_max"]
        assert p["served_pooled_p50_ms"] > 0 and p["in_process_pooled_p50_ms"] > 0
    assert "interleaved (--paired)" in proc.stdout
    assert [(r["case"], r["path"]) for r in rows] == [
        ("48 x1", "in-process"), ("130 x1", "in-process"), ("150 into 7x48", "in-process"),
        ("48 x1", "served auto"), ("130 x1", "served auto"), ("150 into 7x48", "served auto")]
    for r in (r for r in rows if r["case"] == "150 into 7x48"):
        late = r["summary"]["interference"]  # 150 tokens: two prefill steps of --tiny's 128
        assert late["late_ttft_ms"] > 0 and late["steps_meanwhile"] >= 7
        assert late["step_meanwhile_max_ms"] >= late["step_meanwhile_p90_ms"] \
            >= late["step_meanwhile_p50_ms"] > 0
        series = late["step_meanwhile_series_ms"]  # the first decoder's, in order
        assert 1 <= len(series) <= late["steps_meanwhile"]
        assert max(series) <= late["step_meanwhile_max_ms"] + 0.01
        assert len(r["summary"]["ttft_each_ms"]) == 8
    for r in (r for r in rows if "into" not in r["case"]):
        s = r["summary"]
        assert s["ttft_ms"] > 0 and s["steady_p50_ms"] > 0 and s["steps"] == 5
        assert s["steady_max_ms"] >= s["steady_p99_ms"] >= s["steady_p50_ms"]
        assert s["steady_max_ms"] >= s["steady_mean_ms"] > 0
        assert s["ttft_each_ms"] == [round(s["ttft_ms"], 1)]  # one request
        assert s["first_token_spread_ms"] == 0 == s["last_token_spread_ms"]
        by = s["steady_by_shape"]  # the steady steps split by what they verified
        assert sum(v["n"] for v in by.values()) == 4 and set(by) <= {"tree", "off"}
        assert all(v["p90_ms"] >= v["p50_ms"] > 0 for v in by.values())
        assert r["floor"]["step_ms"] > 0 and r["ratio"]["ttft"] > 0
    assert all(r["shapes_once_ttft_ms"] > 0 for r in rows)  # each case's first prompt alone
    served = [r for r in rows if r["path"] == "served auto"]
    assert all(r["verifier"]["transport"] == "lane+ring" for r in served)
    assert served[-1]["verifier"]["context_rows"]["ring"] >= 48 + 130 + 7 * 48 + 150
    assert {"draft_wait", "drafter_work", "engine_step"} <= set(served[-1]["profile_ms"])


def test_bench_served_apart_starts_the_services_after_the_engine(tmp_path):
    """`--apart`: the services start only once the in-process rows are done (one engine's
    memory at a time); both paths still run every case. With `--paired` it is refused."""
    out, cmd = tmp_path / "served.json", [sys.executable, str(BENCH / "bench_served.py"),
                                          "--tiny", "--ckpt-dir", str(tmp_path / "pair")]
    proc = subprocess.run([*cmd, "--contexts", "37", "--batch8-contexts", "", "--new-tokens",
                           "5", "--variants", "auto", "--apart", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    done = max(i for i, line in enumerate(lines) if "] in-process 37 x1:" in line)
    up = min(i for i, line in enumerate(lines) if "] services up: auto" in line)
    assert done < up
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["in-process", "served auto"]
    assert all(r["summary"]["steps"] == 4 for r in rows)
    bad = subprocess.run([*cmd, "--apart", "--paired", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--apart" in bad.stderr


def test_bench_served_runs_two_variants_interleaved(tmp_path):
    """`--paired-variants 2`: the first and the last variant's services alive together, every
    case run in alternating rounds through each; each round's ratio is its own tok/s, last over
    first, and the adaptive side's steps say why (its services really carry the flag)."""
    out = tmp_path / "served.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_served.py"), "--tiny",
                           "--ckpt-dir", str(tmp_path / "pair"), "--contexts", "40",
                           "--batch8-contexts", "", "--new-tokens", "7", "--variants",
                           "auto,auto:--adaptive=on", "--paired-variants", "2", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (p,) = data["paired_variants"]
    assert (p["case"], p["first"], p["last"], p["rounds"]) == ("40 x1", "auto",
                                                             "auto:--adaptive=on", 2)
    for r, a, b in zip(p["ratios"], p["first_tok_s"], p["last_tok_s"], strict=True):
        assert a > 0 and b > 0 and abs(r - b / a) < 1e-3 * r
    assert p["ratio_min"] <= p["ratio_median"] <= p["ratio_max"]
    assert len(p["first_p50_ms"]) == len(p["last_p50_ms"]) == 2
    assert p["first_pooled_p50_ms"] > 0 and p["last_pooled_p50_ms"] > 0
    assert "two variants interleaved" in proc.stdout
    adaptive = [r for r in data["rows"] if r["path"] == "served auto:--adaptive=on"]
    assert adaptive and adaptive[0]["choices"]  # the adaptive services gave each step's why
    one = subprocess.run([sys.executable, str(BENCH / "bench_served.py"), "--tiny", "--variants",
                          "auto", "--paired-variants", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # refused before anything starts
    assert one.returncode == 2 and "needs two different --variants" in one.stderr


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


def test_bench_served_stops_its_services_when_it_fails(tmp_path):
    """A run that fails after starting the services (here the in-process engine's config
    refuses the budget) stops them: no drafter, verifier or gateway outlives it."""
    pair = tmp_path / "pair"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_served.py"), "--tiny",
                           "--ckpt-dir", str(pair), "--contexts", "48", "--batch8-contexts", "",
                           "--new-tokens", "4", "--variants", "auto", "--budget", "5000",
                           "--out", str(tmp_path / "served.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "default_budget" in proc.stderr, proc.stderr[-2000:]
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        if b"services." in b" ".join(args) and any(str(pair).encode() in a for a in args):
            left.append(args)
    assert not left, left
