#!/usr/bin/env bash
# Time to accuracy of the PS update rules against all-reduce, at equal memory (the README's
# "Time to accuracy" table): the narrow ResNet to 60% at a budget of 1.3x one wave's peak, for
# each seed and device count. Variants of the PS modes: plain (stale_policy = apply, the default
# before this benchmark); momentum corrected for asynchrony; the staleness-aware step size
# (stale_policy = scale, the default since); both. At a memory budget the lr already follows
# the samples per update (linear), so update_lr = by-samples changes nothing here and is not run.
# Reports land in $OUT/<devices>-seed<S>-<variant>/report.md; the summary table is printed at the
# end (benchmarks/summarize_updates.py). About 10 minutes per seed and device count on 2 cores;
# run nothing else meanwhile. Usage: SEEDS="0 1 2" DEVICES="cpu,cpu cpu" bash benchmarks/bench_updates.sh
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WAVELET:-.venv/bin/wavelet}
OUT=${OUT:-runs/bench-updates}
SEEDS=${SEEDS:-0 1 2}
DEVICES=${DEVICES:-cpu,cpu cpu}
VARIANTS=${VARIANTS:-plain momentum scale scale-momentum}
JOB=(--config configs/narrow_resnet.toml --max-seconds 45 --target-acc 0.6 --memory-budget 1.3x
     --eval-every-s 1)
mkdir -p "$OUT"
for devices in $DEVICES; do
    for seed in $SEEDS; do
        for variant in $VARIANTS; do
            case $variant in
                plain) extra=(--modes ticktock-async,ticktock-groups,allreduce,allreduce2
                    --stale-policy apply) ;;
                momentum) extra=(--modes ticktock-async,ticktock-groups --stale-policy apply
                    --set momentum_correction=true) ;;
                scale) extra=(--modes ticktock-async --stale-policy scale) ;;
                scale-momentum) extra=(--modes ticktock-async --stale-policy scale
                    --set momentum_correction=true) ;;
                *) echo "unknown variant $variant" >&2; exit 2 ;;
            esac
            $W compare "${JOB[@]}" --devices "$devices" --seed "$seed" "${extra[@]}" \
                --out "$OUT/$devices-seed$seed-$variant"
        done
    done
done
.venv/bin/python benchmarks/summarize_updates.py "$OUT"
