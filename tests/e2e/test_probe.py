"""`specserve probe` against the three real services: the table, the JSON and the plot; the
probe's numbers agree with the per-request stats of the final stream message and with the
request's trace (the spans the services wrote under SPECSERVE_TRACE_DIR, found by the trace id
the gateway returns). Against a verifier whose KV pool is smaller than a context asked for, that
row says so — the pool's size as the verifier's Stats give it — and the other rows are measured."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import grpc
import pytest

from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from tests.e2e.test_services import (  # noqa: F401 (fixtures)
    ENV,
    ROOT,
    Stack,
    checkpoints,
    stack,
)

pytestmark = pytest.mark.timeout(300)


def test_probe_table_json_and_plot(stack, checkpoints, tmp_path):  # noqa: F811
    out, png = tmp_path / "probe.json", tmp_path / "probe.png"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "probe", "--gateway", stack.addr("gateway"),
         "--model", str(checkpoints[0]), "--contexts", "40,200", "--new-tokens", "24",
         "--drafter", "ngram", "--budget", "8", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| text | context | commit len | depth | drafts |" in proc.stdout
    assert "| 1st step ms | steady step ms |" in proc.stdout
    assert "| plain |" not in proc.stdout  # the verifier is not adaptive here
    rows = json.loads(out.read_text())
    assert [(r["text"], r["context"]) for r in rows] == [
        ("predictable", 40), ("predictable", 200), ("novel", 40), ("novel", 200)]
    for r in rows:
        assert r["new_tokens"] == 24 and r["steps"] >= 1 and r["plain"] is None
        assert r["device"] == "cpu"  # the verifier's device, for the plot's title
        # the probe's per-step numbers and the final message's stats are the same numbers
        assert r["stream_commit_len"] == pytest.approx(r["commit_len"])
        assert r["commit_len"] == pytest.approx(r["depth"] + 1)  # no step was cut
        assert 0 < r["prefill_s"] <= r["ttft_s"] <= r["wall_s"]
        # both are parts of the decode time (client clock vs the gateway's: 50 ms of slack)
        decode_ms = 1e3 * (r["wall_s"] - r["ttft_s"])
        assert 0 < r["first_step_ms"] <= decode_ms + 50
        assert 0 < r["steady_step_ms"] <= decode_ms + 50
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert len({r["trace_id"] for r in rows}) == len(rows)
    traces = _wait_for_traces(stack.tmp / "traces", rows)
    for r in rows:
        spans = traces[r["trace_id"]]
        names = {s["resource"]["attributes"]["service.name"] for s in spans}
        assert names == {"gateway", "verifier", "drafter"}, names
        steps = [s["attributes"] for s in spans if s["name"] == "step"]
        assert len(steps) == r["steps"]
        assert sum(a["commit_len"] for a in steps) / len(steps) == pytest.approx(r["commit_len"])
        assert sum(a["accepted_depth"] for a in steps) / len(steps) == pytest.approx(r["depth"])
        assert sum(a["tree_size"] for a in steps) / len(steps) == pytest.approx(r["drafts"])
        (prefill,) = [s for s in spans if s["name"] == "prefill"]
        assert prefill["attributes"]["prefill.tokens"] == r["context"]


@pytest.fixture(scope="module")
def small_pool(checkpoints, tmp_path_factory):  # noqa: F811
    """A verifier (no drafter service: the probe asks for ngram) whose KV pool holds a few
    hundred tokens, and its gateway."""
    tdir = str(checkpoints[0])
    s = Stack(tmp_path_factory.mktemp("probe-small-pool"),
              {**ENV, "SPECSERVE_KV_MEMORY_GB": "0.001"})
    try:
        s.start("verifier", ["--model", tdir, "--device", "cpu", "--dtype", "float32",
                             "--max-draft-tokens", "8", "--default-budget", "8"])
        s.start("gateway", ["--verifier", s.addr("verifier"), "--model", tdir])
        yield s
    finally:
        s.close()


def _pool_pages(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        stats = verifier_pb2_grpc.VerifierStub(ch).Stats(verifier_pb2.StatsRequest(), timeout=30)
    return stats.kv_pages_total


def test_a_context_past_the_kv_pool_is_a_row_of_its_own(small_pool, checkpoints, tmp_path):  # noqa: F811
    pages, out = _pool_pages(small_pool.addr("verifier")), tmp_path / "probe.json"
    assert 0 < pages * 16 < 400  # pages of 16 tokens: 400 prompt tokens cannot fit
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "probe", "--gateway", small_pool.addr("gateway"),
         "--model", str(checkpoints[0]), "--contexts", "40,400", "--new-tokens", "16",
         "--drafter", "ngram", "--budget", "8", "--json", str(out)],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["text"], r["context"]): r for r in json.loads(out.read_text())}
    assert sorted(rows) == [("novel", 40), ("novel", 400), ("predictable", 40),
                            ("predictable", 400)]
    for text in ("predictable", "novel"):
        fits, unfit = rows[text, 40], rows[text, 400]
        assert fits["refused"] is None and fits["new_tokens"] == 16 and fits["lossless"]
        assert unfit["verdict"] == "does not fit this server" and unfit["commit_len"] is None
        assert unfit["refused"]["kv_pages_total"] == pages
        assert unfit["refused"]["kv_pages_needed"] > pages
        said = (f"| {text} | 400 |" + " - |" * 11 + " does not fit this server: needs "
                f"{unfit['refused']['kv_pages_needed']} KV pages, the pool has {pages} |")
        assert said in proc.stdout


def _wait_for_traces(directory, rows, timeout_s: float = 20.0) -> dict[str, list[dict]]:
    """trace id → its spans (parsed JSON lines), once every row's step spans have arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        by_trace = defaultdict(list)
        for path in directory.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    span = json.loads(line)
                    by_trace[span["context"]["trace_id"].removeprefix("0x")].append(span)
        done = all(sum(s["name"] == "step" for s in by_trace[r["trace_id"]]) == r["steps"]
                   and any(s["name"] == "generate" for s in by_trace[r["trace_id"]])
                   for r in rows)
        if done or time.monotonic() > deadline:
            return by_trace
        time.sleep(0.2)
