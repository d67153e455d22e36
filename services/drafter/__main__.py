"""`python -m services.drafter` / `specserve serve drafter`: flags (SPECSERVE_* env defaults,
generated from DrafterConfig's fields) → DrafterConfig → run.

`main(argv)` is what the `specserve` CLI delegates to. Traces go to OTEL_EXPORTER_OTLP_ENDPOINT
(service.name "drafter" unless OTEL_SERVICE_NAME says otherwise).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.common import bootstrap, settings
from services.drafter.config import DrafterConfig

FLAGS = bootstrap.service_flags(DrafterConfig)  # the flag table (tests read it)


def build_parser() -> argparse.ArgumentParser:
    return bootstrap.build_parser("drafter", "Serve the drafter (DFlash + DDTree, n-gram) over "
                                  "gRPC.", DrafterConfig)


def config_from_args(args: argparse.Namespace) -> DrafterConfig:
    """Raises ValueError for invalid values."""
    return settings.config_from_args(DrafterConfig, args)


async def _run(config: DrafterConfig) -> None:
    from services.drafter.server import run

    await run(config)


def main(argv: Sequence[str] | None = None) -> int:
    return bootstrap.service_main("drafter", build_parser(), DrafterConfig, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
