#!/usr/bin/env bash
# The GPU check: one command on a machine with one NVIDIA GPU, from a copy of this repository,
# in at most 8 minutes, everything into one folder ($OUT where set, else runs/gpu-check):
# report.md, the compare report and plots, raw records, versions and the full log (log.txt).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run  # the same steps on the CPU with a tiny job (< 2 min)
#
# The GPU machine has no network: what its Python lacks (pyzmq, pytest) is installed from wheels
# in ./wheels, made beforehand on a machine with network by benchmarks/gpu_wheels.sh. Wavelet
# itself needs no install: a folder of links puts this checkout on PYTHONPATH as `wavelet`.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/log.txt") 2>&1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
step() { echo; echo "=== $* ($(date +%T))"; }

step "1. what this machine lacks, from ./wheels (no network)"
# one Python asks for all of them (a Python each cost a second apiece)
MISSING=$("$PY" -c '
import importlib.util
for m in ("zmq", "setproctitle", "pytest", "pytest_timeout", "xdist"):
    if importlib.util.find_spec(m) is None:
        print(m)')
for module in $MISSING; do
    package=${module//_/-}; [ "$module" = zmq ] && package=pyzmq
    [ "$module" = xdist ] && package=pytest-xdist
    "$PY" -m pip install --no-index --find-links wheels -q "$package" \
        || echo "could not install $package from ./wheels (run benchmarks/gpu_wheels.sh)"
done
if ! "$PY" -c "import importlib.util as u; assert u.find_spec('wavelet.scripts.cli')" 2>/dev/null
then
    SHIM=$(mktemp -d)
    mkdir "$SHIM/wavelet" && ln -s "$PWD/scripts/package/__init__.py" "$SHIM/wavelet/__init__.py"
    for d in common ps worker scripts; do ln -s "$PWD/$d" "$SHIM/wavelet/$d"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
WAVELET=("$PY" -m wavelet.scripts.cli --log-level WARNING)

step "2. versions"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv | tee "$OUT/gpu.csv"
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import platform, torch, zmq, msgpack
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build "
      f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, pyzmq {zmq.__version__}, "
      f"libzmq {zmq.zmq_version()}, msgpack {msgpack.version}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
else:
    print("no CUDA device")
EOF

if [ $DRY = 1 ]; then
    DEVICE=cpu
    JOB=(--epochs 1 --shards 1)
    COMPARE=(--config configs/digits.toml --epochs 0 --max-seconds 3 --target-acc 0.9 --shards 1)
    MODES=ticktock,allreduce
    CAP=()
    JOB16=(--epochs 1 --model mlp --shards 1)  # fp16 convolutions crawl on a CPU
    RUNS16="fp16/ps"  # the path with the most parts; tests cover the others
else
    DEVICE=cuda:0
    JOB=()
    # A job whose activations fill the card: ResNet-18 (CIFAR-style, no early downsampling) on
    # 128x128 images, at a batch the probe below sizes so that one wave fills 55% of the cap:
    # tick-tock (about 1.2x one wave) fits, two waves started together (2x) do not.
    CAP_GIB=${WAVELET_GPU_CAP_GIB:-16}
    BATCH=$("$PY" benchmarks/gpu_check.py batch --cap-gib "$CAP_GIB" --fill 0.55)
    echo "batch per wave: $BATCH (cap $CAP_GIB GiB per device)"
    COMPARE=(--model resnet18 --dataset synthetic --set "dataset_kwargs.shape=[3,128,128]"
             --set dataset_kwargs.train_size=4096 --set dataset_kwargs.test_size=512
             --batch-size "$BATCH" --epochs 0 --max-seconds 40 --target-acc 0.3)
    MODES=ticktock,single,together,allreduce,allreduce2
    CAP=(--cuda-memory-gib "$CAP_GIB")
    JOB16=(--epochs 5)
    RUNS16="bf16/ps bf16/allreduce fp16/ps fp16/allreduce"
fi

step "3. GPU tests, and the default job on $DEVICE"
# only the files that hold GPU tests: collecting the whole suite imports every test module
"$PY" -m pytest -m gpu -n 0 -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) 2>&1 \
    | tail -5
"${WAVELET[@]}" launch --devices "$DEVICE" "${JOB[@]}" --run-dir "$OUT/default-job" \
    | tail -8

step "3b. 16-bit on $DEVICE: bf16 and fp16 compute, each with its wire dtype, PS and all-reduce"
for run in $RUNS16; do
    p=${run%/*}; mode=${run#*/}
    echo "--- precision $p, wire $p, $mode"
    "${WAVELET[@]}" launch --devices "$DEVICE" "${JOB16[@]}" --mode "$mode" --precision "$p" \
        --wire-dtype "$p" --run-dir "$OUT/16bit-$p-$mode" | grep -E "final|throughput|precision"
done

step "4. wavelet compare on $DEVICE: $MODES"
"${WAVELET[@]}" compare --devices "$DEVICE" "${COMPARE[@]}" "${CAP[@]}" --modes "$MODES" \
    --out "$OUT/compare" | tail -12

step "5. report"
"$PY" benchmarks/gpu_check.py report "$OUT" --device "$DEVICE" && cat "$OUT/report.md"
echo "everything is in $OUT"
