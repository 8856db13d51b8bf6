#!/usr/bin/env bash
# The suite on a starved machine, as CI or a slower user's machine may be: in a fresh clone of
# the committed HEAD, `bash .ci/run` (setup, ruff, the README's test command) RUNS times in a row
# pinned to one core, then HOG_RUNS times with a busy loop on every core beside it. Prints each
# run's time and result; exits 1 at the first failing run.
#
#   bash scripts/stress_suite.sh              # 3 pinned runs, then 1 beside a CPU hog
#   RUNS=1 HOG_RUNS=0 bash scripts/stress_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
HOG_RUNS=${HOG_RUNS:-1}
CORE=${CORE:-0}
work=$(mktemp -d /tmp/wavelet-stress.XXXXXX)
hogs=()
cleanup() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

git clone -q . "$work/clone"
cd "$work/clone"
echo "fresh clone of $(git rev-parse --short HEAD) in $work/clone"

run_suite() {  # $1: label, then the command prefix
  local label=$1; shift
  local start=$SECONDS
  if CI=true "$@" bash .ci/run </dev/null >"$work/$label.log" 2>&1; then
    echo "$label: passed in $((SECONDS - start)) s ($(tail -n 1 "$work/$label.log"))"
  else
    echo "$label: FAILED after $((SECONDS - start)) s; the end of its log:"
    tail -n 40 "$work/$label.log"
    exit 1
  fi
}

for i in $(seq 1 "$RUNS"); do
  run_suite "pinned-$i-of-$RUNS" taskset -c "$CORE"
done
for i in $(seq 1 "$HOG_RUNS"); do
  for _ in $(seq 1 "$(nproc)"); do
    python3 -c "while True: pass" &
    hogs+=($!)
  done
  run_suite "beside-a-cpu-hog-$i" env
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  hogs=()
done
