#!/usr/bin/env bash
# The README demo, from a fresh machine: set up .venv, start gateway + verifier + drafter on the
# bundled demo pair (checkpoints/; GPU if there is one, else CPU), stream one generation, run the
# commit probe at small contexts, and say where the traces are. Everything lands in $DEMO_DIR.
#   DEMO_CONTEXTS  probe contexts (default 1k,2k,4k)      DEMO_PORT  base port (default 50051)
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO_DIR=${DEMO_DIR:-.demo}
CONTEXTS=${DEMO_CONTEXTS:-1k,2k,4k}
PORT=${DEMO_PORT:-50051}
bash scripts/setup.sh
SS=.venv/bin/specserve
mkdir -p "$DEMO_DIR"
DEMO_DIR=$(cd "$DEMO_DIR" && pwd)  # absolute: the services run from the repository root too
rm -rf "$DEMO_DIR/traces"
export SPECSERVE_TRACE_DIR="$DEMO_DIR/traces" OTEL_BSP_SCHEDULE_DELAY=500
export SPECSERVE_GATEWAY_METRICS_PORT=0 SPECSERVE_VERIFIER_METRICS_PORT=0 \
  SPECSERVE_DRAFTER_METRICS_PORT=0

echo "[demo] starting drafter, verifier and gateway on the demo pair (log: $DEMO_DIR/up.log)"
"$SS" up --ports "$PORT" > "$DEMO_DIR/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
until grep -q "specserve up: ready" "$DEMO_DIR/up.log"; do
  if ! kill -0 $UP 2>/dev/null; then cat "$DEMO_DIR/up.log"; echo "[demo] up failed"; exit 1; fi
  sleep 1
done
grep "specserve up:" "$DEMO_DIR/up.log"

echo; echo "[demo] a streamed generation (greedy, DFlash drafter + DDTree budget 16):"
"$SS" generate --gateway "127.0.0.1:$PORT" --max-tokens 96 --ignore-eos --budget 16 \
  --prompt "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The"
echo; echo "[demo] the commit probe at contexts $CONTEXTS (predictable vs novel text):"
"$SS" probe --gateway "127.0.0.1:$PORT" --contexts "$CONTEXTS" --new-tokens 64 --budget 16 \
  --json "$DEMO_DIR/probe.json" --plot "$DEMO_DIR/probe.png"
sleep 1  # the services flush their spans every 0.5 s
echo
echo "[demo] probe rows: $DEMO_DIR/probe.json (each with its trace_id), plot: $DEMO_DIR/probe.png"
echo "[demo] traces (one JSON span per line, per service): $DEMO_DIR/traces/*.jsonl"
echo "       e.g. grep <trace_id> $DEMO_DIR/traces/*.jsonl; with docker compose up they go to"
echo "       Jaeger instead: http://localhost:16686 (see docs/deploy.md, 'Docker Compose')"
