"""Probe v2 tells the seed's two stories apart: the committed demo drafter beside the demo
target switched to full attention (trained on 128-token windows, it keeps "The cat sat on the
mat." going at 100 tokens and loses it at 1,500), through the three services on CPU. Short:
"healthy"; long: "the target does not follow the text at this length" — and at both the same
requests without speculation give the same tokens (the system is lossless either way)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.demo import default_pair
from tests.e2e.test_services import ENV, ROOT, Stack

TARGET, DRAFTER = default_pair()
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    full = tmp_path_factory.mktemp("full-attention-target")
    for f in Path(TARGET).iterdir():
        shutil.copy(f, full / f.name)
    raw = json.loads((full / "config.json").read_text())
    raw.update(layer_types=["full_attention"] * raw["num_hidden_layers"],
               use_sliding_window=False)
    (full / "config.json").write_text(json.dumps(raw))
    s = Stack(tmp_path_factory.mktemp("probe-verdicts"), {**ENV, "SPECSERVE_KV_MEMORY_GB": "0.1"})
    cpu = ["--device", "cpu", "--dtype", "float32"]
    try:
        s.start("drafter", ["--model", str(full), "--draft-model", DRAFTER, *cpu,
                            "--drafter-pages", "512"])
        s.start("verifier", ["--model", str(full), "--draft-model", DRAFTER, "--drafter",
                             s.addr("drafter"), *cpu, "--max-num-batched-tokens", "512"])
        s.start("gateway", ["--verifier", s.addr("verifier"), "--model", str(full)])
        s.model = full
        yield s
    finally:
        s.close()


def test_probe_says_the_target_stopped_following(stack, tmp_path):
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "probe", "--gateway", stack.addr("gateway"),
         "--model", str(stack.model), "--contexts", "100,1500", "--texts", "predictable",
         "--new-tokens", "32", "--drafter", "dflash", "--budget", "15", "--json", str(out),
         "--plot", str(tmp_path / "probe.png")],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| verdict |" in proc.stdout
    short, long = json.loads(out.read_text())
    assert (short["context"], long["context"]) == (100, 1500)
    assert short["verdict"] == "healthy" and short["followed"] > 0.9
    assert long["verdict"] == "the target does not follow the text at this length"
    assert long["followed"] < 0.5
    assert short["lossless"] is True and long["lossless"] is True
    assert "cat sat on the mat" in short["text_head"]
    assert short["accepted_per_position"]["1"] > 0.5  # JSON keys are strings
    assert short["commit_len"] > long["commit_len"]
    assert (tmp_path / "probe.png").stat().st_size > 10_000
