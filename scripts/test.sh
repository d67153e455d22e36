#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GRPC_VERBOSITY=ERROR TRITON_INTERPRET=1 PYTHONHASHSEED=0
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
