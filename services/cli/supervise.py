"""`specserve up` once all three services are SERVING: a service that exits is started again;
at the end every one is stopped (`stop_all`).

As docker-compose.yml's `restart: unless-stopped`: the one service is restarted after 1, 2, 4 …
30 s on its own ports while the others keep serving (the verifier decodes without a drafter
until it is back; the gateway answers UNAVAILABLE while no verifier is up, and both reconnect).
The wait doubles with each exit since the service last ran `STABLE_S` seconds, capped at
`MAX_DELAY_S`: a service that crashes every few seconds is restarted every 30 s for as long as
it comes back. A restart that never reaches SERVING (`MAX_FAILURES` in a row) or
`--restart no` ends `up` with exit code 1.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

MAX_FAILURES = 5
STABLE_S = 60.0
MAX_DELAY_S = 30.0


def _say(msg: str) -> None:
    print(f"specserve up: {msg}", file=sys.stderr, flush=True)


async def supervise(procs: dict, start: Callable[[str], Awaitable[None]], restart: bool,
                    delay_s: float = 1.0) -> int:
    """Wait on the running `procs` (name → process); `start(name)` starts one again and
    returns once it is SERVING (raising if it exits or times out first). Returns the exit code
    of `up` when a service is not restarted."""
    since = {name: time.monotonic() for name in procs}
    exits = dict.fromkeys(procs, 0)  # since the service last ran STABLE_S: its back-off
    waits = {asyncio.ensure_future(p.wait()): n for n, p in procs.items()}
    while True:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            name = waits.pop(fut)
            _say(f"{name} exited with code {procs[name].returncode}")
            if not restart:
                return 1
            if time.monotonic() - since[name] >= STABLE_S:
                exits[name] = 0
            if not await _again(name, start, exits, delay_s, procs):
                return 1
            since[name] = time.monotonic()
            waits[asyncio.ensure_future(procs[name].wait())] = name


async def _again(name: str, start, exits: dict, delay_s: float, procs: dict) -> bool:
    """Restart `name` with back-off until it is SERVING; False after MAX_FAILURES restarts in
    a row that did not reach SERVING."""
    for attempt in range(1, MAX_FAILURES + 1):
        wait = min(delay_s * 2 ** exits[name], MAX_DELAY_S)
        exits[name] += 1
        _say(f"restarting {name} in {wait:g} s (try {attempt} of {MAX_FAILURES})")
        await asyncio.sleep(wait)
        try:
            await start(name)
        except (RuntimeError, OSError) as e:  # TimeoutError is an OSError
            _say(f"{name} did not come back: {e}")
            continue
        _say(f"{name} SERVING again (pid {procs[name].pid})")
        return True
    _say(f"{name} failed {MAX_FAILURES} restarts in a row; stopping")
    return False


async def stop_all(procs: dict, grace_s: float = 15.0) -> None:
    """Stop every running process of `procs`, the last started first (SIGTERM, then SIGKILL)."""
    for name in reversed(list(procs)):  # gateway first: it drains, then the verifier, drafter
        proc = procs[name]
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                _say(f"{name} did not stop in {grace_s} s; killing")
                proc.kill()
                await proc.wait()
