#!/usr/bin/env bash
# The suite on a starved, busy machine, as CI or a slower user's machine may be: in a fresh clone
# of the committed HEAD, `bash .ci/run` (setup, ruff, the README's test command) RUNS times in a
# row, pinned to one core (CORE), while a busy loop runs on every other core beside it (HOG=0:
# none). Prints each run's time and result; exits 1 at the first failing run.
#
#   bash scripts/stress_suite.sh                  # 3 runs on core 0, a CPU hog on the others
#   RUNS=1 HOG=0 bash scripts/stress_suite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
HOG=${HOG:-1}
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
if [ "$HOG" = 1 ]; then
  for core in $(seq 0 $(($(nproc) - 1))); do
    [ "$core" = "$CORE" ] && continue
    taskset -c "$core" python3 -c "while True: pass" &
    hogs+=($!)
  done
  echo "a busy loop on every core but $CORE (${#hogs[@]} of them)"
fi

for i in $(seq 1 "$RUNS"); do
  label="pinned-to-core-$CORE-run-$i-of-$RUNS"
  start=$SECONDS
  # a pytest temp folder of its own: two of these scripts may run side by side, one per core
  if CI=true PYTEST_ADDOPTS="--basetemp=$work/tmp-$i" taskset -c "$CORE" bash .ci/run \
    </dev/null >"$work/$label.log" 2>&1; then
    echo "$label: passed in $((SECONDS - start)) s ($(tail -n 1 "$work/$label.log"))"
  else
    echo "$label: FAILED after $((SECONDS - start)) s; the end of its log:"
    tail -n 60 "$work/$label.log"
    exit 1
  fi
done
