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
# --vision: torchvision for examples/vision.py, the release built for the installed torch
# (torchvision 0.N+15 goes with torch 2.N), checked to load: a CPU torch beside a CUDA
# torchvision (or the reverse) installs but fails at import.
if [ "${1:-}" = "--vision" ]; then
    torch_version=$(python -c "import torch; print(torch.__version__)")
    vision=$(python -c "import torch; m = int(torch.__version__.split('.')[1]); print(f'0.{m + 15}.*')")
    pip_q "torchvision==$vision"
    python -c "import torch, torchvision.ops as o; o.nms(torch.zeros(0, 4), torch.zeros(0), 0.5)" \
        2>/dev/null || {
        echo "setup_env: torchvision $vision installed but does not load beside torch" \
            "$torch_version (a CPU build beside a CUDA one); install a matching pair in .venv," \
            "e.g. pip install torch==2.14.1 torchvision==0.29.1" >&2
        python -m pip uninstall -q -y torchvision  # a broken import would fail, not skip, tests
        exit 1
    }
fi
