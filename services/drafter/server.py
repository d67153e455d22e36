"""The drafter server: its configuration, startup (health + reflection) and graceful shutdown.

Owns `DrafterConfig`, `serve` (bind, load the drafters off the event loop while health says
NOT_SERVING, then SERVING) and `run` (serve until SIGINT/SIGTERM, then drain in-flight streams
for `grace_s`, flush buffered spans). `run` also serves Prometheus metrics on `metrics_port`
(0: none). The command line lives in __main__.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from services.common import lane, telemetry
from services.common.metrics import DrafterMetrics
from services.common.security import NONE, Security
from services.common.server import MiB, mark_serving, start_server
from services.common.settings import DEFAULT_HOST, DRAFTER_PORT
from services.drafter.core import DrafterCore
from services.drafter.servicer import DrafterServicer
from specserve.config import check_switch, switched_on
from specserve.drafters.registry import CONTEXT_PAGES
from specserve.engine.warmup import warm_up_drafter
from specserve.v1 import drafter_pb2_grpc

SERVICE_NAME = "specserve.v1.Drafter"
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DrafterConfig:
    host: str = DEFAULT_HOST
    port: int = DRAFTER_PORT  # 0: any free port
    model: str | None = None  # target checkpoint dir (DFlash reuses its embedding and LM head)
    draft_model: str | None = None  # DFlash checkpoint dir; None: n-gram drafting only
    device: str = "auto"  # "auto" = cuda if available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    page_size: int = 16  # context-cache page size (tokens)
    num_pages: int = CONTEXT_PAGES  # context-cache pages per layer group
    grace_s: float = 5.0  # in-flight streams get this long to finish on shutdown
    metrics_port: int = 0  # Prometheus endpoint on host:metrics_port (0 = none)
    warmup: str = "auto"  # compile kernels before serving: auto (= on cuda) | on | off
    cuda_graphs: str = "auto"  # DFlash block forward as CUDA graphs: auto (= on cuda) | on | off
    max_stream_share: float = 1.0  # the context-cache share one verifier connection may hold
    # largest message the drafter takes: a prefill chunk's inline (fc-projected) rows across
    # hosts, e.g. 8192 rows x 4096 x 2 B = 64 MiB; a request resent after a reconnect must fit
    max_message_mb: int = 256
    security: Security = NONE
    lane: str = "auto"  # same-host lane socket: auto (a path in the temp dir) | off (steps stay
    #                     on gRPC) | a socket path

    def __post_init__(self) -> None:
        check_switch("warmup", self.warmup)
        check_switch("cuda_graphs", self.cuda_graphs)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.draft_model and not self.model:
            raise ValueError("a draft model needs the target model too (its embedding and LM "
                             "head): give --model / SPECSERVE_MODEL")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError(f"page_size and num_pages must be positive, got "
                             f"{self.page_size}, {self.num_pages}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be non-negative, got {self.grace_s}")
        if self.max_message_mb <= 0:
            raise ValueError(f"max_message_mb must be positive, got {self.max_message_mb}")
        if not 0 < self.max_stream_share <= 1:
            raise ValueError(f"max_stream_share must be in (0, 1], got {self.max_stream_share}")
        if not self.lane:
            raise ValueError("lane must be auto, off or a socket path")

    def lane_path(self, port: int) -> str | None:
        if self.lane == "off":
            return None
        return lane.default_path(port) if self.lane == "auto" else self.lane

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device.startswith("cuda") else "float32"


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
    await mark_serving(health, [SERVICE_NAME])
    return server, port


def write_port_file(path: str | Path, port: int) -> None:
    """Atomically write the bound port (a reader never sees a partial file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def run(config: DrafterConfig, port_file: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully."""
    metrics = DrafterMetrics()
    server, port = await serve(config, metrics=metrics)
    metrics_server = telemetry.start_metrics_server(metrics.registry, config.host,
                                                    config.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        if port_file:
            write_port_file(port_file, port)
        print(f"specserve drafter listening on {config.host}:{port}", flush=True)
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.stop(config.grace_s)
        server.attachments.close()
        telemetry.stop_metrics_server(metrics_server)
        await telemetry.shutdown_tracing()
