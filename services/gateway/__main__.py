"""`python -m services.gateway` / `specserve serve gateway`: flags (SPECSERVE_* env defaults).

Traces go to OTEL_EXPORTER_OTLP_ENDPOINT (service.name "gateway" unless OTEL_SERVICE_NAME says
otherwise)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.convert import MAX_STOP_BYTES, MAX_STOP_STRINGS
from services.common.security import SECURITY_FLAGS, Security
from services.common.server import MiB
from services.common.settings import (
    COMMON,
    DEFAULT_HOST,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    HTTP_PORT,
    VERIFIER_PORT,
    Flag,
    add_flags,
)


def port_or_off(raw: str) -> int | None:
    """A port number, or "off" (None)."""
    return None if str(raw).lower() == "off" else int(raw)


port_or_off.__name__ = "port or off"

FLAGS = [
    *COMMON,
    *SECURITY_FLAGS,
    Flag("--port", "SPECSERVE_GATEWAY_PORT", GATEWAY_PORT, int, "port to bind (0 = any free)"),
    Flag("--http-port", "SPECSERVE_GATEWAY_HTTP_PORT", HTTP_PORT, port_or_off,
         "OpenAI-compatible HTTP API port (0 = any free, off = none)"),
    Flag("--served-model-name", "SPECSERVE_SERVED_MODEL_NAME", None, str,
         "model id of the HTTP API (default: the model directory's name)"),
    Flag("--verifier", "SPECSERVE_VERIFIER_ADDR", f"{DEFAULT_HOST}:{VERIFIER_PORT}", str,
         "verifier address HOST:PORT"),
    Flag("--model", "SPECSERVE_MODEL", None, str, "target model directory (its tokenizer.json)"),
    Flag("--max-message-mb", "SPECSERVE_MAX_MESSAGE_MB", 64, int,
         "largest request message accepted, MiB (larger: RESOURCE_EXHAUSTED)"),
    Flag("--request-timeout-s", "SPECSERVE_REQUEST_TIMEOUT_S", 600.0, float,
         "verifier deadline for requests whose client set none"),
    Flag("--metrics-port", "SPECSERVE_GATEWAY_METRICS_PORT", GATEWAY_METRICS_PORT, int,
         "Prometheus /metrics port (0 = none)"),
    Flag("--max-stop-strings", "SPECSERVE_MAX_STOP_STRINGS", MAX_STOP_STRINGS, int,
         "most stop strings per request (more: INVALID_ARGUMENT)"),
    Flag("--max-stop-bytes", "SPECSERVE_MAX_STOP_BYTES", MAX_STOP_BYTES, int,
         "most UTF-8 bytes of a request's stop strings in all (more: INVALID_ARGUMENT)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve serve gateway",
        description="The specserve gateway: text in, streamed text chunks + stats out, over "
                    "gRPC and an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health).")
    add_flags(parser, FLAGS)
    parser.add_argument("--port-file", default=None,
                        help="write the bound port here once SERVING (useful with --port 0)")
    parser.add_argument("--http-port-file", default=None,
                        help="write the HTTP API's bound port here (useful with --http-port 0)")
    parser.add_argument("--grace-s", type=float, default=5.0,
                        help="seconds to drain in-flight requests on SIGTERM")
    return parser


def config_from_args(args: argparse.Namespace):
    """The GatewayConfig of parsed flags (raises ValueError for bad values)."""
    from services.gateway.server import GatewayConfig

    return GatewayConfig(
        model=args.model, verifier=args.verifier, host=args.host, port=args.port,
        port_file=args.port_file, max_message_bytes=args.max_message_mb * MiB,
        request_timeout_s=args.request_timeout_s, grace_s=args.grace_s,
        metrics_port=args.metrics_port, max_stop_strings=args.max_stop_strings,
        max_stop_bytes=args.max_stop_bytes, security=Security.from_args(args),
        http_port=args.http_port, http_port_file=args.http_port_file,
        served_model_name=args.served_model_name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.common import telemetry
    from services.gateway.server import serve
    from specserve.errors import SpecServeError

    try:
        config = config_from_args(args)
        telemetry.setup_tracing("gateway")
        asyncio.run(serve(config))
    except (ValueError, SpecServeError, OSError) as e:
        print(f"specserve gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
