"""The CPU caps the benchmarks and ``wavelet compare --slow-device`` emulate slow nodes and
devices with (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), and their bad input; skipped
cleanly where no cgroup cpu controller is writable."""

import re
import subprocess
from pathlib import Path

import pytest
from conftest import run_benchmark

from wavelet.common import throttle


def test_a_cpu_cap_holds_whatever_its_processes_start_and_kills_them_all():
    why = throttle.why_not()
    if why:
        pytest.skip(why)
    cap = throttle.CpuCap("test", cores=1, pct=30)
    try:
        if cap.v2:
            assert (cap.path / "cpu.max").read_text().split() == ["30000", "100000"]
        else:
            assert (cap.path / "cpu.cfs_quota_us").read_text().strip() == "30000"
        proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
        cap.add(proc.pid)
        # children started after the move are in it too
        subprocess.run(["sh", "-c", f"kill -0 {proc.pid}"], check=True, timeout=10)
        cap.set(None)  # lifted
        if cap.v2:
            assert (cap.path / "cpu.max").read_text().split()[0] == "max"
        else:
            assert (cap.path / "cpu.cfs_quota_us").read_text().strip() == "-1"
        cap.kill_all()
        assert proc.wait(10) == -9
        assert cap.pids() == []
    finally:
        cap.close()
    assert not cap.path.exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--slow", "5:50"], "is not one of the 2"),
        (["--slow", "1:0"], "above 0 and below 100"),
        (["--slow", "1:150"], "above 0 and below 100"),
        (["--noisy", "1:10:10"], "expected NODE:ON_S:OFF_S:PCT"),
        (["--leave", "0@10"], "NODE from 1 to 1"),
    ],
)
def test_bad_caps_and_events_get_one_line_and_status_2(tmp_path, flags, says):
    done = run_benchmark("cluster.py", *flags, "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.strip().splitlines()[-1], done.stderr
    assert not any(tmp_path.iterdir())  # nothing started


def _capped(run_dir: Path) -> dict[int, list[str]]:
    """The processes of this run in a --slow-device cgroup, and the cgroups' names."""
    from helpers import processes_mentioning

    found = {}
    for pid in processes_mentioning(str(run_dir)):
        try:
            names = re.findall(r"wavelet-device0-\w+", Path(f"/proc/{pid}/cgroup").read_text())
        except OSError:  # it ended meanwhile
            continue
        if names:
            found[pid] = names
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_slow_device_caps_that_devices_processes_in_every_mode(tmp_path):
    """``--slow-device 0:50``: the worker of device 0 (PS mode) or its rank (all-reduce) runs in
    a capped cgroup while the job runs; the cgroup goes with the job. A device the job does not
    have is refused in one line."""
    from conftest import forked, wait_for

    why = throttle.why_not()
    if why:
        pytest.skip(why)
    for mode in ("ps", "allreduce"):
        run_dir = tmp_path / mode
        args = ["launch", "--run-dir", str(run_dir), "--epochs", "30", "--mode", mode]
        args += ["--slow-device", "0:50", "--shards", "1"]
        with forked(args, tmp_path / f"{mode}.log") as launcher:
            wait_for(lambda run_dir=run_dir: _capped(run_dir), 90, "no process under the cap")
            capped = _capped(run_dir)
            commands = [Path(f"/proc/{p}/cmdline").read_bytes() for p in capped]
            assert all(b"worker" in c for c in commands), commands
            launcher.terminate()
            launcher.wait(60)
        groups = {name for names in capped.values() for name in names}
        paths = [root / g for g in groups for root in (throttle.V1, throttle.V2)]
        left = [p for p in paths if p.exists()]
        assert len(groups) == 1 and not left, (groups, left)
    from conftest import run_wavelet

    bad = run_wavelet("launch", "--slow-device", "3:50", timeout=60)
    assert bad.returncode == 2 and "is not one of the 1" in bad.stderr, bad.stderr
