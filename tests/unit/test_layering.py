"""The core imports without grpc or OpenTelemetry (services own transport and telemetry)."""

import subprocess
import sys


def test_core_imports_without_grpc_or_otel():
    code = ("import sys, specserve, specserve.engine.engine, specserve.spec.ddtree, "
            "specserve.drafters.ngram, specserve.drafters.dflash, specserve.probe; "
            "print(sorted(m for m in ('grpc', 'opentelemetry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
