"""`python -m services.verifier` / `specserve serve verifier`: flags → VerifierConfig → run.

Every flag has a `SPECSERVE_*` environment default, generated from VerifierConfig's fields
(services/common/settings.py). SIGINT and SIGTERM drain in-flight requests for --grace-s, then
flush buffered spans and exit. Traces go to OTEL_EXPORTER_OTLP_ENDPOINT (service.name "verifier"
unless OTEL_SERVICE_NAME says otherwise).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.common import bootstrap, settings
from services.verifier.config import VerifierConfig

FLAGS = bootstrap.service_flags(VerifierConfig)  # the flag table (tests read it)


def build_parser() -> argparse.ArgumentParser:
    return bootstrap.build_parser("verifier", "the verifier service (target model)",
                                  VerifierConfig)


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    """Raises ValueError for invalid values."""
    return settings.config_from_args(VerifierConfig, args)


async def _run(config: VerifierConfig) -> None:
    from services.verifier.server import run

    await run(config)


def main(argv: Sequence[str] | None = None) -> int:
    return bootstrap.service_main("verifier", build_parser(), VerifierConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
