#!/usr/bin/env bash
# Create .venv and install specserve with its test oracles, from scratch, on a fresh machine
# that has only Python 3.11+ and pip. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# torch 2.13.0 is the CPU build on this machine's disk (a plain `torch` would fetch a CUDA build).
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch"
  "$VPY" -m pip install -q torch==2.13.0
fi
echo "[setup] installing specserve[dev]"
"$VPY" -m pip install -q -e ".[dev]"
# dflash (the reference drafter) pins its own torch/transformers: install it without its deps.
"$VPY" -m pip install -q --no-deps dflash==0.1.0
"$VPY" -c "import specserve, torch, transformers, dflash; print('[setup] ok: torch', torch.__version__)"
