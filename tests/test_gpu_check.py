"""benchmarks/gpu_check.sh keeps working: --dry-run runs every step on the CPU, tiny job."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import CHILD_ENV

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(420)  # about 100 s on one core of the development machine
def test_gpu_check_dry_run_writes_a_complete_report(tmp_path):
    out = tmp_path / "gpu-check"
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        env={**CHILD_ENV, "OUT": str(out), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "Default job on cpu: test accuracy" in report
    for mode in ("ticktock", "allreduce"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {mode} |"))
        assert "failed" not in row, row
    assert "tick-tock vs all-reduce, samples/s:" in report
    assert (out / "log.txt").stat().st_size > 0
    assert (out / "compare" / "metrics.json").exists()
    assert (out / "versions.txt").read_text().startswith("python ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_cap_and_gpu_records():
    from wavelet.worker.memory import cap_cuda_memory, device_memory

    device = torch.device("cuda:0")
    cap_cuda_memory(device, 1.0)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 << 30, dtype=torch.uint8, device=device)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    mem = device_memory(device)
    assert {"cuda_allocated", "cuda_peak_allocated", "cuda_reserved"} <= set(mem)
