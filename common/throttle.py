"""CPU caps through the cgroup cpu controller: a slow or shared node as real hosts have one.

A ``CpuCap`` is a cgroup of its own: every process put in it, and every process those start
later, shares at most ``pct`` percent of ``cores`` cores (cgroup v2 ``cpu.max``; v1
``cpu.cfs_quota_us`` where v2 has no cpu controller). The benchmarks and ``wavelet compare
--slow-device`` cap every mode's processes alike, all-reduce's included: a sleep inside one code
path would slow one mode only. Needs root (or a delegated cgroup); ``why_not()`` says in one
line what is missing, and nothing is started without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def _v2_has_cpu() -> bool:
    try:
        return "cpu" in (V2 / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def why_not() -> str | None:
    """Why no CPU cap can be made here (one line), or None when it can."""
    if _v2_has_cpu():
        root = V2
    elif (V1 / "cpu.cfs_quota_us").exists():
        root = V1
    else:
        return (
            "no cgroup cpu controller here (neither cgroup v2 cpu.max nor v1 cpu.cfs_quota_us "
            "under /sys/fs/cgroup): a CPU cap needs one"
        )
    if not os.access(root, os.W_OK):
        return f"cannot write {root}: a CPU cap needs root or a delegated cgroup"
    return None


class CpuCap:
    """A cgroup whose processes get at most ``pct`` % of ``cores`` cores (None: no cap yet)."""

    def __init__(self, name: str = "", cores: int = 1, pct: float | None = None):
        why = why_not()
        if why:
            raise OSError(why)
        self.v2 = _v2_has_cpu()
        root = V2 if self.v2 else V1
        self.path = root / f"wavelet-{name or 'cap'}-{uuid.uuid4().hex[:6]}"
        self.path.mkdir()
        self.cores = cores
        self.pct: float | None = None
        self.set(pct)

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def set(self, pct: float | None) -> None:
        """Cap at ``pct`` % of the cores (0 < pct <= 100), or lift the cap (None)."""
        if pct is not None and not 0 < pct <= 100:
            raise ValueError(f"a CPU cap is a percentage in (0, 100], got {pct!r}")
        quota = None if pct is None else max(1000, int(PERIOD_US * self.cores * pct / 100))
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota or -1))
        self.pct = pct

    def add(self, pid: int) -> None:
        """Put process ``pid`` (and what it starts from now on) under the cap."""
        self.procs_file.write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs_file.read_text().split()]
        except OSError:
            return []

    def stop_all(self, grace_s: float = 30.0) -> None:
        """SIGTERM every process in the cgroup, then SIGKILL what is left after ``grace_s``
        (as torchrun stops its workers)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_all()

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the cgroup, however it got there (nothing outlives a run)."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def close(self, timeout_s: float = 30.0) -> None:
        """Kill what is left in it and remove the cgroup. The cap is lifted first: a capped
        process being killed on a busy machine may take a while to exit, and the cgroup
        cannot go before it has."""
        with contextlib.suppress(OSError):
            self.set(None)
        self.kill_all(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    log.warning("could not remove %s (%s): remove it with rmdir", self.path, e)
                    return
                time.sleep(0.05)  # the last processes are still being reaped


def parse_cap(text: str, what: str, nodes: int) -> tuple[int, float]:
    """``NODE:PCT`` -> (node, pct), checked against the number of nodes (or devices)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"{what} {text!r}: expected NODE:PCT, e.g. 1:50")
    node, pct = _index(parts[0], what, text, nodes), _pct(parts[1], what, text)
    return node, pct


def parse_noisy(text: str, nodes: int) -> tuple[int, float, float, float]:
    """``NODE:ON_S:OFF_S:PCT`` -> (node, on_s, off_s, pct): a co-tenant that comes and goes."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"--noisy {text!r}: expected NODE:ON_S:OFF_S:PCT, e.g. 1:10:10:30")
    node = _index(parts[0], "--noisy", text, nodes)
    try:
        on_s, off_s = float(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"--noisy {text!r}: ON_S and OFF_S are seconds, e.g. 1:10:10:30") from None
    if not (on_s > 0 and off_s > 0):
        raise ValueError(f"--noisy {text!r}: ON_S and OFF_S must be > 0")
    return node, on_s, off_s, _pct(parts[3], "--noisy", text)


def _index(text: str, what: str, whole: str, count: int) -> int:
    if not text.isdigit() or int(text) >= count:
        raise ValueError(f"{what} {whole!r}: {text!r} is not one of the {count} (0 to {count - 1})")
    return int(text)


def _pct(text: str, what: str, whole: str) -> float:
    try:
        pct = float(text)
    except ValueError:
        raise ValueError(f"{what} {whole!r}: PCT {text!r} is not a number") from None
    if not 0 < pct < 100:
        raise ValueError(f"{what} {whole!r}: PCT must be above 0 and below 100, got {pct:g}")
    return pct
