"""The drafter's configuration: `DrafterConfig`, whose fields carry their flags
(services/common/settings.py), so `specserve serve drafter --help` is this table."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import lane
from services.common.device import (
    check_device,
    check_dtype,
    check_threads,
    device_field,
    dtype_field,
    resolve_device,
    resolve_dtype,
    threads_field,
)
from services.common.security import Security, security_field
from services.common.settings import (
    DRAFTER_METRICS_PORT,
    DRAFTER_PORT,
    check_port,
    flag_field,
    grace_field,
    host_field,
    metrics_port_field,
    port_field,
    port_file_field,
)
from specserve.config import check_switch
from specserve.drafters.registry import CONTEXT_PAGES

PAGE_SIZE = 16


@dataclass(frozen=True)
class DrafterConfig:
    host: str = host_field()
    port: int = port_field("SPECSERVE_DRAFTER_PORT", DRAFTER_PORT)
    model: str | None = flag_field(  # DFlash reuses the target's embedding and LM head
        "--model", "SPECSERVE_MODEL",
        "target checkpoint dir (DFlash uses its embedding and LM head)", default=None)
    draft_model: str | None = flag_field(  # None: n-gram drafting only
        "--draft-model", "SPECSERVE_DRAFT_MODEL",
        "DFlash drafter checkpoint dir (absent: n-gram drafting only)", default=None)
    device: str = device_field()  # "auto" = cuda if available, else cpu
    dtype: str = dtype_field()  # "auto" = bfloat16 on cuda, float32 on cpu
    threads: str = threads_field("drafter")  # "auto": on cpu half the cores
    page_size: int = flag_field("--page-size", "SPECSERVE_PAGE_SIZE",
                                "context-cache page size (tokens)", default=PAGE_SIZE, type=int)
    num_pages: int = flag_field(  # context-cache pages per layer group
        "--drafter-pages", "SPECSERVE_DRAFTER_PAGES",
        f"context-cache pages per layer group ({CONTEXT_PAGES} × {PAGE_SIZE} = "
        f"{CONTEXT_PAGES * PAGE_SIZE // 1024}k tokens: a 128k probe fits)",
        default=CONTEXT_PAGES, type=int)
    grace_s: float = grace_field("shutdown: in-flight streams get this long to finish")
    metrics_port: int = metrics_port_field("SPECSERVE_DRAFTER_METRICS_PORT",
                                           DRAFTER_METRICS_PORT)
    warmup: str = flag_field(
        "--warmup", "SPECSERVE_WARMUP",
        "compile the GPU kernels before serving: auto (on cuda) | on | off", default="auto")
    cuda_graphs: str = flag_field(
        "--cuda-graphs", "SPECSERVE_CUDA_GRAPHS",
        "the DFlash block forward as CUDA graphs: auto (on cuda) | on | off", default="auto")
    max_stream_share: float = flag_field(
        "--max-stream-share", "SPECSERVE_DRAFTER_MAX_STREAM_SHARE",
        "the share of the context cache one verifier connection may hold (0-1]", default=1.0,
        type=float)
    # largest message the drafter takes: a prefill chunk's inline (fc-projected) rows across
    # hosts, e.g. 8192 rows x 4096 x 2 B = 64 MiB; a request resent after a reconnect must fit
    max_message_mb: int = flag_field(
        "--max-message-mb", "SPECSERVE_DRAFTER_MAX_MESSAGE_MB",
        "largest message taken (a prefill chunk's rows across hosts must fit)", default=256,
        type=int)
    security: Security = security_field(dials=False)  # it dials nobody
    lane: str = flag_field(  # auto (a path in the temp dir) | off (steps stay on gRPC) | a path
        "--lane", "SPECSERVE_DRAFTER_LANE",
        "same-host lane (a Unix socket for the verifier's steps): auto (a path in the temp "
        "dir) | off | a socket path (in a volume the verifier mounts too)", default="auto")
    port_file: str | None = port_file_field()

    def __post_init__(self) -> None:
        check_switch("warmup", self.warmup)
        check_switch("cuda_graphs", self.cuda_graphs)
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        if self.draft_model and not self.model:
            raise ValueError("a draft model needs the target model too (its embedding and LM "
                             "head): give --model / SPECSERVE_MODEL")
        check_dtype(self.dtype)
        check_threads(self.threads)
        check_device(self.device)
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
        return resolve_device(self.device)

    @property
    def resolved_dtype(self) -> str:
        return resolve_dtype(self.dtype, self.resolved_device)
