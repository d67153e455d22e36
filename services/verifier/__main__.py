"""`python -m services.verifier` / `specserve serve verifier`: flags → VerifierConfig → serve.

Every flag has a `SPECSERVE_*` environment default (services/common/settings.py). SIGINT and
SIGTERM drain in-flight requests for --grace-s, then flush buffered spans and exit. Traces go
to OTEL_EXPORTER_OTLP_ENDPOINT (service.name "verifier" unless OTEL_SERVICE_NAME says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from services.common import telemetry
from services.common.security import SECURITY_FLAGS, Security
from services.common.settings import COMMON, VERIFIER_METRICS_PORT, VERIFIER_PORT, Flag, add_flags
from services.verifier.server import VerifierConfig, serve
from specserve.errors import SpecServeError

FLAGS = [
    *COMMON,
    *SECURITY_FLAGS,
    Flag("--port", "SPECSERVE_VERIFIER_PORT", VERIFIER_PORT, int, "port to bind (0 = any)"),
    Flag("--model", "SPECSERVE_MODEL", "", str, "target checkpoint directory (HF format)"),
    Flag("--drafter", "SPECSERVE_DRAFTER_ADDR", "", str, "drafter address host:port ('' = none)"),
    Flag("--draft-model", "SPECSERVE_DRAFT_MODEL", "", str,
         "DFlash checkpoint directory (read for its target_layer_ids)"),
    Flag("--tap-layers", "SPECSERVE_TAP_LAYERS", "", str,
         "comma-separated target layers to tap (overrides --draft-model)"),
    Flag("--device", "SPECSERVE_DEVICE", "auto", str, "auto | cpu | cuda[:N]"),
    Flag("--dtype", "SPECSERVE_DTYPE", "auto", str, "auto | float32 | bfloat16 | float16"),
    Flag("--page-size", "SPECSERVE_PAGE_SIZE", 16, int, "KV page size (tokens)"),
    Flag("--kv-memory-gb", "SPECSERVE_KV_MEMORY_GB", None, float,
         "KV page pool size in GiB (default 1.0 on cpu, 16.0 on cuda)"),
    Flag("--max-draft-tokens", "SPECSERVE_MAX_DRAFT_TOKENS", 64, int, "largest budget"),
    Flag("--default-budget", "SPECSERVE_DEFAULT_BUDGET", 15, int,
         "budget of requests that do not set one (15 = a DFlash block of 16 less its anchor; "
         "B + 1 verify rows: B = 2^k - 1 fills the kernel's row blocks)"),
    Flag("--drafter-timeout-s", "SPECSERVE_DRAFTER_TIMEOUT_S", 2.0, float,
         "deadline of one draft round trip"),
    Flag("--max-num-seqs", "SPECSERVE_MAX_NUM_SEQS", 64, int, "running requests at once"),
    Flag("--max-num-batched-tokens", "SPECSERVE_MAX_NUM_BATCHED_TOKENS", 2048, int,
         "tokens per forward"),
    Flag("--max-waiting", "SPECSERVE_MAX_WAITING", 256, int,
         "queued requests past which new ones get RESOURCE_EXHAUSTED"),
    Flag("--grace-s", "SPECSERVE_GRACE_S", 5.0, float, "shutdown drain time"),
    Flag("--metrics-port", "SPECSERVE_VERIFIER_METRICS_PORT", VERIFIER_METRICS_PORT, int,
         "Prometheus /metrics port (0 = none)"),
    Flag("--warmup", "SPECSERVE_WARMUP", "auto", str,
         "compile the GPU kernels before serving: auto (on cuda) | on | off"),
    Flag("--cuda-graphs", "SPECSERVE_CUDA_GRAPHS", "auto", str,
         "decode / verify steps as CUDA graphs: auto (on cuda) | on | off"),
    Flag("--drafter-transport", "SPECSERVE_DRAFTER_TRANSPORT", "auto", str,
         "auto: on one host context rows go through a shared ring (CUDA IPC / shared memory) "
         "and steps through a Unix socket lane, found by Attach; grpc: everything on the "
         "gRPC stream, rows fc-projected (what crossing hosts costs)"),
    Flag("--context-ring-rows", "SPECSERVE_CONTEXT_RING_ROWS", None, int,
         "rows of the shared context ring (default 2 x max-num-batched-tokens + 1024)"),
    Flag("--keep-context", "SPECSERVE_KEEP_CONTEXT", "auto", str,
         "host copies of each request's context rows (fc-projected with --draft-model), so "
         "its speculation survives a drafter restart: auto (rows that cross the wire; not "
         "the ring's, which never leave the GPU) | on | off"),
    Flag("--overlap", "SPECSERVE_OVERLAP", "off", str,
         "on: speculating requests form two groups that take turns, the drafter drafting one "
         "while the target verifies the other (lossless; pays when drafting does not slow the "
         "verify, BENCHMARKS.md) | off"),
    Flag("--adaptive", "SPECSERVE_ADAPTIVE", "off", str,
         "on: each step's draft tree chosen by expected tokens per second from measured step "
         "costs and the drafter's probabilities — DDTree of a rows bucket, the chain, or no "
         "drafting when plain decoding is faster; a request's budget is its bound | off: every "
         "step drafts the budget asked"),
    Flag("--trace-steps", "SPECSERVE_TRACE_STEPS", 1, int,
         "a span for every Nth step of a request (1 = all, 0 = none)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve serve verifier",
                                     description="the verifier service (target model)")
    add_flags(parser, FLAGS)
    parser.add_argument("--port-file", default=None,
                        help="write the bound port here once SERVING")
    return parser


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    """Raises ValueError for invalid values."""
    try:
        taps = tuple(int(t) for t in args.tap_layers.split(",")) if args.tap_layers else None
    except ValueError:
        raise ValueError(f"--tap-layers must be comma-separated ints, got "
                         f"{args.tap_layers!r}") from None
    return VerifierConfig(
        model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        page_size=args.page_size, kv_memory_gb=args.kv_memory_gb,
        max_draft_tokens=args.max_draft_tokens, default_budget=args.default_budget,
        drafter=args.drafter or None, drafter_timeout_s=args.drafter_timeout_s,
        draft_model=args.draft_model or None, tap_layers=taps, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, grace_s=args.grace_s,
        trace_steps=args.trace_steps, metrics_port=args.metrics_port, warmup=args.warmup,
        cuda_graphs=args.cuda_graphs, drafter_transport=args.drafter_transport,
        context_ring_rows=args.context_ring_rows, keep_context=args.keep_context,
        overlap=args.overlap, adaptive=args.adaptive, max_waiting=args.max_waiting,
        security=Security.from_args(args))



def _write_port(path: str, port: int) -> None:
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def _run(config: VerifierConfig, port_file: str | None) -> None:
    server, port = await serve(config)
    print(f"specserve verifier listening on {config.host}:{port}", flush=True)
    if port_file:
        _write_port(port_file, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down (grace %.1f s)", config.grace_s)
    await server.stop(config.grace_s)
    await telemetry.shutdown_tracing()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    telemetry.setup_tracing("verifier")
    try:
        asyncio.run(_run(config, args.port_file))
    except (SpecServeError, OSError) as e:  # OSError: the port is in use
        print(f"specserve verifier: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
