"""The drafter server: startup (health + reflection) and graceful shutdown.

Owns `serve` (bind, load the drafters off the event loop while health says NOT_SERVING, then
SERVING) and `run` (serve until SIGINT/SIGTERM, then drain in-flight streams for `grace_s`,
flush buffered spans: services/common/bootstrap.run_service). `run` also serves Prometheus
metrics on `metrics_port` (0: none). The config is `DrafterConfig` (config.py), the command
line __main__.py.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common import telemetry
from services.common.bootstrap import Started, run_service
from services.common.device import apply_threads
from services.common.metrics import DrafterMetrics
from services.common.server import MiB, mark_serving, start_server
from services.drafter.config import DrafterConfig
from services.drafter.core import DrafterCore
from services.drafter.servicer import DrafterServicer
from specserve.config import switched_on
from specserve.engine.warmup import warm_up_drafter
from specserve.v1 import drafter_pb2_grpc

SERVICE_NAME = "specserve.v1.Drafter"


def load_core(config: DrafterConfig) -> DrafterCore:
    """The configured drafters (blocking: loads weights, then warms the DFlash kernels)."""
    core = DrafterCore.load(config.draft_model, config.model, dtype=config.resolved_dtype,
                            device=config.resolved_device, num_pages=config.num_pages,
                            page_size=config.page_size,
                            graphs=switched_on(config.cuda_graphs, config.resolved_device),
                            max_share=config.max_stream_share)
    if core.dflash is not None and switched_on(config.warmup, config.resolved_device):
        warm_up_drafter(core.dflash)
    return core


async def serve(config: DrafterConfig, core: DrafterCore | None = None,
                metrics: DrafterMetrics | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns once SERVING. A given `core` is used instead of loading one;
    `metrics` (optional) are recorded per draft batch."""
    servicer = DrafterServicer(metrics=metrics)
    servicer.attachments.max_message_bytes = config.max_message_mb * MiB
    server, port, health = await start_server(
        [(drafter_pb2_grpc.add_DrafterServicer_to_server, servicer)], [SERVICE_NAME],
        host=config.host, port=config.port, max_message_bytes=config.max_message_mb * MiB,
        security=config.security)
    servicer.attachments.lane_path = config.lane_path(port)
    server.attachments = servicer.attachments  # closed by `stop`
    try:
        servicer.core = core if core is not None else await asyncio.to_thread(load_core, config)
    except BaseException:
        await server.stop(0)
        raise
    if metrics is not None:  # the cache's gauges from the start, not from the first batch
        metrics.set_cache_pages(servicer.core.cache_pages())
    await mark_serving(health, [SERVICE_NAME])
    return server, port


async def start(config: DrafterConfig) -> Started:
    """`serve` with metrics on `metrics_port`; what `run_service` runs."""
    metrics = DrafterMetrics()
    # /metrics before the model loads: a port in use fails now, not after the load
    metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                    config.metrics_port)
    try:
        server, port = await serve(config, metrics=metrics)
    except BaseException:
        telemetry.stop_metrics_server(metrics_server)
        raise

    async def stop(grace: float) -> None:
        await server.stop(grace)
        server.attachments.close()
        telemetry.stop_metrics_server(metrics_server)

    return Started(port, stop)


async def run(config: DrafterConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain for `grace_s` (the process's lifecycle)."""
    apply_threads(config.threads, config.resolved_device, shared=True)
    await run_service("drafter", lambda: start(config), config)
