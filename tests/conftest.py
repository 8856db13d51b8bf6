"""Fixtures: real shard daemons in child processes on loopback, and cleanup by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# Each test process (an xdist worker, or pytest -n0) keeps its jobs' shared-memory segments in a
# folder of its own, so that its checks never see (or remove) another's: another test session's,
# or a real job's running beside the tests. Set before wavelet.common.shm loads.
os.environ["WAVELET_SHM_DIR"] = f"/dev/shm/wavelet-tests-{os.getpid()}"  # made on first use

import pytest  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from zmq.utils.garbage import gc as zmq_garbage  # noqa: E402

from wavelet.common.records import last_record  # noqa: E402
from wavelet.common.shm import SHM_DIR, remove_segments, run_prefix  # noqa: E402
from wavelet.ps.checkpoints import checkpoint_path, read_checkpoint  # noqa: E402
from wavelet.scripts.forkserver import ForkedChild, ForkServer  # noqa: E402

# Tests and the daemons they start share two cores: one torch thread each.
torch.set_num_threads(1)
# Children are not test processes: no pytest or xdist variables (a nested pytest, as the GPU
# check's, must not take itself for an xdist worker).
CHILD_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


# A launch that does not test sharding runs one shard: one process fewer to start, feed, check-
# point and stop, on a suite that keeps both cores busy (and under --spawn exec, 4-5 s of CPU
# fewer: torch, then torch._dynamo for the shard's optimizer step).
ONE_SHARD = ("--shards", "1")


def wavelet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "wavelet.scripts.cli", *args]


def run_wavelet(
    *args: str, timeout: float, cwd=None, by_hand: bool = False
) -> subprocess.CompletedProcess:
    """``wavelet ARGS`` to completion, output and errors captured: forked from this test
    process's fork server (``forked``), so the command runs without 2-3 s of imports first, or
    with ``by_hand`` in a new Python, exactly as a user runs it."""
    if by_hand:
        return subprocess.run(
            wavelet_cmd(*args),
            env=CHILD_ENV,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    with tempfile.TemporaryDirectory(prefix="wavelet-output-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = _test_fork_server().spawn(
            list(args), CHILD_ENV, out, append=False, err_path=err, cwd=cwd
        )
        try:
            code = proc.wait(timeout)
        except BaseException:  # its timeout, or the test's: nothing it started outlives it
            kill_tree(proc.pid)
            proc.wait(10)
            raise
        return subprocess.CompletedProcess(
            wavelet_cmd(*args), code, out.read_text(), err.read_text()
        )


ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(
    script: str, *args: str, timeout: float, env: dict | None = None, cwd=ROOT
) -> subprocess.CompletedProcess:
    """``python benchmarks/SCRIPT ARGS`` to completion in a new Python, output and errors
    captured (``env``: the children's, ``CHILD_ENV``, unless given)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env=CHILD_ENV if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.1) -> None:
    """Poll ``predicate`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every_s)


def between_checkpoints(run_dir: Path, shard: int = 0, low: int = 5, high: int = 30) -> bool:
    """Shard ``shard`` applied ``low``..``high`` updates after its last checkpoint: a kill now
    loses some (and lands well before the next one of an every-60 schedule)."""
    logged = last_record(Path(run_dir) / "records" / f"ps-{shard}-pushes.jsonl")
    try:
        state = read_checkpoint(checkpoint_path(run_dir, shard))
    except Exception:  # being replaced right now: look again
        return False
    if not (logged and state):
        return False
    return low <= logged["version"] - state["version"] <= high


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces: the fields after its closing paren are fixed
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: children, their children, and so on."""
    out = []
    for child in _children_of(pid):
        out += [child, *descendants(child)]
    return out


def kill_tree(pid: int) -> None:
    for child in _children_of(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def started(cmd: list[str], log: Path, **kwargs):
    """A real process for the duration of the block, killed (with its children) by pid after."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=CHILD_ENV,
            **kwargs,
        )
    with _stopped_after(proc):
        yield proc


_fork_server: ForkServer | None = None


def _test_fork_server() -> ForkServer:
    """This test process's fork server, started on first use and stopped after the session."""
    global _fork_server
    if _fork_server is None:
        _fork_server = ForkServer.start(env=CHILD_ENV)
    return _fork_server


@contextmanager
def forked(args: list[str], log: Path):
    """``wavelet ARGS`` forked, as the launcher starts its daemons, from this test process's
    fork server: a shard started this way costs a fraction of a second of CPU, not the 4-5 s of
    exec and imports. ``started`` keeps the by-hand path tested."""
    proc = _test_fork_server().spawn(list(args), CHILD_ENV, log, append=False)
    with _stopped_after(proc):
        yield proc


@contextmanager
def _stopped_after(proc):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()  # a clean stop first: daemons remove their shared-memory segments
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(10)


class ShardDaemons:
    """``wavelet ps`` processes for one job; ``addresses`` once all are listening. Forked
    from the tests' fork server, or with ``by_hand`` exec'd as a user starts them."""

    def __init__(
        self,
        tmp: Path,
        job_args: list[str],
        count: int,
        expect_waves: int = 0,
        by_hand: bool = False,
        standbys: bool = False,
    ):
        self.tmp = Path(tempfile.mkdtemp(prefix="shards-", dir=tmp))  # one per set of daemons
        self.standbys = standbys  # each daemon hosts the previous shard's standby
        self.job_args = job_args
        self.count = count
        self.expect_waves = expect_waves
        self.by_hand = by_hand
        self.procs: list[ForkedChild | subprocess.Popen] = []
        self.addresses: list[str] = []
        self._stack = []

    def __enter__(self) -> ShardDaemons:
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)  # stop the shards that did start
            raise

    def _start(self) -> ShardDaemons:
        readies = []
        for i in range(self.count):
            cm = self._process(self._args(i, "tcp://127.0.0.1:0"), self.tmp / f"ps-{i}.log")
            self.procs.append(cm.__enter__())
            self._stack.append(cm)
            readies.append(self._ready_file(i))
        deadline = time.monotonic() + 60
        for i, ready in enumerate(readies):
            while not ready.exists():
                if self.procs[i].poll() is not None:
                    raise RuntimeError((self.tmp / f"ps-{i}.log").read_text())
                if time.monotonic() > deadline:
                    raise TimeoutError("shard daemon did not start")
                time.sleep(0.05)
            self.addresses.append(ready.read_text().strip())
        return self

    def restarted(self, i: int, log: Path):
        """Shard ``i`` started again, after a test killed it, with its own command on its own
        address (as the launcher restarts one): a context manager, stopped after the block."""
        return self._process(self._args(i, self.addresses[i]), log)

    def _args(self, i: int, bind: str) -> list[str]:
        args = [
            "ps",
            *self.job_args,
            *("--shards", str(self.count), "--shard-index", str(i), "--bind", bind),
            *("--expect-waves", str(self.expect_waves), "--ready-file", str(self._ready_file(i))),
            *("--run-dir", str(self.tmp)),
        ]
        for k in range(self.count):  # where every shard is, for a worker that joins
            args += ["--job-address-file", str(self._ready_file(k))]
        if self.standbys:  # daemon i hosts shard i - 1's standby; shard i's is on daemon i + 1
            hosted = (i - 1) % self.count
            args += ["--standby-bind", "tcp://127.0.0.1:0"]
            args += ["--standby-ready-file", str(self.standby_file(hosted))]
            args += ["--standby-takeover-file", str(self._ready_file(hosted))]
            args += ["--standby-address-file", str(self.standby_file(i))]
        return args

    def standby_file(self, shard: int) -> Path:
        """Where the daemon hosting shard ``shard``'s standby writes its address."""
        return self.tmp / f"standby-{shard}.addr"

    def current_addresses(self) -> list[str]:
        """Where each shard is served now (a standby's address once it took one over)."""
        return [self._ready_file(i).read_text().strip() for i in range(self.count)]

    def _ready_file(self, i: int) -> Path:
        return self.tmp / f"ps-{i}.addr"

    def _process(self, args: list[str], log: Path):
        return started(wavelet_cmd(*args), log) if self.by_hand else forked(args, log)

    def __exit__(self, *exc) -> None:
        for cm in reversed(self._stack):
            cm.__exit__(None, None, None)
        remove_segments(run_prefix(self.tmp))  # what a shard a test killed with -9 left


def pytest_collection_modifyitems(config, items):
    """Tests that train end to end (marked slow) first, the rest in their order: with two test
    processes, the last test to finish is then a short one, not a minute-long launch that one
    process started while the other had nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def shard_daemons(tmp_path):
    """Factory: ``shard_daemons(job_args, count, ...)`` -> running ShardDaemons, stopped after."""
    running: list[ShardDaemons] = []

    def make(
        job_args: list[str],
        count: int = 1,
        expect_waves: int = 0,
        by_hand: bool = False,
        standbys: bool = False,
    ) -> ShardDaemons:
        d = ShardDaemons(tmp_path, job_args, count, expect_waves, by_hand, standbys).__enter__()
        running.append(d)
        return d

    yield make
    for d in running:
        d.__exit__(None, None, None)


@pytest.fixture(autouse=True, scope="session")
def no_leftover_processes():
    yield
    if _fork_server is not None:
        _fork_server.close()
    leftovers = _children_of(os.getpid())
    for pid in leftovers:
        kill_tree(pid)
    assert not leftovers, f"tests left processes running: {leftovers}"


@pytest.fixture(autouse=True, scope="session")
def no_leftover_segments():
    """No shared-memory segment the tests made outlives them (the ones there before stay)."""
    before = set(SHM_DIR.glob("wavelet-*"))
    yield
    left = set(SHM_DIR.glob("wavelet-*")) - before
    for path in left:
        path.unlink(missing_ok=True)
    if SHM_DIR.name.startswith("wavelet-tests-") and SHM_DIR.is_dir():
        SHM_DIR.rmdir()
    assert not left, f"tests left {len(left)} shared-memory segment(s): {sorted(left)[:5]}"


@pytest.fixture(autouse=True)
def no_leaked_sockets(monkeypatch):
    """Fail a test that leaves a ZeroMQ socket of its own process open (as pyzmq's suite does);
    the leaked sockets are closed so that they do not spill into the next test."""
    opened: list[zmq.Socket] = []
    real_socket = zmq.Context.socket

    def tracked(self, *args, **kwargs):
        sock = real_socket(self, *args, **kwargs)
        if self is not zmq_garbage._context:  # pyzmq's own zero-copy bookkeeping, process-wide
            opened.append(sock)
        return sock

    monkeypatch.setattr(zmq.Context, "socket", tracked)
    yield
    leaked = [s for s in opened if not s.closed]
    for s in leaked:
        s.close(linger=0)
    assert not leaked, f"the test left {len(leaked)} ZeroMQ socket(s) open"
