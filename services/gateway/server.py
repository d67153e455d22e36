"""Gateway process: tokenizer, a long-lived channel per verifier replica, server lifecycle.

`start` loads the target's tokenizer (and its chat template), starts the OpenAI HTTP listener
on `http_port` (None: none) and the gRPC server (health + reflection), both over one pipeline,
writes the HTTP API's bound port to `http_port_file`; `serve` runs it through the services'
common lifecycle (services/common/bootstrap.run_service: the port file, SIGINT/SIGTERM or `stop`),
and `GatewayServer.stop` turns health to NOT_SERVING and drains in-flight generations for
`grace_s` before cancelling. While it runs, `Replicas.follow` (services/gateway/replicas.py)
checks every verifier's health and Stats each `health_period_s`: the gateway's named service
(and HTTP /health) is SERVING while at least one verifier is, NOT_SERVING while none is.
Prometheus metrics are served on `metrics_port` (0: none); buffered spans are flushed at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from services.common import telemetry
from services.common.bootstrap import run_service, write_port_file
from services.common.metrics import GatewayMetrics
from services.common.server import CHANNEL_OPTIONS, channel, start_server
from services.gateway.config import GatewayConfig
from services.gateway.http_server import HttpListener
from services.gateway.openai_http import OpenAIFront
from services.gateway.pipeline import Pipeline, StopLimits
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.replicas import Replicas
from services.gateway.servicer import GatewayServicer
from specserve.chat_template import ChatTemplate
from specserve.models.generation_config import load_generation_defaults
from specserve.tokenizer import Tokenizer
from specserve.v1 import gateway_pb2_grpc

SERVICE_NAME = "specserve.v1.Gateway"
CHECK_TIMEOUT_S = 1.0  # one verifier health check (at least the period)
# a restarted verifier is found within a second (grpc's default reconnect backoff reaches 120 s);
# meanwhile requests fail fast with UNAVAILABLE rather than wait
VERIFIER_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100),
                            ("grpc.min_reconnect_backoff_ms", 100),
                            ("grpc.max_reconnect_backoff_ms", 1000)]
log = logging.getLogger("specserve.gateway")


async def _set_health(health, serving: bool, state: dict) -> None:
    state["now"] = serving
    status = health_pb2.HealthCheckResponse.ServingStatus
    await health.set(SERVICE_NAME, status.Value("SERVING" if serving else "NOT_SERVING"))
    log.log(logging.INFO if serving else logging.WARNING, "gateway %s",
            "SERVING" if serving else "NOT_SERVING: no verifier is serving")


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _pipeline(config: GatewayConfig, replicas: Replicas, metrics) -> Pipeline:
    tokenizer = Tokenizer.from_dir(config.model)
    prompts = PromptEncoder(tokenizer, config.model)
    prompts.start()
    return Pipeline(
        tokenizer, replicas, config.request_timeout_s, metrics,
        stop_limits=StopLimits(config.max_stop_strings, config.max_stop_bytes),
        peer_metadata=config.security.peer_metadata(),
        defaults=load_generation_defaults(config.model, config.generation_config),
        prompts=prompts)


async def _start_http(config: GatewayConfig, pipeline: Pipeline, serving) -> HttpListener | None:
    if config.http_port is None:
        return None
    name = config.served_model_name or Path(config.model).resolve().name
    front = OpenAIFront(pipeline, name, ChatTemplate.from_dir(config.model),
                        token=config.security.token, max_body_bytes=config.max_message_bytes,
                        serving=serving, created=int(time.time()),
                        body_timeout_s=config.request_timeout_s,
                        allowed_origins=config.allowed_origins)
    http = HttpListener(front.app(), config.host, config.http_port, config.security,
                        config.grace_s, logging.getLevelName(log.getEffectiveLevel()))
    port = await http.start()
    if config.http_port_file:
        write_port_file(config.http_port_file, port)
    print(f"specserve gateway: OpenAI API on http{'s' if config.security.tls_cert else ''}://"
          f"{config.host}:{port}/v1 (model {name!r})", flush=True)
    return http


@dataclass(eq=False)
class GatewayServer:
    """A started gateway: what `stop` takes down (None: not started)."""

    port: int = 0
    server: grpc.aio.Server | None = None
    health: object = None
    replicas: Replicas | None = None
    http: HttpListener | None = None
    watcher: asyncio.Task | None = None
    metrics_server: object = None
    pipeline: Pipeline | None = None
    serving: dict = field(default_factory=lambda: {"now": False})  # HTTP /health reads it

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, drain in-flight generations for `grace` s, then close everything."""
        self.serving["now"] = False
        if self.watcher is not None:
            await _cancel(self.watcher)
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await asyncio.gather(self.server.stop(grace),
                                 self.http.stop() if self.http is not None else asyncio.sleep(0))
        if self.pipeline is not None:
            await self.pipeline.drain()  # its Stops, before the channels close
            self.pipeline.prompts.close()  # the prompt tokenization worker
        if self.replicas is not None:
            await self.replicas.close()
        telemetry.stop_metrics_server(self.metrics_server)


async def start(config: GatewayConfig) -> GatewayServer:
    """Start the gRPC server, the HTTP API, metrics and the verifier watch (stopped again if
    one of them fails)."""
    gw = GatewayServer(replicas=Replicas({
        a: channel(a, config.security, VERIFIER_CHANNEL_OPTIONS) for a in config.verifiers}))
    try:
        metrics = GatewayMetrics()
        gw.pipeline = pipeline = _pipeline(config, gw.replicas, metrics)
        gw.server, gw.port, gw.health = await start_server(
            [(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(pipeline))],
            [SERVICE_NAME], config.host, config.port, config.max_message_bytes,
            security=config.security)
        gw.http = await _start_http(config, pipeline, lambda: gw.serving["now"])
        gw.metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                           config.metrics_port)
        gw.watcher = asyncio.create_task(gw.replicas.follow(
            config.health_period_s, max(config.health_period_s, CHECK_TIMEOUT_S),
            lambda now: _set_health(gw.health, now, gw.serving)), name="gateway-health")
    except BaseException:
        await gw.stop(0)
        raise
    log.info("verifiers at %s, tokenizer from %s", ", ".join(config.verifiers), config.model)
    return gw


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (default: until SIGINT/SIGTERM)."""
    await run_service("gateway", lambda: start(config), config, stop)
