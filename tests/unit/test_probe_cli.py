"""`specserve probe` without services: what it refuses before any request (a context no model
here takes, past the model's positions, a results path it could not write, a text file with no
text), its JSON (no NaN), its verdicts on rows that cannot be judged, Ctrl-C keeping the
rows measured so far, and a context the server's KV pool can never hold: a row of its own (the
verifier's own refusal, as the gateway passes it on), the other rows still measured."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from services.cli import main, probe_client
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


class _Refused(grpc.RpcError):
    def __init__(self, details: str, code=grpc.StatusCode.INVALID_ARGUMENT) -> None:
        self._details, self._code = details, code

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details


POOL, PAGE, SCRATCH = 64, 16, 16  # a verifier's KV pool of 1,024 tokens


def _pool_refusal(prompt_tokens: int, new_tokens: int, pages: int = POOL) -> str | None:
    """The verifier scheduler's own message for a request its pool of `pages` can never hold
    (None: it fits)."""
    from specserve.engine.scheduler import Scheduler
    from specserve.engine.sequence import Sequence
    from specserve.errors import InvalidRequest
    from specserve.types import SamplingParams

    sched = Scheduler(pages, PAGE, max_num_seqs=1, max_num_batched_tokens=PAGE, scratch=SCRATCH)
    seq = Sequence("r", list(range(prompt_tokens)), SamplingParams(max_tokens=new_tokens),
                   frozenset(), max_len=1 << 20, budget=SCRATCH - 1)  # a tree of SCRATCH rows
    try:
        sched.check_fits(seq)
    except InvalidRequest as e:
        return str(e)
    return None


def _serve(monkeypatch, pages: int = POOL, other_error: _Refused | None = None) -> list[int]:
    """probe_row as the gateway of a verifier with `pages` KV pages answers (or failing with
    `other_error`); returns the contexts asked for."""
    asked = []

    def row(stub, ids, expected, text, new_tokens, *args):
        asked.append(len(ids))
        if other_error is not None:
            raise other_error
        if (refusal := _pool_refusal(len(ids), new_tokens, pages)) is not None:
            raise _Refused(refusal)
        return _row(text=text, context=len(ids), new_tokens=new_tokens, verdict=probe.HEALTHY)

    monkeypatch.setattr(probe_client, "probe_row", row)
    return asked


def _probe(tmp_path, contexts: str, *extra) -> int:
    return main(["probe", "--model", TARGET, "--gateway", "127.0.0.1:9", "--texts",
                 "predictable", "--contexts", contexts, "--new-tokens", "32", "--json",
                 str(tmp_path / "rows.json"), "--plot", str(tmp_path / "rows.png"), *extra])


def test_a_context_past_the_kv_pool_is_reported_and_the_rest_still_run(monkeypatch, tmp_path,
                                                                        capsys):
    asked = _serve(monkeypatch)
    code = _probe(tmp_path, "512,2048,256")
    out, err = capsys.readouterr()
    assert code == 0 and asked == [512, 2048, 256], err
    needs = -(-(2048 + 32 + SCRATCH) // PAGE)  # pages for prompt + new tokens + scratch
    said = f"does not fit this server: needs {needs:,} KV pages, the pool has {POOL}"
    assert f"predictable @ 2,048: {said} (not measured)" in err
    lines = out.splitlines()
    assert lines[3] == "| predictable | 2,048 |" + " - |" * 11 + f" {said} |"
    assert lines[2].startswith("| predictable | 512 | 3.56 |") and "| 256 | 3.56 |" in lines[4]
    assert {line.count("|") for line in lines} == {15}  # every row has every column
    rows = json.loads((tmp_path / "rows.json").read_text(), parse_constant=pytest.fail)
    assert [(r["context"], r["verdict"]) for r in rows] == [
        (512, probe.HEALTHY), (2048, probe.UNFIT), (256, probe.HEALTHY)]
    refused = rows[1]["refused"]
    assert (refused["kv_pages_needed"], refused["kv_pages_total"]) == (needs, POOL)
    assert "can never run on this server" in refused["reason"]
    assert rows[1]["commit_len"] is None and rows[1]["steps"] is None
    assert rows[1]["ttft_other_s"] is None and rows[0]["refused"] is None
    assert (tmp_path / "rows.png").stat().st_size > 0  # the measured rows are plotted


def test_a_row_without_its_drafter_is_a_broken_system_exit_5(monkeypatch, tmp_path, capsys):
    """A script can tell "broken system" from "hard text": the drafter down on a row is exit 5
    (after the table); a row with one step shows '-' for the steady step, not nan."""
    def row(stub, ids, expected, text, new_tokens, *args):
        down = len(ids) > 300
        return _row(text=text, context=len(ids), new_tokens=new_tokens, fallbacks=9 if down
                    else 0, steps=9 if down else 1, steady_step_ms=5.0 if down else math.nan,
                    verdict=probe.NO_DRAFTER if down else probe.FEW_STEPS)

    monkeypatch.setattr(probe_client, "probe_row", row)
    code = _probe(tmp_path, "256,512")
    out, err = capsys.readouterr()
    assert code == probe_cli.DRAFTER_DOWN == 5
    assert probe.NO_DRAFTER in out and "nan" not in out + err
    assert "then - ms" in err and " | - | 0 | too few decode steps to judge |" in out
    monkeypatch.setattr(probe_client, "probe_row", lambda *a, **k: _row(verdict=probe.HARD))
    assert _probe(tmp_path, "256") == 0  # hard text is no failure


def test_nothing_measured_when_no_context_fits_exit_4(monkeypatch, tmp_path, capsys):
    _serve(monkeypatch, pages=8)
    code = _probe(tmp_path, "128,1k")
    out, err = capsys.readouterr()
    assert code == probe_cli.NOTHING_MEASURED == 4
    assert "no context fit this server: nothing measured" in err
    assert out.count("does not fit this server") == 2
    assert [r["refused"]["kv_pages_total"] for r in
            json.loads((tmp_path / "rows.json").read_text())] == [8, 8]
    assert not (tmp_path / "rows.png").exists()  # nothing to plot


@pytest.mark.parametrize("error", [
    _Refused("unknown drafter kind 9; expected one of [...]"),  # no pool named: not a row's fit
    _Refused(_pool_refusal(4096, 32), grpc.StatusCode.INTERNAL),
])
def test_any_other_failure_still_stops_the_probe_exit_2(monkeypatch, tmp_path, capsys, error):
    asked = _serve(monkeypatch, other_error=error)
    assert _probe(tmp_path, "512,256") == 2 and asked == [512]
    assert f"predictable @ 512: {error.code().name}: {error.details()}" in capsys.readouterr().err
    assert json.loads((tmp_path / "rows.json").read_text()) == []
