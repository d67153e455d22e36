"""The probe's 'prefilling N tokens … t s' progress line: redrawn in place on a terminal, whole
lines (no carriage returns) in a log file, and nothing written after it stops."""

from __future__ import annotations

import io
import time

from services.cli import probe_client


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, monkeypatch, seconds: float) -> str:
    monkeypatch.setattr(probe_client._Waiting, "TTY_EVERY_S", 0.02)
    monkeypatch.setattr(probe_client._Waiting, "LOG_EVERY_S", 0.05)
    waiting = probe_client._Waiting("novel: prefilling 1,031 tokens", stream)
    time.sleep(seconds)
    waiting.stop()
    waiting.stop()  # a second stop writes nothing
    out = stream.getvalue()
    time.sleep(0.1)
    assert stream.getvalue() == out  # nothing after the last line
    return out


def test_log_file_gets_whole_lines(monkeypatch):
    out = _run(io.StringIO(), monkeypatch, 0.23)
    lines = out.splitlines()
    assert "\r" not in out and out.endswith(" s\n")
    assert 2 <= len(lines) <= 6  # one every 0.05 s (fewer on a loaded machine), then the last
    assert all(line.startswith("  novel: prefilling 1,031 tokens … ") for line in lines)
    times = [float(line.split("…")[1].removesuffix(" s")) for line in lines]
    assert times == sorted(times) and times[-1] >= 0.2


def test_terminal_redraws_one_line(monkeypatch):
    out = _run(_Tty(), monkeypatch, 0.15)
    assert out.count("\n") == 1 and out.endswith(" s\n")
    assert out.count("\r") >= 2  # redrawn in place
