"""The core imports without grpc (services own the transport)."""

import subprocess
import sys


def test_core_imports_without_grpc():
    code = ("import sys, specserve, specserve.engine.engine, specserve.spec.ddtree, "
            "specserve.drafters.ngram; print('grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
