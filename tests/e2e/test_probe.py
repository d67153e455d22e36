"""`specserve probe` against the three real services: the table, the JSON and the plot, and the
probe's numbers agree with the per-request stats of the final stream message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.test_services import ENV, ROOT, checkpoints, stack  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)


def test_probe_table_json_and_plot(stack, checkpoints, tmp_path):  # noqa: F811
    out, png = tmp_path / "probe.json", tmp_path / "probe.png"
    proc = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "probe", "--gateway", stack.addr("gateway"),
         "--model", str(checkpoints[0]), "--contexts", "40,200", "--new-tokens", "24",
         "--drafter", "ngram", "--budget", "8", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| text | context | commit len | depth | drafts |" in proc.stdout
    rows = json.loads(out.read_text())
    assert [(r["text"], r["context"]) for r in rows] == [
        ("predictable", 40), ("predictable", 200), ("novel", 40), ("novel", 200)]
    for r in rows:
        assert r["new_tokens"] == 24 and r["steps"] >= 1
        # the probe's per-step numbers and the final message's stats are the same numbers
        assert r["stream_commit_len"] == pytest.approx(r["commit_len"])
        assert r["commit_len"] == pytest.approx(r["depth"] + 1)  # no step was cut
        assert 0 < r["prefill_s"] <= r["ttft_s"] <= r["wall_s"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
