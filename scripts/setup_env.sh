#!/usr/bin/env bash
# Creates .venv with Wavelet and its test tools. Idempotent: a second run only re-checks.
# The pinned CPU wheel of torch goes in first so that pip never pulls a multi-GB CUDA build
# on a CPU-only machine; users on GPU hosts install torch their own way (setup.cfg: torch>=2.1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install --disable-pip-version-check -q "$@"; }
python -c "import torch" 2>/dev/null || pip_q "torch==${WAVELET_TORCH_VERSION:-2.13.0}"
pip_q -e ".[test]"
