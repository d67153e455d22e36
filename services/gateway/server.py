"""Gateway process: config, tokenizer, one long-lived verifier channel, server lifecycle.

`serve` loads the target's tokenizer (and its chat template), starts the OpenAI HTTP listener
on `http_port` (None: none) and the gRPC server (health + reflection), both over one pipeline,
writes the bound ports to `port_file` / `http_port_file` (for port 0), and on SIGINT/SIGTERM (or
`stop`) turns health to NOT_SERVING and drains in-flight generations for `grace_s` before
cancelling. While it runs, `follow_verifier` checks the verifier's health every
`health_period_s`: the gateway's named service (and HTTP /health) is SERVING while the
verifier's is, NOT_SERVING while it is unreachable or not serving. Prometheus metrics are served
on `metrics_port` (0: none); buffered spans are flushed at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import telemetry
from services.common.convert import MAX_STOP_BYTES, MAX_STOP_STRINGS
from services.common.metrics import GatewayMetrics
from services.common.security import NONE, Security
from services.common.server import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    channel,
    start_server,
)
from services.common.settings import DEFAULT_HOST, GATEWAY_PORT, HTTP_PORT, VERIFIER_PORT
from services.gateway.http_server import HttpListener
from services.gateway.openai_http import OpenAIFront
from services.gateway.pipeline import Pipeline, StopLimits
from services.gateway.servicer import GatewayServicer
from specserve.engine.chat_template import ChatTemplate
from specserve.engine.tokenizer import Tokenizer
from specserve.models.config import load_generation_defaults
from specserve.v1 import gateway_pb2_grpc, verifier_pb2

SERVICE_NAME = "specserve.v1.Gateway"
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
CHECK_TIMEOUT_S = 1.0  # one verifier health check (at least the period)
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
    health_period_s: float = 0.5  # how often the verifier's health is checked
    max_stop_strings: int = MAX_STOP_STRINGS  # a request's stop list: how many strings
    max_stop_bytes: int = MAX_STOP_BYTES  # and their UTF-8 bytes in all
    security: Security = NONE  # TLS / token of this port; TLS to and token for the verifier
    http_port: int | None = HTTP_PORT  # the OpenAI HTTP API (None: not served)
    http_port_file: str | None = None
    served_model_name: str | None = None  # the API's model id (None: the model directory's name)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a directory with tokenizer.json "
                             "(--model or SPECSERVE_MODEL)")
        if not self.verifier or ":" not in self.verifier:
            raise ValueError(f"verifier must be HOST:PORT, got {self.verifier!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535] or None, got {self.http_port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be non-empty when given")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not 1024 <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be in [1024, {MAX_MESSAGE_BYTES}], "
                             f"got {self.max_message_bytes}")
        if self.request_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("request_timeout_s must be > 0 and grace_s >= 0")
        if not self.health_period_s > 0:
            raise ValueError(f"health_period_s must be > 0, got {self.health_period_s}")
        if self.max_stop_strings < 0 or self.max_stop_bytes < 0:
            raise ValueError(f"max_stop_strings and max_stop_bytes must be >= 0, got "
                             f"{self.max_stop_strings} and {self.max_stop_bytes}")


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


async def follow_verifier(verifier: grpc.aio.Channel, health, period_s: float,
                          address: str, on_change=None) -> None:
    """Set the gateway's health from the verifier's, checked every `period_s` (until cancelled):
    SERVING while it reports SERVING, NOT_SERVING while it is unreachable or not serving;
    `on_change(serving)` hears each change."""
    stub = health_pb2_grpc.HealthStub(verifier)
    request = health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE)
    status = health_pb2.HealthCheckResponse.ServingStatus
    serving = None
    while True:
        try:
            reply = await stub.Check(request, timeout=max(period_s, CHECK_TIMEOUT_S))
            now, why = reply.status == status.Value("SERVING"), status.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            now, why = False, f"{e.code().name}: {e.details()}"
        if now != serving:
            serving = now
            mine = "SERVING" if now else "NOT_SERVING"
            await health.set(SERVICE_NAME, status.Value(mine))
            if on_change is not None:
                on_change(now)
            log.log(logging.INFO if now else logging.WARNING, "verifier at %s: %s; gateway %s",
                    address, why, mine)
        await asyncio.sleep(period_s)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _pipeline(config: GatewayConfig, verifier, metrics) -> Pipeline:
    return Pipeline(
        Tokenizer.from_dir(config.model), verifier, config.request_timeout_s, metrics,
        verifier_address=config.verifier,
        stop_limits=StopLimits(config.max_stop_strings, config.max_stop_bytes),
        peer_metadata=config.security.peer_metadata(),
        defaults=load_generation_defaults(config.model))


async def _start_http(config: GatewayConfig, pipeline: Pipeline, serving) -> HttpListener | None:
    if config.http_port is None:
        return None
    name = config.served_model_name or Path(config.model).resolve().name
    front = OpenAIFront(pipeline, name, ChatTemplate.from_dir(config.model),
                        token=config.security.token, max_body_bytes=config.max_message_bytes,
                        serving=serving, created=int(time.time()))
    http = HttpListener(front.app(), config.host, config.http_port, config.security,
                        config.grace_s, logging.getLevelName(log.getEffectiveLevel()))
    port = await http.start()
    if config.http_port_file:
        write_port_file(config.http_port_file, port)
    print(f"specserve gateway: OpenAI API on http{'s' if config.security.tls_cert else ''}://"
          f"{config.host}:{port}/v1 (model {name!r})", flush=True)
    return http


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (default: until SIGINT/SIGTERM)."""
    verifier = channel(config.verifier, config.security, VERIFIER_CHANNEL_OPTIONS)
    metrics = GatewayMetrics()
    pipeline = _pipeline(config, verifier, metrics)
    server, port, health = await start_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(pipeline))],
        [SERVICE_NAME], config.host, config.port, config.max_message_bytes,
        security=config.security)
    stop = stop if stop is not None else _stop_on_signals()
    serving, http, watcher, metrics_server = {"now": False}, None, None, None
    try:
        http = await _start_http(config, pipeline, lambda: serving["now"])
        metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                        config.metrics_port)
        watcher = asyncio.create_task(follow_verifier(
            verifier, health, config.health_period_s, config.verifier,
            lambda now: serving.update(now=now)), name="gateway-health")
        if config.port_file:
            write_port_file(config.port_file, port)
        print(f"specserve gateway listening on {config.host}:{port}", flush=True)
        log.info("verifier at %s, tokenizer from %s", config.verifier, config.model)
        await stop.wait()
        log.info("shutting down: draining for up to %.1f s", config.grace_s)
        serving["now"] = False
        await health.enter_graceful_shutdown()
        await asyncio.gather(server.stop(config.grace_s),
                             http.stop() if http is not None else asyncio.sleep(0))
    finally:
        if watcher is not None:
            await _cancel(watcher)
        await server.stop(0)
        if http is not None:
            await http.stop()
        await verifier.close()
        telemetry.stop_metrics_server(metrics_server)
        await telemetry.shutdown_tracing()
