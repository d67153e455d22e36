#!/usr/bin/env bash
# Regenerate the committed protobuf / gRPC modules from proto/ into specserve/v1/ (the Python
# package mirrors the proto path, so generated imports need no rewriting). Only services/ import
# them; the core never does. CI checks the committed files are current (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=specserve/v1
rm -f "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
"$PY" -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
  proto/specserve/v1/*.proto
printf '"""Generated protobuf / gRPC modules (scripts/gen_proto.sh). Do not edit."""\n' \
  > "$OUT/__init__.py"
