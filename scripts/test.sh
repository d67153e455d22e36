#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GRPC_VERBOSITY=ERROR TRITON_INTERPRET=1 PYTHONHASHSEED=0
.venv/bin/ruff check .
# the committed generated protobuf modules must match proto/
PY=.venv/bin/python bash scripts/gen_proto.sh
git diff --exit-code --stat -- specserve/v1 || { echo "specserve/v1 is stale: run scripts/gen_proto.sh"; exit 1; }
.venv/bin/python -m pytest -q "$@"
