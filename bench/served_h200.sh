#!/usr/bin/env bash
# On the H200 (device tool): the served path's GPU tests and bench/bench_served.py.
#   bash bench/served_h200.sh "bench tests"        sections in order; each under its own timeout
#   bash bench/served_h200.sh suite                every CUDA test file (a correctness check)
#   BENCH_ARGS="--mps --contexts 1024,32768" bash bench/served_h200.sh bench
# Wheels for what the image lacks come carried in .whl/ (bench/_device_env.sh says which).
# Results go to $OUT (at most 8 files come back).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
# the served path's test files with a CUDA case (the ring, the wire, served = engine)
SERVED_GPU="tests/services/test_ring.py tests/services/test_wire_context.py tests/e2e/test_served_context.py"
for section in ${1:-bench tests}; do
  echo "== $section $(date -u +%T)"
  case $section in
    bench)
      timeout "${BENCH_S:-420}" python3 bench/bench_served.py --out "$OUT/served${TAG:-}.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/served${TAG:-}.log" | grep -v "^\[.*served .*{" ;;
    tests)
      timeout "${TESTS_S:-240}" python3 -m pytest -q -x -p no:cacheprovider $SERVED_GPU \
        -k "cuda or gpu" 2>&1 | tail -30 \
        | tee "$OUT/gpu_tests.log" ;;
    suite)  # every test file with a CUDA path (the CPU twins run too)
      timeout "${SUITE_S:-560}" python3 -m pytest -q -p no:cacheprovider -rs tests/kernels \
        tests/unit/test_graphs.py tests/unit/test_dflash_graphs.py tests/unit/test_warmup_chunks.py \
        tests/unit/test_logprobs.py $SERVED_GPU 2>&1 | tail -40 | tee "$OUT/gpu_suite.log" ;;
  esac
done
for f in /tmp/bench-served-*/*.log; do [ -f "$f" ] && { echo "---- $f"; tail -40 "$f"; }; done \
  > "$OUT/services.log" 2>/dev/null
echo "== done $(date -u +%T)"
