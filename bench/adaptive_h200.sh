#!/usr/bin/env bash
# On the H200 (device tool): bench/bench_adaptive.py on the committed demo pair and on the random
# Qwen3-8B-body pair (trees never accepted: speculation cannot pay). Results go to $OUT.
#   bash bench/adaptive_h200.sh "demo random"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
GPU="--device cuda --dtype bfloat16"
for section in ${1:-demo random}; do
  echo "== $section $(date -u +%T)"
  case $section in
    demo)
      timeout "${DEMO_S:-300}" python3 bench/bench_adaptive.py $GPU --contexts 1024 8192 \
        --out "$OUT/adaptive_demo.json" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/adaptive_demo.log" ;;
    random)  # 1k at batch 1 and 8; 32k at batch 1 (three engines' KV must fit beside 16 GB)
      timeout "${RANDOM_S:-240}" python3 bench/bench_adaptive.py $GPU --random-pair /tmp/pair8b \
        --texts novel --contexts 1024 --new-tokens 48 --chunk 8192 \
        --out "$OUT/adaptive_8b.json" ${RANDOM_ARGS:-} 2>&1 | tee "$OUT/adaptive_8b.log"
      timeout "${RANDOM_S:-240}" python3 bench/bench_adaptive.py $GPU --random-pair /tmp/pair8b \
        --texts novel --contexts 32768 --batch 1 --new-tokens 48 --chunk 8192 \
        --out "$OUT/adaptive_8b_32k.json" ${RANDOM_ARGS:-} 2>&1 | tee "$OUT/adaptive_8b_32k.log" ;;
  esac
done
echo "== done $(date -u +%T)"
