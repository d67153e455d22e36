"""Flags with `SPECSERVE_*` environment defaults — one table for every service.

A flag given on the command line wins over its environment variable, which wins over the
default. docker-compose.yml sets exactly these variables. A malformed value fails loudly.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    name: str  # "--port"
    env: str  # "SPECSERVE_GATEWAY_PORT"
    default: Any
    type: type = str
    help: str = ""


DEFAULT_HOST = "127.0.0.1"
GATEWAY_PORT, VERIFIER_PORT, DRAFTER_PORT = 50051, 50052, 50053
HTTP_PORT = 8000  # the gateway's OpenAI-compatible HTTP API (vLLM's default too)
# Prometheus /metrics (0 disables); bound on the --host address like the gRPC port
GATEWAY_METRICS_PORT, VERIFIER_METRICS_PORT, DRAFTER_METRICS_PORT = 9101, 9102, 9103

COMMON = [
    Flag("--host", "SPECSERVE_HOST", DEFAULT_HOST, str, "address to bind"),
    Flag("--log-level", "SPECSERVE_LOG_LEVEL", "INFO", str, "logging level"),
]


def _env_default(flag: Flag) -> Any:
    raw = os.environ.get(flag.env)
    if raw is None:
        return flag.default
    try:
        return flag.type(raw)
    except ValueError:
        raise SystemExit(f"specserve: {flag.env}={raw!r} is not a valid {flag.type.__name__}") \
            from None


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    for flag in flags:
        parser.add_argument(flag.name, type=flag.type, default=_env_default(flag),
                            help=f"{flag.help} [env {flag.env}, default {flag.default!r}]")
