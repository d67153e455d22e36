"""The verifier process: the engine + step loop + drafter client, the gRPC server.

`serve(config)` (a `VerifierConfig`, services/verifier/config.py) binds first (health
NOT_SERVING), loads the target model off the event loop, connects the drafter client (failure
is fine: it keeps retrying), starts the step loop and only then reports SERVING.
`VerifierServer.stop(grace)` drains in-flight streams for `grace` seconds, then stops the step
loop and the drafter stream; `run` serves until SIGINT/SIGTERM through the services' common
lifecycle (services/common/bootstrap.run_service). Each verifier has its own Prometheus metrics
(`VerifierServer.metrics`, served on `metrics_port` when it is not 0) and traces a request's
steps every `trace_steps`-th step (0: no step spans; none either when no exporter is set up).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common import telemetry
from services.common.bootstrap import run_service
from services.common.device import StepThreads, apply_threads
from services.common.metrics import VerifierMetrics
from services.common.ring import ContextRing
from services.common.server import mark_serving, start_server
from services.verifier.config import VerifierConfig
from services.verifier.convert import SpecLimits
from services.verifier.drafter_client import RemoteDrafter
from services.verifier.loop import StepLoop
from services.verifier.servicer import VerifierServicer
from services.verifier.tracing import StepTracer
from specserve.config import switched_on
from specserve.engine.engine import Engine
from specserve.engine.warmup import warm_up_engine
from specserve.errors import ModelError
from specserve.models.dflash import load_context_projection
from specserve.models.generation_config import load_generation_defaults
from specserve.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name  # specserve.v1.Verifier


@dataclass(eq=False)
class VerifierServer:
    """A running verifier: the grpc server plus what it drives."""

    grpc_server: object  # grpc.aio.Server
    port: int
    health: object
    step_loop: StepLoop
    drafter: RemoteDrafter | None
    config: VerifierConfig
    metrics: VerifierMetrics | None = None
    metrics_server: object = None

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking requests, drain in-flight ones for `grace` s, then stop everything."""
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(self.config.grace_s if grace is None else grace)
        await asyncio.to_thread(self.step_loop.stop)
        if self.drafter is not None:
            await self.drafter.close()
        telemetry.stop_metrics_server(self.metrics_server)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def _build(config: VerifierConfig, metrics: VerifierMetrics, threads: StepThreads | None
                 ) -> tuple[StepLoop, RemoteDrafter | None]:
    engine = await asyncio.to_thread(Engine, config.engine_config())
    # step spans cost time on every step (BENCHMARKS.md, "The served path at real model scale",
    # run 3, and "Figures formerly in source comments"): made only when they go somewhere
    tracer = StepTracer(config.trace_steps if telemetry.exporting() else 0)
    drafter = None
    if config.drafter:
        drafter = await asyncio.to_thread(_remote_drafter, config, engine)
        if not drafter.needs_context:
            log.warning("no --draft-model or --tap-layers: no context features, so only "
                        "n-gram drafting can work")
        engine.set_drafter(drafter)  # checks the tap layers against the target
        if config.draft_ahead == "on" and config.overlap == "on":
            log.info("--draft-ahead on is ignored with --overlap on, which schedules the drafts "
                     "itself")
        drafter.tracing = tracer
    loop = StepLoop(engine, metrics=metrics, tracer=tracer,
                    admission_window_s=config.admission_window_ms / 1e3, threads=threads)
    loop.start()  # no requests before this returns: the server is not up yet
    try:
        if switched_on(config.warmup, engine.runner.device.type):
            rows = (1, config.default_budget + 1) if config.drafter else (1,)  # AR, trees
            await loop.call(warm_up_engine, engine, rows)  # on the thread that serves
        if drafter is not None:
            await drafter.start()
    except BaseException:
        await asyncio.to_thread(loop.stop)  # the engine thread ends with the failed start
        raise
    return loop, drafter


def _remote_drafter(config: VerifierConfig, engine: Engine) -> RemoteDrafter:
    """The drafter client: its ring (same host, when the drafter takes context) and the
    drafter's context projection (when `draft_model` is given: rows on the wire and kept)."""
    taps = config.target_layer_ids()
    weight = next(engine.runner.model.parameters())  # the target's dtype and device
    ring = projection = None
    if taps and config.drafter_transport == "auto":
        rows = config.context_ring_rows or 2 * config.max_num_batched_tokens + 1024
        ring = ContextRing(rows, len(taps) * engine.model_config.hidden_size, weight.dtype,
                           weight.device)
    if taps and config.draft_model and (config.drafter_transport == "grpc"
                                        or config.keep_context != "off"):
        try:
            projection = load_context_projection(config.draft_model, weight.dtype, weight.device)
        except ModelError as e:
            log.warning("no context projection from %s (rows cross the wire as raw taps): %s",
                        config.draft_model, e)
    return RemoteDrafter(config.drafter, taps, timeout_s=config.drafter_timeout_s, ring=ring,
                         projection=projection, keep_context=config.keep_context,
                         same_host=config.drafter_transport == "auto", security=config.security)


async def serve(config: VerifierConfig, threads: StepThreads | None = None
                ) -> tuple[VerifierServer, int]:
    """Start the verifier; returns the running server and its bound port (SERVING). `threads`
    (the process's, from `apply_threads`) sets torch's thread count step by step."""
    limits = SpecLimits(config.default_budget, config.max_draft_tokens, bool(config.drafter),
                        load_generation_defaults(config.model, config.generation_config))
    metrics = VerifierMetrics()
    servicer = VerifierServicer(limits, metrics)
    server, port, health = await start_server(
        [(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer)], [SERVICE],
        host=config.host, port=config.port, security=config.security)
    metrics_server = None
    try:  # /metrics before the models load: a port in use fails now, not after minutes
        metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                        config.metrics_port)
        loop, drafter = await _build(config, metrics, threads)
    except BaseException:
        telemetry.stop_metrics_server(metrics_server)
        await server.stop(0)
        raise
    servicer.attach(loop, drafter)
    await mark_serving(health, [SERVICE])
    return VerifierServer(server, port, health, loop, drafter, config, metrics,
                          metrics_server), port


async def run(config: VerifierConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain for `grace_s` (the process's lifecycle)."""

    threads = apply_threads(config.threads, config.resolved_device(),
                            shared=bool(config.drafter), by_step=True)

    async def start() -> VerifierServer:
        return (await serve(config, threads))[0]

    await run_service("verifier", start, config)
