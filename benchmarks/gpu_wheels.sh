#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels benchmarks/gpu_check.sh installs on the GPU machine
# (Python 3.12, x86_64 Linux, no network): pyzmq, setproctitle and the test tools (pytest, its timeout and
# xdist plugins). They land in ./wheels
# (git-ignored); carry it to the GPU machine with the checkout (the device tool: carry ["wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d wheels pyzmq setproctitle pytest pytest-timeout pytest-xdist
ls wheels
