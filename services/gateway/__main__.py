"""`python -m services.gateway` / `specserve serve gateway`: flags (SPECSERVE_* env defaults,
generated from GatewayConfig's fields) → GatewayConfig → serve.

Traces go to OTEL_EXPORTER_OTLP_ENDPOINT (service.name "gateway" unless OTEL_SERVICE_NAME says
otherwise)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.common import bootstrap, settings
from services.gateway.config import GatewayConfig

DESCRIPTION = ("The specserve gateway: text in, streamed text chunks + stats out, over gRPC and "
               "an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
               "/v1/models, /health).")


FLAGS = bootstrap.service_flags(GatewayConfig)  # the flag table (tests read it)


def build_parser() -> argparse.ArgumentParser:
    return bootstrap.build_parser("gateway", DESCRIPTION, GatewayConfig)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The GatewayConfig of parsed flags (raises ValueError for bad values)."""
    return settings.config_from_args(GatewayConfig, args)


async def _serve(config: GatewayConfig) -> None:
    from services.gateway.server import serve

    await serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    return bootstrap.service_main("gateway", build_parser(), GatewayConfig, _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
