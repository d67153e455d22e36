#!/usr/bin/env bash
# On the H200 (device tool): bench/bench_adaptive.py on the committed demo pair and on the random
# Qwen3-8B-body pair (trees never accepted: speculation cannot pay). Results go to $OUT.
#   bash bench/adaptive_h200.sh "demo random"
#   CONTEXTS=1024 DEMO_ARGS="--redecide 1" RANDOM_32K=0 \
#     bash bench/adaptive_h200.sh "phases demo logprobs random"   # one 10-minute call
# phases: experiments/adaptive_phases.py, µs a step by engine phase, fixed vs adaptive
#   (PHASES_ARGS="--random-pair /tmp/pair8b --text novel" TAG=_8b: on the random pair)
# ab: the demo pass on a base commit's code and on this tree, alternated old new new old on one
#   machine, then bench/adaptive_ab_report.py (here first: bash bench/served_ab_h200.sh prepare
#   <commit>; carry [".whl", ".baseline"]), e.g. DEMO_ARGS="--new-tokens 128 --repeats 3"
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # the wheels carried in .whl/, PYTHONPATH, $OUT
GPU=${GPU:-"--device cuda --dtype bfloat16"}  # GPU="--device cpu": the same sections on the CPU
OUT=$(cd "$OUT" && pwd)  # absolute: the ab section's old side runs inside the baseline
for section in ${1:-demo random}; do
  echo "== $section $(date -u +%T)"
  case $section in
    phases)
      timeout "${PHASES_S:-150}" python3 experiments/adaptive_phases.py $GPU ${PHASES_ARGS:-} \
        --out "$OUT/adaptive_phases${TAG:-}.json" 2>&1 | tee "$OUT/adaptive_phases${TAG:-}.log" ;;
    demo)
      timeout "${DEMO_S:-300}" python3 bench/bench_adaptive.py $GPU --contexts ${CONTEXTS:-1024 8192} \
        --out "$OUT/adaptive_demo.json" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/adaptive_demo.log" ;;
    random)  # 1k at batch 1 and 8; 32k at batch 1 (three engines' KV must fit beside 16 GB)
      timeout "${RANDOM_S:-240}" python3 bench/bench_adaptive.py $GPU --random-pair /tmp/pair8b \
        --texts novel --contexts 1024 --new-tokens 48 --chunk 8192 \
        --out "$OUT/adaptive_8b.json" ${RANDOM_ARGS:-} 2>&1 | tee "$OUT/adaptive_8b.log"
      [ "${RANDOM_32K:-1}" = 1 ] && timeout "${RANDOM_S:-240}" python3 bench/bench_adaptive.py $GPU --random-pair /tmp/pair8b \
        --texts novel --contexts 32768 --batch 1 --new-tokens 48 --chunk 8192 \
        --out "$OUT/adaptive_8b_32k.json" ${RANDOM_ARGS:-} 2>&1 | tee "$OUT/adaptive_8b_32k.log" ;;
    ab)
      base=${BASELINE:-.baseline}
      [ -d "$base" ] || { echo "no $base/: bash bench/served_ab_h200.sh prepare <commit>" >&2; exit 1; }
      echo "old: $(cat "$base/COMMIT" 2>/dev/null || echo "$base")"
      i=0; pair=$PWD/checkpoints  # both sides: this tree's demo pair (the same weights)
      for side in old new new old; do
        i=$((i + 1)); f="$OUT/adaptive_ab_${i}_$side"
        dir=$PWD; [ "$side" = old ] && dir=$(cd "$base" && pwd)  # its bench and package first
        (cd "$dir" && export PYTHONPATH=$dir:$dir/bench:$PYTHONPATH \
          && python3 -c "import specserve.engine.adaptive as a; print('$side:', a.__file__)" \
          && timeout "${DEMO_S:-300}" python3 bench/bench_adaptive.py $GPU \
            --model "$pair/demo-target" --draft-model "$pair/demo-drafter" \
            --contexts ${CONTEXTS:-1024} --out "$f.json" ${DEMO_ARGS:-}) > "$f.log" 2>&1 \
          || echo "round $i ($side) failed: $f.log"
        head -1 "$f.log"
      done
      python3 bench/adaptive_ab_report.py "$OUT"/adaptive_ab_*_*.json \
        --out "$OUT/adaptive_ab.json" | tee "$OUT/adaptive_ab.md" ;;
    logprobs)  # the GPU path's logprobs (CUDA graphs, fused kernels, bf16) against transformers
      timeout "${LOGPROBS_S:-120}" python3 -m pytest -q -x -p no:cacheprovider \
        tests/unit/test_logprobs.py -k gpu 2>&1 | tail -5 | tee "$OUT/logprobs_gpu.log" ;;
  esac
done
echo "== done $(date -u +%T)"
