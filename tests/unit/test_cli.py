"""The console script: every subcommand answers --help; `bench NAME` runs bench/ scripts."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("cmd", [[], ["serve"], ["up"], ["generate"], ["probe"], ["bench"],
                                 ["train-demo"]])
def test_help(cmd):
    out = _cli(*cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: specserve" in out.stdout


def test_bench_dispatches_to_the_script():
    out = _cli("bench", "correctness", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: correctness_report.py" in out.stdout
    bad = _cli("bench", "nope")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
