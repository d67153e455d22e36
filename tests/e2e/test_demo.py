"""The README demo path on the committed demo pair: `specserve up` with no model flags serves
checkpoints/ (target + DFlash drafter), and `specserve probe` with no --model sizes its prompts
with that pair's tokenizer. Greedy, DDTree budget 16: the trained pair speculates on predictable
text through the three services with no fallbacks (commit_len > 3), clearly less on novel text."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys

import pytest

from specserve.demo import default_pair
from tests.e2e.test_services import ENV, ROOT, _free_ports

pytestmark = pytest.mark.timeout(400)


def test_up_and_probe_default_to_the_demo_pair(tmp_path):
    assert default_pair()[0] is not None, "checkpoints/demo-target and demo-drafter are committed"
    g, v, d = _free_ports(3)
    env = {k: val for k, val in ENV.items() if k not in ("SPECSERVE_MODEL",
                                                          "SPECSERVE_DRAFT_MODEL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--device", "cpu", "--gateway-port",
         str(g), "--verifier-port", str(v), "--drafter-port", str(d)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("specserve up: ready") or proc.poll() is not None:
                break
        assert lines and lines[-1].startswith("specserve up: ready"), "".join(lines)
        out = tmp_path / "probe.json"
        probe = subprocess.run(
            [sys.executable, "-m", "services.cli", "probe", "--gateway", f"127.0.0.1:{g}",
             "--contexts", "1k", "--new-tokens", "48", "--budget", "16", "--json", str(out)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert probe.returncode == 0, probe.stderr[-3000:]
        rows = {r["text"]: r for r in json.loads(out.read_text())}
        print(probe.stdout)
        assert rows["predictable"]["context"] == rows["novel"]["context"] == 1024
        assert rows["predictable"]["fallbacks"] == 0  # the DFlash drafter drafted every step
        # an untrained drafter commits ~1.0 per step; this CPU-trained pair 7.00, novel 3.32
        assert rows["predictable"]["commit_len"] > 3
        assert rows["novel"]["commit_len"] < rows["predictable"]["commit_len"] - 1
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=60)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
