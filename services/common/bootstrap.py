"""One process skeleton for the three services: parse, configure, run until a signal, exit.

`service_main(name, …)` is each `python -m services.NAME` / `specserve serve NAME`: the flags
come from the config dataclass (services/common/settings.py), logging goes to stderr at
--log-level, traces are set up for `name`, and a bad value, a port in use or a core error ends
the process with `specserve NAME: error: …` on stderr and exit code 2. `run_service` is the
lifecycle the three share: start, print the address, write the port file (atomically), wait
for SIGINT/SIGTERM (or `stop`), drain in-flight RPCs for `grace_s`, flush buffered spans.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.cli.usage import Parser
from services.common import telemetry
from services.common.settings import (
    LOG_LEVEL,
    Flag,
    add_flags,
    config_flags,
    config_from_args,
)

log = logging.getLogger("specserve.service")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Running(Protocol):
    """A started service: its bound port, and a stop that drains for `grace` seconds."""

    port: int

    async def stop(self, grace: float) -> None: ...


@dataclass(eq=False)
class Started:
    """A `Running` made of a port and a stop function."""

    port: int
    stop: Callable[[float], Awaitable[None]]


def write_port_file(path: str | Path, port: int) -> None:
    """Atomically write the bound port (a reader never sees a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def run_service(name: str, start: Callable[[], Awaitable[Running]], config: Any,
                      stop: asyncio.Event | None = None) -> None:
    """Start the service and run it until `stop` is set (default: SIGINT or SIGTERM), then
    stop it: drained for `config.grace_s` (at once when it failed), spans flushed."""
    running, grace = await start(), 0.0
    settle_interpreter()
    loop = asyncio.get_running_loop()
    handled = () if stop is not None else SIGNALS
    stop = stop if stop is not None else asyncio.Event()
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"specserve {name} listening on {config.host}:{running.port}", flush=True)
        if config.port_file:
            write_port_file(config.port_file, running.port)
        await stop.wait()
        log.info("%s shutting down: draining for up to %.1f s", name, config.grace_s)
        grace = config.grace_s
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await running.stop(grace)
        await telemetry.shutdown_tracing()


def settle_interpreter() -> None:
    """Once started (models loaded, graphs captured): `gc.freeze()` what is alive, so that a
    collection while serving scans only what serving allocated, not the hundreds of thousands
    of objects of torch, the models and the warm-up (a serving step's tail is shorter:
    BENCHMARKS.md). `SPECSERVE_GC_FREEZE=0` leaves the collector as it is."""
    if os.environ.get("SPECSERVE_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()


def service_flags(config_cls: type) -> list[Flag]:
    """A service's flags: --log-level and its config's."""
    return [LOG_LEVEL, *config_flags(config_cls)]


def build_parser(name: str, description: str, config_cls: type) -> argparse.ArgumentParser:
    """`specserve serve NAME`'s parser: `service_flags(config_cls)`."""
    parser = Parser(prog=f"specserve serve {name}", description=description)  # one-line errors
    add_flags(parser, service_flags(config_cls))
    return parser


def service_main(name: str, parser: argparse.ArgumentParser, config_cls: type,
                 run: Callable[[Any], Awaitable[None]],
                 argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, build the config, `run(config)` until it returns; 0, or 2 after
    `specserve NAME: error: …` for a bad value, a port in use or a core error."""
    from specserve.errors import SpecServeError

    args = parser.parse_args(argv)
    try:
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = config_from_args(config_cls, args)
        telemetry.setup_tracing(name)
        asyncio.run(run(config))
    except (ValueError, SpecServeError, OSError) as e:  # OSError: say, the port is in use
        print(f"specserve {name}: error: {e}", file=sys.stderr)
        return 2
    return 0
