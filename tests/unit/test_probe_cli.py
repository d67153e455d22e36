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


def test_adaptive_rows_say_how_often_it_decoded_plainly():
    rows = [_row(plain=0.0), _row(text="novel", plain=0.625, commit_len=1.7, followed=None)]
    assert probe.verdict(rows[0]) == probe.HEALTHY and probe.verdict(rows[1]) == probe.PLAIN
    assert probe.verdict(_row(plain=0.5, commit_len=1.4)) == probe.HARD  # not past half
    assert probe.verdict(_row(plain=0.9, lossless=False)) == probe.BROKEN  # still first
    head, rule, *lines = probe.table(rows).splitlines()
    assert head.endswith("| verdict | plain |") and rule.count("|") == head.count("|")
    assert lines[0].endswith("| 0.00 |") and lines[1].endswith("| 0.62 |")
    assert "| plain |" not in probe.table([_row()])  # no adaptive row: no column


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


@pytest.mark.parametrize("shapes, plain", [({}, None), ({"off": 5, "tree": 2, "chain": 1}, 0.625)])
def test_a_row_reads_the_plain_share_from_the_final_stats(shapes, plain):
    from collections import Counter

    from services.cli import probe_client, wire
    from specserve.spec.metrics import RequestSpecStats
    from specserve.types import FinishReason

    stats = RequestSpecStats(steps=8, draft_tokens=11, accepted_tokens=5, committed_tokens=13,
                             commit_len_hist=Counter({1: 5, 3: 1, 5: 2}), shapes=Counter(shapes))
    steps = [wire.Chunk("a", (7,) * n, n, n - 1) for n in (1, 1, 1, 1, 1, 1, 3, 5, 5)]
    g = probe_client.Generation(ids=[7] * 19, text="a" * 9, steps=steps,
                                arrivals=[0.01 * i for i in range(9)],
                                final=wire.Final(FinishReason.LENGTH, 40, 19, stats, 0.0, "r",
                                                 0.02, 0.3))
    row = probe_client._row(g, "novel", 40, None, True)
    assert row.plain == plain and row.steps == 8 and row.drafts == pytest.approx(11 / 8)
