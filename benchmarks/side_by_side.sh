#!/usr/bin/env bash
# A change that should not change speed, checked: bench_ps.py (twice each, alternating) and
# `wavelet compare` on the default job, for commit BASE and for this working tree, side by side in
# one run. Usage: bash benchmarks/side_by_side.sh BASE [OUT]  (about 15 minutes on 2 cores; run
# nothing else meanwhile). Both sides use this checkout's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?give the commit to compare with, e.g. HEAD~5}
OUT=$(realpath -m "${2:-runs/side-by-side}")
HERE=$(pwd)
PY="$HERE/.venv/bin/python"
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add --detach -q "$WORK/base" "$BASE"
mkdir -p "$WORK/path-base" "$WORK/path-head" "$OUT"
# a folder named wavelet on PYTHONPATH wins over the editable install, in children too
ln -s "$WORK/base" "$WORK/path-base/wavelet"
ln -s "$HERE" "$WORK/path-head/wavelet"
for round in 1 2; do
    for side in base head; do
        PYTHONPATH="$WORK/path-$side" "$PY" "$WORK/path-$side/wavelet/benchmarks/bench_ps.py" \
            > "$OUT/bench_ps-$side-$round.txt" 2>&1
    done
done
for side in base head; do
    rm -rf "$OUT/compare-$side"
    PYTHONPATH="$WORK/path-$side" "$PY" -m wavelet.scripts.cli compare --out "$OUT/compare-$side" \
        > "$OUT/compare-$side.txt" 2>&1
done
for f in "$OUT"/bench_ps-*.txt; do
    echo "== $(basename "$f" .txt)"
    grep '^| wavelet\|^| raw\|^| gloo' "$f" | cut -d'|' -f2,3
done
for side in base head; do
    echo "== compare, $side"
    grep '^| ' "$OUT/compare-$side/report.md" | cut -d'|' -f2-5
done
