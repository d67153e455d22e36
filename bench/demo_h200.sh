#!/usr/bin/env bash
# On a GPU machine: train the demo pair (`specserve train-demo --recipe cpu`) and run the commit
# probe against the three services on it at 1k / 16k / 64k / 128k. Writes under ${OUT:-out}/.
#   bash bench/demo_h200.sh [target_steps] [drafter_steps]     (default: the recipe's)
#   CKPT=checkpoints bash bench/demo_h200.sh                    (probe a trained pair, no training)
set -euo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 GRPC_VERBOSITY=ERROR
unset TRITON_INTERPRET
DEV=${DEVICE:-cuda}; TMP=$(mktemp -d); CK=${CKPT:-$TMP/ckpt}; T="$CK/demo-target"; D="$CK/demo-drafter"
if [ -z "${CKPT:-}" ]; then
  steps=(); [ -n "${1:-}" ] && steps+=(--target-steps "$1"); [ -n "${2:-}" ] && steps+=(--drafter-steps "$2")
  echo "== train ${steps[*]:-recipe steps} $(date -u)"
  python3 -m services.cli train-demo --recipe cpu --out "$CK" --device "$DEV" --seed 0 \
    "${steps[@]}" 2>&1 | tee "$OUT/train.log" | grep -v "step .*[1-9]0/" || true
fi
ls -la "$T" "$D"
start() {  # name, flags...
  local name=$1; shift
  python3 -m services."$name" --port 0 --port-file "$TMP/$name.port" "$@" > "$TMP/$name.log" 2>&1 &
  for _ in $(seq 600); do [ -s "$TMP/$name.port" ] && return 0; sleep 0.2; done
  echo "$name did not start"; tail -30 "$TMP/$name.log"; exit 1
}
echo "== services $(date -u)"
start drafter --model "$T" --draft-model "$D" --device "$DEV"
start verifier --model "$T" --draft-model "$D" --drafter "127.0.0.1:$(cat "$TMP/drafter.port")" \
  --device "$DEV" --max-draft-tokens 64 --default-budget 16 --kv-memory-gb 8 \
  --max-num-batched-tokens 8192
start gateway --model "$T" --verifier "127.0.0.1:$(cat "$TMP/verifier.port")"
echo "== probe $(date -u)"
python3 -m services.cli probe --gateway "127.0.0.1:$(cat "$TMP/gateway.port")" --model "$T" \
  --contexts "${CONTEXTS:-1k,16k,64k,128k}" --new-tokens 64 --drafter dflash --budget 16 \
  --json "$OUT/probe.json" --plot "$OUT/probe.png" 2>&1 | tee "$OUT/probe.log"
kill %1 %2 %3 2>/dev/null || true
# at most 8 files come back from the device: one archive, one log of the services
[ -z "${CKPT:-}" ] && tar czf "$OUT/ckpt.tgz" -C "$TMP" ckpt
for n in drafter verifier gateway; do echo "---- $n"; tail -50 "$TMP/$n.log"; done > "$OUT/services.log"
echo "== done $(date -u)"
