"""The verifier process: its config, the engine + step loop + drafter client, the gRPC server.

`serve(config)` binds first (health NOT_SERVING), loads the target model off the event loop,
connects the drafter client (failure is fine: it keeps retrying), starts the step loop and only
then reports SERVING. `VerifierServer.stop(grace)` drains in-flight streams for `grace` seconds,
then stops the step loop and the drafter stream. Each verifier has its own Prometheus metrics
(`VerifierServer.metrics`, served on `metrics_port` when it is not 0) and traces a request's
steps every `trace_steps`-th step (0: no step spans; none either when no exporter is set up).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common import telemetry
from services.common.metrics import VerifierMetrics
from services.common.ring import ContextRing
from services.common.security import NONE, Security
from services.common.server import mark_serving, start_server
from services.verifier.convert import SpecLimits
from services.verifier.drafter_client import RemoteDrafter
from services.verifier.loop import StepLoop
from services.verifier.servicer import VerifierServicer
from services.verifier.tracing import StepTracer
from specserve.config import EngineConfig, check_switch, switched_on
from specserve.engine.engine import Engine
from specserve.engine.warmup import warm_up_engine
from specserve.errors import ModelError
from specserve.models.config import load_generation_defaults
from specserve.models.dflash import load_context_projection
from specserve.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name  # specserve.v1.Verifier
DEFAULT_KV_GB = {"cpu": 1.0, "cuda": 16.0}


@dataclass(frozen=True)
class VerifierConfig:
    model: str  # target checkpoint directory (HF format)
    host: str = "127.0.0.1"
    port: int = 50052  # 0 = any free port
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    kv_memory_gb: float | None = None  # KV page pool; None = 1.0 on cpu, 16.0 on cuda
    max_draft_tokens: int = 64  # largest per-request budget (scratch reserved per request)
    default_budget: int = 15  # budget of requests that do not say (B + 1 = 16 verify rows)
    drafter: str | None = None  # drafter address host:port; None or "" = no drafter
    drafter_timeout_s: float = 2.0  # deadline of one draft round trip
    draft_model: str | None = None  # DFlash checkpoint dir, read only for target_layer_ids
    tap_layers: tuple[int, ...] | None = None  # overrides the draft model's target_layer_ids
    max_num_seqs: int = 64
    max_waiting: int = 256  # queued requests past which new ones get RESOURCE_EXHAUSTED
    security: Security = NONE  # TLS / token of this port; TLS to and token for the drafter
    max_num_batched_tokens: int = 2048
    grace_s: float = 5.0  # shutdown drains in-flight requests this long
    trace_steps: int = 1  # a `step` span for every Nth step of a request (0 = none)
    metrics_port: int = 0  # Prometheus endpoint on host:metrics_port (0 = none)
    warmup: str = "auto"  # compile kernels before serving: auto (= on cuda) | on | off
    cuda_graphs: str = "auto"  # decode / verify steps as CUDA graphs: auto (= on cuda) | on | off
    # how context rows and steps reach the drafter: auto (on one host: the shared context ring
    # and the lane, found by `Attach`; else the stream) | grpc (the stream only, rows
    # fc-projected: what crossing hosts costs)
    drafter_transport: str = "auto"
    context_ring_rows: int | None = None  # None: 2 × max_num_batched_tokens + 1024
    # host copies of context rows, for resends after a drafter loss: auto (rows that go on the
    # wire, not the ring's) | on | off
    keep_context: str = "auto"
    overlap: str = "off"  # on: two groups of requests take turns, drafting beside verifying
    # on: each step's tree (or none) chosen by measured cost, the request's budget its bound
    adaptive: str = "off"

    def __post_init__(self) -> None:
        check_switch("cuda_graphs", self.cuda_graphs)
        check_switch("warmup", self.warmup)
        if not self.model:
            raise ValueError("model (the target checkpoint directory) is required")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.trace_steps < 0:
            raise ValueError(f"trace_steps must be >= 0, got {self.trace_steps}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got "
                             f"{self.dtype!r}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb}")
        if not 0 <= self.default_budget <= self.max_draft_tokens <= 1024:
            raise ValueError(f"need 0 <= default_budget <= max_draft_tokens <= 1024, got "
                             f"{self.default_budget}, {self.max_draft_tokens}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.drafter_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("drafter_timeout_s must be positive and grace_s non-negative")
        if self.drafter_transport not in ("auto", "grpc"):
            raise ValueError(f"drafter_transport must be auto or grpc, got "
                             f"{self.drafter_transport!r}")
        for name in ("overlap", "adaptive"):
            if getattr(self, name) not in ("on", "off"):
                raise ValueError(f"{name} must be on or off, got {getattr(self, name)!r}")
        if self.keep_context not in ("auto", "on", "off"):
            raise ValueError(f"keep_context must be auto, on or off, got {self.keep_context!r}")
        if self.context_ring_rows is not None and self.context_ring_rows <= 0:
            raise ValueError(f"context_ring_rows must be positive, got {self.context_ring_rows}")
        if self.tap_layers is not None and any(t < 0 for t in self.tap_layers):
            raise ValueError(f"tap_layers must be non-negative, got {self.tap_layers}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def engine_config(self) -> EngineConfig:
        device = self.resolved_device()
        kind = device.split(":")[0]
        dtype = self.dtype if self.dtype != "auto" else \
            ("bfloat16" if kind == "cuda" else "float32")
        gb = self.kv_memory_gb if self.kv_memory_gb is not None else DEFAULT_KV_GB[kind]
        return EngineConfig(
            model_dir=self.model, dtype=dtype, device=device, page_size=self.page_size,
            kv_memory_bytes=max(1, int(gb * (1 << 30))), max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_draft_tokens=self.max_draft_tokens, cuda_graphs=self.cuda_graphs,
            overlap=self.overlap == "on", adaptive=self.adaptive == "on",
            max_waiting=self.max_waiting)

    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs feed the drafter ((): no context, n-gram only)."""
        if self.tap_layers is not None:
            return tuple(self.tap_layers)
        if self.draft_model:
            from specserve.models.dflash_config import load_dflash_config

            return tuple(load_dflash_config(self.draft_model).target_layer_ids)
        return ()


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


async def _build(config: VerifierConfig, metrics: VerifierMetrics
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
        drafter.tracing = tracer
    if switched_on(config.warmup, engine.runner.device.type):
        await asyncio.to_thread(warm_up_engine, engine)  # with the drafter's taps
    if drafter is not None:
        await drafter.start()
    loop = StepLoop(engine, metrics=metrics, tracer=tracer)
    loop.start()
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


async def serve(config: VerifierConfig) -> tuple[VerifierServer, int]:
    """Start the verifier; returns the running server and its bound port (SERVING)."""
    limits = SpecLimits(config.default_budget, config.max_draft_tokens, bool(config.drafter),
                        load_generation_defaults(config.model))
    metrics = VerifierMetrics()
    servicer = VerifierServicer(limits, metrics)
    server, port, health = await start_server(
        [(verifier_pb2_grpc.add_VerifierServicer_to_server, servicer)], [SERVICE],
        host=config.host, port=config.port, security=config.security)
    try:
        loop, drafter = await _build(config, metrics)
    except BaseException:
        await server.stop(0)
        raise
    servicer.attach(loop, drafter)
    metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                    config.metrics_port)
    await mark_serving(health, [SERVICE])
    return VerifierServer(server, port, health, loop, drafter, config, metrics,
                          metrics_server), port
