"""`specserve up`'s supervision (services/cli/supervise.py) on fake processes: the service that
exits is started again with back-off while the others keep running, a run of failed restarts
ends `up`, and `--restart no` ends it at the first exit."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from services.cli import supervise as sup

PIDS = itertools.count(4100)


class FakeProc:
    def __init__(self) -> None:
        self.pid, self.returncode, self._done = next(PIDS), None, asyncio.Event()

    def exit(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    async def wait(self) -> int:
        await self._done.wait()
        return self.returncode


def _stack() -> dict:
    return {n: FakeProc() for n in ("drafter", "verifier", "gateway")}


@pytest.mark.asyncio
async def test_a_dead_service_is_started_again_alone(capsys):
    procs, started = _stack(), []
    others = {n: procs[n] for n in ("verifier", "gateway")}

    async def start(name: str) -> None:
        started.append(name)
        procs[name] = FakeProc()

    task = asyncio.create_task(sup.supervise(procs, start, restart=True, delay_s=0.0))
    for code in (-9, 3):  # twice: each exit restarts the new process too
        old = procs["drafter"]
        old.exit(code)
        while procs["drafter"] is old:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert started == ["drafter", "drafter"]
    assert all(procs[n] is p and p.returncode is None for n, p in others.items())
    assert not task.done()
    task.cancel()
    err = capsys.readouterr().err
    assert "drafter exited with code -9" in err and "drafter exited with code 3" in err
    assert f"drafter SERVING again (pid {procs['drafter'].pid})" in err


@pytest.mark.asyncio
async def test_failed_restarts_in_a_row_end_up_with_back_off(monkeypatch, capsys):
    procs, waits = _stack(), []

    async def sleep(s: float) -> None:
        waits.append(s)

    async def start(name: str) -> None:
        raise RuntimeError(f"{name} exited with code 1 during startup")

    monkeypatch.setattr(sup.asyncio, "sleep", sleep)
    procs["verifier"].exit(1)
    assert await sup.supervise(procs, start, restart=True, delay_s=1.5) == 1
    assert waits == [1.5, 3.0, 6.0, 12.0, 24.0][: sup.MAX_FAILURES]
    err = capsys.readouterr().err
    assert f"verifier failed {sup.MAX_FAILURES} restarts in a row; stopping" in err
    assert err.count("verifier did not come back") == sup.MAX_FAILURES


@pytest.mark.asyncio
async def test_a_service_that_comes_back_is_restarted_however_often_it_exits(monkeypatch):
    """Eight quick exits, each restart SERVING: `up` keeps going (it stopped the whole stack at
    the sixth), the back-off capped at MAX_DELAY_S."""
    procs, waits, real_sleep = _stack(), [], asyncio.sleep

    async def sleep(s: float) -> None:
        waits.append(s)

    async def start(name: str) -> None:
        procs[name] = FakeProc()

    monkeypatch.setattr(sup.asyncio, "sleep", sleep)
    task = asyncio.create_task(sup.supervise(procs, start, restart=True, delay_s=1.0))
    for _ in range(8):
        old = procs["drafter"]
        old.exit(-9)
        while procs["drafter"] is old and not task.done():
            await real_sleep(0)
        await real_sleep(0)
    assert not task.done()
    task.cancel()
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


@pytest.mark.asyncio
async def test_restart_no_ends_up_at_the_first_exit():
    procs, started = _stack(), []

    async def start(name: str) -> None:
        started.append(name)

    procs["gateway"].exit(0)
    assert await sup.supervise(procs, start, restart=False) == 1
    assert started == []
