"""A shared-memory folder too small for every wave's segments (Docker gives containers 64 MB):
the waves that do not fit use TCP, the launcher says so in one line, and nothing crashes or is
left behind. Runs in a private mount namespace with a small tmpfs, where the machine allows it."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import CHILD_ENV

from wavelet.common.records import read_records


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", probe],
        capture_output=True,
        timeout=30,
    )
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_full_shared_memory_folder_means_tcp_and_one_line(tmp_path):
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a private tmpfs")
    shm = tmp_path / "shm"
    shm.mkdir()
    run_dir = tmp_path / "run"
    # the default job's segments take about 4 MB (2 shards x 2 waves x push and pull): 2 MB hold
    # some of them
    script = (
        f"mount -t tmpfs -o size=2m tmpfs {shm} || exit 97; "
        f"{sys.executable} -m wavelet.scripts.cli launch --epochs 3 --run-dir {run_dir}; "
        f"code=$?; echo left: $(ls -A {shm} | wc -l); exit $code"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={**CHILD_ENV, "WAVELET_SHM_DIR": str(shm)},
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    notes = [line for line in done.stdout.splitlines() if "shared memory is full" in line]
    assert len(notes) == 1 and "--shm-size" in notes[0], out[-3000:]
    assert "Traceback" not in out and "Bus error" not in out
    assert "final test accuracy" in done.stdout
    starts = [
        r
        for w in (0, 1)
        for r in read_records(run_dir / "records" / f"worker-0-wave-{w}.jsonl")
        if r["kind"] == "start"
    ]
    fell_back = [why for r in starts for why in r["tcp_reasons"].values()]
    assert fell_back and all("too little" in why for why in fell_back), starts
    assert len(fell_back) < 4, "some segments should have fit"
    assert "left: 0" in done.stdout  # no segment, whole or half-made, outlives the job
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "Traceback" not in logs
