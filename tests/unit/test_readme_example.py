"""The README's in-process example runs as written: its ```python block, executed on the committed
demo pair (CPU), streams text and prints a mean commit_len."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def test_the_readme_has_one_python_example():
    assert len(_python_blocks()) == 1


@pytest.mark.skipif(not (ROOT / "checkpoints" / "demo-drafter").is_dir(),
                    reason="the demo pair is not in this checkout")
def test_the_readme_example_runs_and_prints_a_mean_commit_len(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the example names the pair by relative paths
    torch.manual_seed(0)
    exec(compile(_python_blocks()[0], "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    streamed, _, tail = out.rpartition("\nmean commit_len ")
    assert streamed.strip(), out  # the text was streamed before the summary line
    assert float(tail) >= 1.0, out  # every step commits at least its root's token
