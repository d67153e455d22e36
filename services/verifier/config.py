"""The verifier's configuration: `VerifierConfig`, whose fields carry their flags
(services/common/settings.py), so `specserve serve verifier --help` is this table; it makes the
engine's `EngineConfig`. The bounds it checks are the core's (`MAX_BUDGET`, the loader's dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    VERIFIER_METRICS_PORT,
    VERIFIER_PORT,
    check_port,
    flag_field,
    generation_config_field,
    grace_field,
    host_field,
    metrics_port_field,
    port_field,
    port_file_field,
)
from specserve.config import MIXED_CHUNKS, EngineConfig, check_choice, check_switch
from specserve.models.generation_config import GENERATION_CONFIG
from specserve.spec.tree import MAX_BUDGET

DEFAULT_KV_GB = {"cpu": 1.0, "cuda": 16.0}
MAX_ADMISSION_WINDOW_MS = 1000.0  # a longer wait is a misconfiguration, not batching


def _address_or_none(raw: str) -> str | None:
    """--drafter's HOST:PORT ('' = none); a typo would decode every step without drafts."""
    if raw:
        host, _, port = raw.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--drafter must be HOST:PORT, got {raw!r}")
    return raw or None


def _or_none(value: str | None) -> str | None:
    return value or None


def _tap_layers(raw: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(t) for t in raw.split(",")) if raw else None
    except ValueError:
        raise ValueError(f"--tap-layers must be comma-separated ints, got {raw!r}") from None


def _switch(name: str, env: str, help: str, default: str = "auto") -> str:
    return flag_field(name, env, help, default=default)


@dataclass(frozen=True)
class VerifierConfig:
    model: str = flag_field("--model", "SPECSERVE_MODEL", "target checkpoint directory (HF "
                            "format)", cli_default="")
    host: str = host_field()
    port: int = port_field("SPECSERVE_VERIFIER_PORT", VERIFIER_PORT)
    device: str = device_field()  # auto = cuda if available, else cpu
    dtype: str = dtype_field()  # auto = bfloat16 on cuda, float32 on cpu
    threads: str = threads_field("verifier")  # auto: on cpu half the cores beside a drafter
    page_size: int = flag_field("--page-size", "SPECSERVE_PAGE_SIZE", "KV page size (tokens)",
                                default=16, type=int)
    kv_memory_gb: float | None = flag_field(  # None = 1.0 on cpu, 16.0 on cuda
        "--kv-memory-gb", "SPECSERVE_KV_MEMORY_GB",
        "KV page pool size in GiB (default 1.0 on cpu, 16.0 on cuda)", default=None,
        type=float)
    max_draft_tokens: int = flag_field(  # budgets are capped here; a request's scratch: its own
        "--max-draft-tokens", "SPECSERVE_MAX_DRAFT_TOKENS", "largest budget", default=64,
        type=int)
    default_budget: int = flag_field(  # B + 1 = 16 verify rows
        "--default-budget", "SPECSERVE_DEFAULT_BUDGET",
        "budget of requests that do not set one (15 = a DFlash block of 16 less its anchor; "
        "B + 1 verify rows: B = 2^k - 1 fills the kernel's row blocks)", default=15, type=int)
    drafter: str | None = flag_field(  # None = no drafter
        "--drafter", "SPECSERVE_DRAFTER_ADDR", "drafter address host:port ('' = none)",
        default=None, cli_default="", parse=_address_or_none)
    drafter_timeout_s: float = flag_field("--drafter-timeout-s", "SPECSERVE_DRAFTER_TIMEOUT_S",
                                          "deadline of one draft round trip", default=2.0,
                                          type=float)
    draft_model: str | None = flag_field(  # read only for target_layer_ids (and its projection)
        "--draft-model", "SPECSERVE_DRAFT_MODEL",
        "DFlash checkpoint directory (read for its target_layer_ids)", default=None,
        cli_default="", parse=_or_none)
    tap_layers: tuple[int, ...] | None = flag_field(
        "--tap-layers", "SPECSERVE_TAP_LAYERS",
        "comma-separated target layers to tap (overrides --draft-model)", default=None,
        cli_default="", parse=_tap_layers)
    max_num_seqs: int = flag_field("--max-num-seqs", "SPECSERVE_MAX_NUM_SEQS",
                                   "running requests at once", default=64, type=int)
    max_waiting: int = flag_field("--max-waiting", "SPECSERVE_MAX_WAITING",
                                  "queued requests past which new ones get RESOURCE_EXHAUSTED",
                                  default=256, type=int)
    # TLS / token of this port; TLS to and token for the drafter
    generation_config: str = generation_config_field()  # auto | none
    security: Security = security_field()
    max_num_batched_tokens: int = flag_field(
        "--max-num-batched-tokens", "SPECSERVE_MAX_NUM_BATCHED_TOKENS", "tokens per forward",
        default=2048, type=int)
    mixed_chunks: str = flag_field(
        "--mixed-chunks", "SPECSERVE_MIXED_CHUNKS",
        "a prefill chunk in a step with decoding requests: cost = cut to what "
        "--max-num-batched-tokens tokens cost at context 0 (weights + attention FLOPs), so "
        "their steps stay short while a long prompt prefills | tokens = that many tokens at "
        "any context", default="cost")
    grace_s: float = grace_field("shutdown drain time")
    trace_steps: int = flag_field(  # a `step` span for every Nth step of a request
        "--trace-steps", "SPECSERVE_TRACE_STEPS",
        "a span for every Nth step of a request (1 = all, 0 = none)", default=1, type=int)
    metrics_port: int = metrics_port_field("SPECSERVE_VERIFIER_METRICS_PORT",
                                           VERIFIER_METRICS_PORT)
    warmup: str = _switch("--warmup", "SPECSERVE_WARMUP",
                          "compile the GPU kernels before serving: auto (on cuda) | on | off")
    cuda_graphs: str = _switch("--cuda-graphs", "SPECSERVE_CUDA_GRAPHS",
                               "decode / verify steps as CUDA graphs: auto (on cuda) | on | off")
    drafter_transport: str = _switch(
        "--drafter-transport", "SPECSERVE_DRAFTER_TRANSPORT",
        "auto: on one host context rows go through a shared ring (CUDA IPC / shared memory) "
        "and steps through a Unix socket lane, found by Attach; grpc: everything on the "
        "gRPC stream, rows fc-projected (what crossing hosts costs)")
    context_ring_rows: int | None = flag_field(  # None: 2 × max_num_batched_tokens + 1024
        "--context-ring-rows", "SPECSERVE_CONTEXT_RING_ROWS",
        "rows of the shared context ring (default 2 x max-num-batched-tokens + 1024)",
        default=None, type=int)
    keep_context: str = _switch(
        "--keep-context", "SPECSERVE_KEEP_CONTEXT",
        "host copies of each request's context rows (fc-projected with --draft-model), so "
        "its speculation survives a drafter restart: auto (rows that cross the wire; not "
        "the ring's, which never leave the GPU) | on | off")
    overlap: str = _switch(
        "--overlap", "SPECSERVE_OVERLAP",
        "on: speculating requests form two groups that take turns, the drafter drafting one "
        "while the target verifies the other (lossless; pays only when drafting costs about "
        "as much as verifying, not with DFlash: docs/deploy.md) | off", default="off")
    draft_ahead: str = _switch(
        "--draft-ahead", "SPECSERVE_DRAFT_AHEAD",
        "on: each step's next drafts are sent as soon as its acceptance is known, so the "
        "rest of the commit, streaming and scheduling run while the drafter drafts (lossless; "
        "not with --overlap on; with --adaptive on while its decision to draft holds) | off: "
        "sent when the next step starts",
        default="on")
    adaptive: str = _switch(
        "--adaptive", "SPECSERVE_ADAPTIVE",
        "on: each step's draft tree chosen by expected tokens per second from measured step "
        "costs and the drafter's probabilities — DDTree of a rows bucket, the chain, or no "
        "drafting when plain decoding is faster; a request's budget is its bound | off: every "
        "step drafts the budget asked", default="off")
    tensor_parallel: int = flag_field(
        "--tensor-parallel", "SPECSERVE_TENSOR_PARALLEL",
        "shard the target over N ranks (this process drives N-1 workers it spawns; gloo on "
        "cpu, NCCL on cuda: rank r on cuda:k+r); --kv-memory-gb is per rank", default=1,
        type=int)
    admission_window_ms: float = flag_field(
        "--admission-window-ms", "SPECSERVE_ADMISSION_WINDOW_MS",
        "when a request finds the engine idle, how long the engine waits for more to prefill "
        "with it in one step, unless the waiting prompts fill the step already (requests sent "
        "together arrive a few ms apart; 0 = none)",
        default=0.0, type=float)
    port_file: str | None = port_file_field()

    def __post_init__(self) -> None:
        check_choice("generation_config", self.generation_config, GENERATION_CONFIG)
        check_switch("cuda_graphs", self.cuda_graphs)
        check_switch("warmup", self.warmup)
        if not self.model:
            raise ValueError("model (the target checkpoint directory) is required")
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        if self.trace_steps < 0:
            raise ValueError(f"trace_steps must be >= 0, got {self.trace_steps}")
        check_device(self.device)
        check_dtype(self.dtype)
        check_threads(self.threads)
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb}")
        if not 0 <= self.default_budget <= self.max_draft_tokens <= MAX_BUDGET:
            raise ValueError(f"need 0 <= default_budget <= max_draft_tokens <= {MAX_BUDGET}, "
                             f"got {self.default_budget}, {self.max_draft_tokens}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting",
                     "tensor_parallel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.admission_window_ms <= MAX_ADMISSION_WINDOW_MS:
            raise ValueError(f"admission_window_ms must be in [0, {MAX_ADMISSION_WINDOW_MS}], "
                             f"got {self.admission_window_ms}")
        if self.drafter_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("drafter_timeout_s must be positive and grace_s non-negative")
        self._check_choices()
        if self.context_ring_rows is not None and self.context_ring_rows <= 0:
            raise ValueError(f"context_ring_rows must be positive, got {self.context_ring_rows}")
        if self.tap_layers is not None and any(t < 0 for t in self.tap_layers):
            raise ValueError(f"tap_layers must be non-negative, got {self.tap_layers}")

    def _check_choices(self) -> None:
        if self.drafter_transport not in ("auto", "grpc"):
            raise ValueError(f"drafter_transport must be auto or grpc, got "
                             f"{self.drafter_transport!r}")
        for name in ("overlap", "draft_ahead", "adaptive"):
            if getattr(self, name) not in ("on", "off"):
                raise ValueError(f"{name} must be on or off, got {getattr(self, name)!r}")
        check_choice("mixed_chunks", self.mixed_chunks, MIXED_CHUNKS)
        if self.keep_context not in ("auto", "on", "off"):
            raise ValueError(f"keep_context must be auto, on or off, got {self.keep_context!r}")

    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def engine_config(self) -> EngineConfig:
        device = self.resolved_device()
        gb = self.kv_memory_gb if self.kv_memory_gb is not None else \
            DEFAULT_KV_GB[device.split(":")[0]]
        return EngineConfig(
            model_dir=self.model, dtype=resolve_dtype(self.dtype, device), device=device,
            page_size=self.page_size, kv_memory_bytes=max(1, int(gb * (1 << 30))),
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            mixed_chunks=self.mixed_chunks,
            max_draft_tokens=self.max_draft_tokens, cuda_graphs=self.cuda_graphs,
            overlap=self.overlap == "on", draft_ahead=self.draft_ahead == "on",
            adaptive=self.adaptive == "on",
            max_waiting=self.max_waiting, tensor_parallel=self.tensor_parallel)

    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs feed the drafter ((): no context, n-gram only)."""
        if self.tap_layers is not None:
            return tuple(self.tap_layers)
        if self.draft_model:
            from specserve.models.dflash_config import load_dflash_config

            return tuple(load_dflash_config(self.draft_model).target_layer_ids)
        return ()
