#!/usr/bin/env bash
# The figures of docs/performance.md, "Stragglers" and "Faults and membership": two emulated
# nodes at 1 Gbit/s (benchmarks/cluster.py; root, ip, tc and a cgroup cpu controller), the narrow
# ResNet to 60%, 45 s per run, three seeds, every mode side by side in each scenario.
#   bash benchmarks/bench_faults.sh [OUT]   (about 45 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/bench-faults}
PY=${PYTHON:-.venv/bin/python}
run() {  # run NAME FLAGS...
    local name=$1; shift
    # the test metric every second of training, so that time to target is known to a second
    "$PY" benchmarks/cluster.py --config configs/narrow_resnet.toml --rates 1gbit \
        --seconds 45 --target-acc 0.6 --out "$OUT/$name" "$@" -- --eval-every-s 1
}
SEEDS=${SEEDS:-0,1,2}
run equal --modes ticktock,ticktock-kofn,allreduce --seeds "$SEEDS"
run slow --modes ticktock,ticktock-kofn,bsp,allreduce --seeds "$SEEDS" --slow 1:50
run noisy --modes ticktock,ticktock-kofn,allreduce --seeds "$SEEDS" --noisy 1:10:10:30
run leave-join --modes ticktock,allreduce --seeds "$SEEDS" --leave 1@5 --join 1@20
run preempt --modes ticktock --seeds 0 --preempt 1@10
