"""`specserve probe` without services: what it refuses before any request (a context no model
here takes, past the model's positions, a results path it could not write, a text file with no
text), its JSON (no NaN), its verdicts on rows that cannot be judged, and Ctrl-C keeping the
rows measured so far."""

from __future__ import annotations

import json
import math

import pytest

from services.cli import main
from services.cli import probe as probe_cli
from specserve import probe
from specserve.demo import default_pair

TARGET, _ = default_pair()
pytestmark = pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")


def _row(**kw) -> probe.ProbeRow:
    base = dict(text="predictable", context=1000, new_tokens=32, steps=9, commit_len=3.56,
                depth=2.56, drafts=15.0, wall_s=0.4, prefill_s=0.05, ttft_s=0.07, step_ms=36.3,
                first_step_ms=41.0, steady_step_ms=35.2, fallbacks=0, stream_commit_len=3.56,
                followed=0.97, lossless=True)
    return probe.ProbeRow(**{**base, **kw})


@pytest.mark.parametrize("extra, says", [
    (["--contexts", "99999k"], "102,398,976 tokens is past the probe's limit, 2,097,152"),
    (["--contexts", "1k,262000", "--new-tokens", "500"], "past the model's 262,144 positions"),
    (["--json", "/nonexistent-dir/x.json"], "argument --json: cannot write"),
    (["--plot", "."], "argument --plot: cannot write '.': is a directory"),
])
def test_probe_refuses_before_any_request(extra, says, capsys):
    with pytest.raises(SystemExit) as e:  # the gateway address leads nowhere: never dialled
        main(["probe", "--model", TARGET, "--gateway", "127.0.0.1:9", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def test_an_empty_text_file_is_a_usage_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    with pytest.raises(SystemExit) as e:
        main(["probe", "--model", TARGET, "--text-file", str(empty), "--texts", "novel"])
    assert e.value.code == 2 and "has no text" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no tokens"):
        probe.prompt_ids(type("T", (), {"encode": staticmethod(lambda s: [])}), "", 8)


def test_rows_without_samples_are_null_in_json_and_not_judged():
    few = _row(steps=1, first_step_ms=40.0, steady_step_ms=math.nan)
    text = json.dumps(probe.rows_as_json([few]), allow_nan=False)
    assert json.loads(text)[0]["steady_step_ms"] is None
    assert probe.verdict(few) == probe.FEW_STEPS
    assert probe.verdict(_row(drafts=0.0, commit_len=1.0)) == probe.NOTHING_DRAFTED
    assert probe.verdict(_row()) == probe.HEALTHY
    assert probe.verdict(_row(commit_len=1.4)) == probe.HARD


def test_ctrl_c_keeps_the_rows_measured(monkeypatch, tmp_path, capsys):
    def interrupted(args, source, rows):
        rows.append(_row())
        raise KeyboardInterrupt

    monkeypatch.setattr(probe_cli, "_run", interrupted)
    out = tmp_path / "rows.json"
    code = main(["probe", "--model", TARGET, "--contexts", "1000", "--json", str(out)])
    got = capsys.readouterr()
    assert code == 130 and "interrupted after 1 rows" in got.err
    assert "| predictable | 1,000 | 3.56 |" in got.out
    assert json.loads(out.read_text())[0]["commit_len"] == 3.56
