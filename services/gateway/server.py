"""Gateway process: config, tokenizer, one long-lived verifier channel, server lifecycle.

`serve` loads the target's tokenizer, starts the gRPC server (health + reflection), reports
SERVING, writes the bound port to `port_file` (for port 0), and on SIGINT/SIGTERM (or `stop`)
turns health to NOT_SERVING and drains in-flight generations for `grace_s` before cancelling.
Prometheus metrics are served on `metrics_port` (0: none); buffered spans are flushed at exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common import telemetry
from services.common.metrics import GatewayMetrics
from services.common.server import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    mark_serving,
    start_server,
)
from services.common.settings import DEFAULT_HOST, GATEWAY_PORT, VERIFIER_PORT
from services.gateway.servicer import GatewayServicer
from specserve.engine.tokenizer import Tokenizer
from specserve.v1 import gateway_pb2_grpc

SERVICE_NAME = "specserve.v1.Gateway"
# a restarted verifier is found within a second (grpc's default reconnect backoff reaches 120 s);
# meanwhile requests fail fast with UNAVAILABLE rather than wait
VERIFIER_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100),
                            ("grpc.min_reconnect_backoff_ms", 100),
                            ("grpc.max_reconnect_backoff_ms", 1000)]
log = logging.getLogger("specserve.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # directory holding the target's tokenizer.json
    verifier: str = f"127.0.0.1:{VERIFIER_PORT}"
    host: str = DEFAULT_HOST
    port: int = GATEWAY_PORT
    port_file: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    request_timeout_s: float = 600.0  # verifier deadline when the client sets none
    grace_s: float = 5.0
    metrics_port: int = 0  # Prometheus endpoint on host:metrics_port (0 = none)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a directory with tokenizer.json "
                             "(--model or SPECSERVE_MODEL)")
        if not self.verifier or ":" not in self.verifier:
            raise ValueError(f"verifier must be HOST:PORT, got {self.verifier!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not 1024 <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be in [1024, {MAX_MESSAGE_BYTES}], "
                             f"got {self.max_message_bytes}")
        if self.request_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("request_timeout_s must be > 0 and grace_s >= 0")


def write_port_file(path: str, port: int) -> None:
    """Atomically write the bound port (a reader never sees a half-written file)."""
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (default: until SIGINT/SIGTERM)."""
    tokenizer = Tokenizer.from_dir(config.model)
    verifier = grpc.aio.insecure_channel(config.verifier, options=VERIFIER_CHANNEL_OPTIONS)
    metrics = GatewayMetrics()
    servicer = GatewayServicer(tokenizer, verifier, config.request_timeout_s, metrics)
    server, port, health = await start_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer)], [SERVICE_NAME],
        config.host, config.port, config.max_message_bytes)
    stop = stop if stop is not None else _stop_on_signals()
    metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                    config.metrics_port)
    try:
        await mark_serving(health, [SERVICE_NAME])
        if config.port_file:
            write_port_file(config.port_file, port)
        print(f"specserve gateway listening on {config.host}:{port}", flush=True)
        log.info("verifier at %s, tokenizer from %s", config.verifier, config.model)
        await stop.wait()
        log.info("shutting down: draining for up to %.1f s", config.grace_s)
        await health.enter_graceful_shutdown()
        await server.stop(config.grace_s)
    finally:
        await server.stop(0)
        await verifier.close()
        telemetry.stop_metrics_server(metrics_server)
        await telemetry.shutdown_tracing()
