"""`python -m services.drafter` / `specserve serve drafter`: flags (with SPECSERVE_* env) → run.

`main(argv)` is what the `specserve` CLI delegates to. Traces go to OTEL_EXPORTER_OTLP_ENDPOINT
(service.name "drafter" unless OTEL_SERVICE_NAME says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import fields

from services.common import telemetry
from services.common.security import SECURITY_FLAGS, Security
from services.common.settings import COMMON, DRAFTER_METRICS_PORT, DRAFTER_PORT, Flag, add_flags
from services.drafter.server import DTYPES, DrafterConfig, run

_D = {f.name: f.default for f in fields(DrafterConfig)}  # the config's defaults are the flags'
FLAGS = [
    *COMMON,
    *SECURITY_FLAGS,
    Flag("--port", "SPECSERVE_DRAFTER_PORT", DRAFTER_PORT, int, "port to bind (0: any free)"),
    Flag("--model", "SPECSERVE_MODEL", None, str,
         "target checkpoint dir (DFlash uses its embedding and LM head)"),
    Flag("--draft-model", "SPECSERVE_DRAFT_MODEL", None, str,
         "DFlash drafter checkpoint dir (absent: n-gram drafting only)"),
    Flag("--device", "SPECSERVE_DEVICE", "auto", str, "auto | cpu | cuda | cuda:N"),
    Flag("--dtype", "SPECSERVE_DTYPE", "auto", str, " | ".join(DTYPES)),
    Flag("--page-size", "SPECSERVE_PAGE_SIZE", _D["page_size"], int,
         "context-cache page size (tokens)"),
    Flag("--drafter-pages", "SPECSERVE_DRAFTER_PAGES", _D["num_pages"], int,
         "context-cache pages per layer group (16384 × 16 = 256k tokens: a 128k probe fits)"),
    Flag("--grace-s", "SPECSERVE_GRACE_S", _D["grace_s"], float,
         "shutdown: in-flight streams get this long to finish"),
    Flag("--warmup", "SPECSERVE_WARMUP", "auto", str,
         "compile the GPU kernels before serving: auto (on cuda) | on | off"),
    Flag("--cuda-graphs", "SPECSERVE_CUDA_GRAPHS", "auto", str,
         "the DFlash block forward as CUDA graphs: auto (on cuda) | on | off"),
    Flag("--max-message-mb", "SPECSERVE_DRAFTER_MAX_MESSAGE_MB", 256, int,
         "largest message taken (a prefill chunk's rows across hosts must fit)"),
    Flag("--max-stream-share", "SPECSERVE_DRAFTER_MAX_STREAM_SHARE", _D["max_stream_share"], float,
         "the share of the context cache one verifier connection may hold (0-1]"),
    Flag("--lane", "SPECSERVE_DRAFTER_LANE", "auto", str,
         "same-host lane (a Unix socket for the verifier's steps): auto (a path in the temp "
         "dir) | off | a socket path (in a volume the verifier mounts too)"),
    Flag("--metrics-port", "SPECSERVE_DRAFTER_METRICS_PORT", DRAFTER_METRICS_PORT, int,
         "Prometheus /metrics port (0 = none)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve serve drafter",
        description="Serve the drafter (DFlash + DDTree, n-gram) over gRPC.")
    add_flags(parser, FLAGS)
    parser.add_argument("--port-file", default=None,
                        help="write the bound port to this file once SERVING (for --port 0)")
    return parser


def config_from_args(args: argparse.Namespace) -> DrafterConfig:
    return DrafterConfig(host=args.host, port=args.port, model=args.model,
                         draft_model=args.draft_model, device=args.device, dtype=args.dtype,
                         page_size=args.page_size, num_pages=args.drafter_pages,
                         metrics_port=args.metrics_port, warmup=args.warmup,
                         cuda_graphs=args.cuda_graphs, lane=args.lane,
                         max_stream_share=args.max_stream_share, grace_s=args.grace_s,
                         max_message_mb=args.max_message_mb, security=Security.from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    telemetry.setup_tracing("drafter")
    try:
        asyncio.run(run(config, args.port_file))
    except OSError as e:  # the port is in use
        print(f"specserve drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
