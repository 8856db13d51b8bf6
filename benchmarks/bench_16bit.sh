#!/usr/bin/env bash
# Accuracy of 16-bit training against fp32 at the same number of steps (the README's "16-bit"
# table): each job with fp32 everywhere, with a bf16 wire (--wire-dtype bf16: 16-bit gradients
# and weights between waves and shards, or all-reduced buckets) and with bf16 compute
# (--precision bf16), under tick-tock on the PS and under all-reduce, for several seeds.
# Jobs: the default job (digits, 15 epochs; default2: on two CPU workers, so that all-reduce has
# buckets to compress: one rank alone moves nothing) and the narrow ResNet at a fixed number of
# epochs (not its 60 s budget, so every run takes the same steps). Summary: benchmarks/summarize_16bit.py.
# About 4 minutes per seed for the default job and 6 for the narrow ResNet on 2 cores; run
# nothing else meanwhile. Usage: SEEDS="0 1 2" JOBS="default narrow" bash benchmarks/bench_16bit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WAVELET:-.venv/bin/wavelet}
OUT=${OUT:-runs/bench-16bit}
SEEDS=${SEEDS:-0 1 2}
JOBS=${JOBS:-default narrow}
# wire-fp16, wire-bf16-ef (error feedback): more variants, by name
VARIANTS=${VARIANTS:-fp32 wire-bf16 compute-bf16}
mkdir -p "$OUT"
for job in $JOBS; do
    case $job in
        default) args=() ;;
        default2) args=(--devices cpu,cpu) ;;  # two workers: all-reduce moves its buckets
        narrow) args=(--config configs/narrow_resnet.toml --epochs 2 --max-seconds 0) ;;
        *) echo "unknown job $job (default, default2, narrow)" >&2; exit 2 ;;
    esac
    for seed in $SEEDS; do
        for mode in ps allreduce; do
            for variant in $VARIANTS; do
                case $variant in
                    fp32) extra=() ;;
                    wire-bf16) extra=(--wire-dtype bf16) ;;
                    wire-fp16) extra=(--wire-dtype fp16) ;;
                    wire-bf16-ef) extra=(--wire-dtype bf16 --wire-error-feedback true) ;;
                    compute-bf16) extra=(--precision bf16) ;;
                    *) echo "unknown variant $variant" >&2; exit 2 ;;
                esac
                dir="$OUT/$job-$mode-$variant-seed$seed"
                rm -rf "$dir"
                $W launch "${args[@]}" --mode "$mode" --seed "$seed" "${extra[@]}" \
                    --run-dir "$dir" > "$dir.log" 2>&1 || echo "failed: $dir (see $dir.log)" >&2
            done
        done
    done
done
.venv/bin/python benchmarks/summarize_16bit.py "$OUT"
