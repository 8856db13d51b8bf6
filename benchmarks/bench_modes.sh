#!/usr/bin/env bash
# The comparisons quoted in README.md and docs/design.md, rerunnable: tick-tock against one wave,
# two waves started together, bulk-synchronous and all-reduce (wavelet compare), and staleness
# sweeps with and without a straggler (wavelet tune). Reports land in runs/bench/*/report.md.
# About an hour on a 2-core machine; run nothing else meanwhile. `bash benchmarks/bench_modes.sh
# compare`, `... tune` or `... budget` (equal-memory tables, about 30 minutes) runs one part.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WAVELET:-.venv/bin/wavelet}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
RESNET=(--config configs/resnet18_synthetic.toml --epochs 0 --max-seconds 60 --target-acc 0.3)
PART=${1:-all}  # all | compare | tune | budget
# tested every second on copies (tested after training): time to target to a second, not an epoch
NARROW=(--config configs/narrow_resnet.toml --max-seconds 45 --target-acc 0.6 --eval-every-s 1)

if [ "$PART" = budget ] || [ "$PART" = all ]; then
# Equal memory: every mode at the largest batch whose activations fit 1.3x one wave's peak,
# on one CPU device and on two (two worker processes or ranks, one core each).
for devices in cpu cpu,cpu; do
    $W compare --memory-budget 1.3x --devices $devices --out "$OUT/budget-digits-$devices"
    $W compare "${NARROW[@]}" --memory-budget 1.3x --devices $devices \
        --out "$OUT/budget-narrow-resnet-$devices"
done
fi
[ "$PART" = budget ] && exit 0

if [ "$PART" != tune ]; then
$W compare --out "$OUT/compare-digits"
$W compare "${RESNET[@]}" --out "$OUT/compare-resnet18"
fi
[ "$PART" = compare ] && exit 0
$W tune --devices cpu,cpu --out "$OUT/tune-digits"
$W tune --devices cpu,cpu --set slow_wave=2 --set slow_factor=3 --out "$OUT/tune-digits-straggler"
$W tune "${RESNET[@]}" --max-seconds 45 --bounds 0,1,inf --policies apply,scale \
    --out "$OUT/tune-resnet18"
$W tune "${RESNET[@]}" --max-seconds 45 --bounds 0,1,inf --policies apply,scale \
    --devices cpu,cpu --set slow_wave=2 --set slow_factor=2 --out "$OUT/tune-resnet18-straggler"
