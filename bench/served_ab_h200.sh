#!/usr/bin/env bash
# bench/bench_served.py on a base commit's code and on this tree, in one device call, so that
# a change is measured side by side on the same machine (absolute times move between calls).
#   here:     bash bench/served_ab_h200.sh prepare <commit>   # its code into .baseline/ (ignored)
#   device:   BENCH_ARGS='--contexts 1024 --batch8-contexts 1024,4096 --variants auto' \
#             bash bench/served_ab_h200.sh run [old new | new old]
#             (the device tool's carry: [".whl", ".baseline"]; each run under BENCH_S seconds)
# Writes $OUT/served_old.{json,log} and $OUT/served_new.{json,log} (bench/served_h200.sh's).
set -uo pipefail
case ${1:-} in
  prepare)
    base=${2:?"usage: bash bench/served_ab_h200.sh prepare <commit>"}
    rm -rf .baseline && mkdir .baseline || exit 1
    git archive "$base" specserve services bench checkpoints/demo-target checkpoints/demo-drafter \
      | tar -x -C .baseline \
      || exit 1
    ln -s ../.whl .baseline/.whl
    git rev-parse "$base" > .baseline/COMMIT
    echo "base $(cat .baseline/COMMIT) in .baseline/" ;;
  run)
    [ -d .baseline ] || { echo "no .baseline/: run 'prepare <commit>' here and carry it" >&2; exit 1; }
    echo "base $(cat .baseline/COMMIT 2>/dev/null)"
    for side in ${2:-old} ${3:-new}; do
      if [ "$side" = old ]; then
        (cd .baseline && TAG=_old bash bench/served_h200.sh bench)
      else
        TAG=_new bash bench/served_h200.sh bench
      fi 2>&1 | grep -v "Warning\|^\[W" | tail -16
    done ;;
  *) echo "usage: bash bench/served_ab_h200.sh prepare <commit> | run [old new | new old]" >&2
     exit 2 ;;
esac
