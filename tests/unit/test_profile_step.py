"""experiments/profile_step.py --tiny on CPU: every section runs and lands in the JSON and the
report (run as its docstring says: PYTHONPATH=.:bench, for bench/'s helpers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_step_tiny(tmp_path):
    out = tmp_path / "p.json"
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "bench"),
                                       os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_step.py"),
                           "--tiny", "--layers", "3", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert not res.get("errors"), res.get("errors")
    assert res["meta"]["fused"] is True
    assert len([r for r in res["steps"] if "model" in r]) == 6  # 2 ctxs × budgets 0, 16, 64
    assert len([r for r in res["engine"] if "step_ms" in r]) == 6
    assert all(r["tokens_per_step"] >= 1 for r in res["engine"])
    assert res["host_us"]["one decoder layer (inference path)"] > 0
    prof = res["profile"]
    assert len(prof) == 3 and all(p["aten_top_level_ops_per_step"] > 0 for p in prof.values())
    for head in ("[1][2]", "[3]", "[4]", "[5]", "[6]"):
        assert head in proc.stdout
