"""``wavelet launch``: a whole job on this machine, as child processes.

Starts the shard daemons, waits for each to announce its address, starts one worker daemon per
device, shows progress from the workers' records, and at the end tests the shards' weights and
prints accuracy, throughput and staleness per wave. Everything is torn down on success, on Ctrl-C
and as soon as any child fails, whose error is then shown.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from wavelet.common.config import ConfigError, JobConfig, LaunchConfig, to_dict
from wavelet.common.job import check_job
from wavelet.common.metrics import push_staleness
from wavelet.common.protocol import AdminRequest, Op, ShardError
from wavelet.common.records import read_records
from wavelet.common.security import JobKeys, admin_token_file, check_bind, load_admin_token
from wavelet.common.shm import remove_segments, run_prefix
from wavelet.scripts.plots import staleness_histograms
from wavelet.scripts.stats import fetch_stats, format_wave_table, merge_wave_stats
from wavelet.scripts.tensorboard_log import RunBoard
from wavelet.worker.client import call_shard
from wavelet.worker.evaluate import evaluate_shards

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    address: str = ""  # a shard's bound address: a restarted shard binds it again

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


USAGE_ERROR = 2  # how a daemon exits when it refuses its settings (one line on stderr)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, code: int | None, hint: str = ""):
        self.child = child
        what = "did not start in time" if code is None else f"exited with status {code}"
        super().__init__(
            f"{child.name} {what}; last lines of {child.log}:\n{child.tail()}"
            + (f"\n{hint}" if hint else "")
        )


class ChildDidNotStart(ChildFailed):
    """A daemon refused to start (a port in use, a bad setting): its own one line says why, and
    nothing ran that a resume could go on from."""

    def __init__(self, child: Child, code: int):
        self.child = child
        RuntimeError.__init__(self, f"{child.name} could not start: {child.tail(1).strip()}")


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, so no daemon is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Job:
    config: LaunchConfig
    run_dir: Path
    keys: JobKeys | None = None
    admin_token: str = ""
    children: list[Child] = field(default_factory=list)
    restarts: int = 0

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        child = Child(name, self._popen(args, env or {}, log, "wb"), log, args, env or {})
        self.children.append(child)
        return child

    def _popen(self, args: list[str], env: dict[str, str], log: Path, mode: str):
        with open(log, mode) as out:
            return subprocess.Popen(
                [sys.executable, "-m", "wavelet.scripts.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            )

    def all_running(self) -> bool:
        return all(c.proc.poll() is None for c in self.children)

    def supervise(self, allow_exit: tuple[Child, ...] = (), say=print) -> None:
        """Restart a child that died, up to ``max_restarts`` in all; else raise ChildFailed."""
        for c in self.children:
            code = c.proc.poll()
            if code is None or (code == 0 and c in allow_exit):
                continue
            if self.restarts >= self.config.max_restarts or code == USAGE_ERROR:
                self.check(allow_exit)
            self.restart(c, code, say)

    def restart(self, child: Child, code: int, say=print) -> None:
        """Start a dead child again: a shard on the address it had (it restores its last
        checkpoint and the waves re-join it), a worker with --resume (from the shards' clocks)."""
        self.restarts += 1
        args = list(child.args)
        if child.address:
            args[args.index("--bind") + 1] = child.address
        elif "--resume" not in args:
            args.append("--resume")
        say(
            f"{child.name} exited with status {code}: restarting it "
            f"({self.restarts}/{self.config.max_restarts} restarts)"
        )
        with open(child.log, "ab") as out:
            out.write(f"\n--- restart {self.restarts} after status {code} ---\n".encode())
        child.proc = self._popen(args, child.env, child.log, "ab")

    def check(self, allow_exit: tuple[Child, ...] = ()) -> None:
        for c in self.children:
            code = c.proc.poll()
            if code == USAGE_ERROR:  # a setting it refused: its one line says which
                raise ChildDidNotStart(c, code)
            if code is not None and (code != 0 or c not in allow_exit):
                raise ChildFailed(c, code, self.resume_hint() if c.name.startswith("ps-") else "")

    def resume_hint(self) -> str:
        if any((self.run_dir / "checkpoints").glob("shard-*.pt")):
            return (
                f"the job stopped; go on from the shards' last checkpoints with: "
                f"wavelet launch --resume {self.run_dir}"
            )
        return (
            "the job stopped before any shard checkpoint was written; start it again, with "
            "--checkpoint-every N to be able to resume next time"
        )

    def teardown(self) -> None:
        """SIGTERM every child still running, wait, then SIGKILL what is left; then remove the
        shared-memory segments a killed shard could not."""
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in alive:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        remove_segments(run_prefix(self.run_dir))


def launch(config: LaunchConfig, quiet: bool = False) -> int:
    """Run the job to the end; 0 on success, 1 if a child failed, 130 on Ctrl-C."""
    job_cfg = config.job
    per_device = config.processes_per_device
    if config.mode == "ps":  # refuse an unencrypted job reachable from other machines, early
        check_bind(f"tcp://{config.host}:0", secure=config.curve, insecure=config.insecure)
    if config.mode == "allreduce":
        # One rank per device does the work of that device's waves (same samples per step, same
        # data split); with two ranks per device, each rank is one wave.
        job_cfg = dataclasses.replace(
            job_cfg, batch_size=job_cfg.batch_size * job_cfg.waves // per_device, waves=1
        )
    tasks = len(config.devices) * per_device * job_cfg.waves
    check_job(job_cfg, tasks)
    run_dir = Path(config.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if config.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise ConfigError(f"{run_dir} holds no checkpoints to resume from")
    elif (run_dir / "records").exists() and any((run_dir / "records").iterdir()):
        raise ConfigError(
            f"run dir {run_dir} already holds a run; choose another --run-dir, or --resume it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir / "job.json"
    if not config.resume:
        job_file.write_text(json.dumps(to_dict(job_cfg), indent=2, default=str))
        launch_record = {k: v for k, v in to_dict(config).items() if k != "job"}
        (run_dir / "launch.json").write_text(json.dumps(launch_record, indent=2))
    job = Job(config, run_dir)
    for stale in (run_dir / "metrics").glob("*.url"):  # a resumed run's daemons pick new ones
        stale.unlink()
    # shards take checkpoint and shutdown requests only with this (0600 in the run dir)
    job.admin_token = load_admin_token(admin_token_file(run_dir))
    if config.curve and config.mode == "ps":
        clients = ["launcher"] + [f"worker-{r}" for r, _, _ in _worker_processes(job)]
        if config.resume and (run_dir / "keys").is_dir():
            job.keys = JobKeys(run_dir / "keys")
        else:
            job.keys = JobKeys.create(run_dir / "keys", clients)
    started = time.monotonic()
    since = time.time()  # records from before this start (a resumed run's first part) do not count
    board = None
    try:
        if config.mode == "ps":
            addresses = _start_shards(job, job_file, tasks)
            workers = _start_ps_workers(job, job_file, addresses)
        else:
            addresses = []
            workers = _start_ranks(job, job_file)
        _say(quiet, f"run dir {run_dir}: {describe(config, job_cfg)}")
        if config.metrics_port >= 0:
            expected = len(addresses) + len(workers)
            urls = metrics_urls(run_dir, expected, alive=job.all_running)
            job.check(allow_exit=tuple(workers))  # a daemon that could not serve them stops it
            _say(quiet, "metrics: " + ", ".join(urls))
        board = RunBoard(run_dir / "tensorboard")
        progress = Progress(run_dir, job_cfg.epochs, since=since, board=board)
        say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
        while True:
            job.supervise(allow_exit=tuple(workers), say=say)
            if all(w.proc.poll() == 0 for w in workers):
                break
            time.sleep(0.25)
            if progress.due():
                progress.read()  # also writes the TensorBoard scalars as training goes
                if note := progress.shared_memory_note():
                    say(note)
                say(progress.line(time.monotonic() - started))
        progress.read()
        if note := progress.shared_memory_note():  # a job too short for a progress line
            say(note)
        summary = _finish(job, job_cfg, addresses, progress)
        _say(quiet, "\n" + format_summary(summary))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the job", file=sys.stderr)
        return 130
    except (ChildFailed, ShardError) as e:
        print(f"wavelet launch: {e}", file=sys.stderr)
        return 1
    finally:
        if board is not None:
            board.close()
        job.teardown()


def describe(config: LaunchConfig, job: JobConfig) -> str:
    processes = len(config.devices) * config.processes_per_device
    if config.mode == "allreduce":
        how = f"all-reduce, {processes} rank(s) on {len(config.devices)} device(s)"
    else:
        how = (
            f"{job.shards} shard(s), {processes} worker(s) x {job.waves} wave(s) "
            f"({config.schedule}), staleness bound {job.staleness}"
        )
    return f"{how}, model {job.model} on {job.dataset}"


def _metrics_port(config: LaunchConfig, index: int) -> int:
    """Daemon ``index``'s metrics port (shards first, then workers): BASE + index, 0 (any) or
    -1 (off)."""
    return config.metrics_port + index if config.metrics_port > 0 else config.metrics_port


def metrics_urls(
    run_dir: Path, expected: int, wait_s: float = 10.0, alive=lambda: True
) -> list[str]:
    """The metrics addresses the daemons wrote (they pick them as they start); stops waiting
    once ``alive()`` says a daemon died."""
    folder = run_dir / "metrics"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(list(folder.glob("*.url"))) < expected:
        if not alive():
            break
        time.sleep(0.1)
    return [f"{p.stem} {p.read_text().strip()}" for p in sorted(folder.glob("*.url"))]


def _threads_per_process(devices: list[str], per_device: int = 1) -> int:
    cpu_processes = sum(per_device for d in devices if d.startswith("cpu"))
    return max(1, (os.cpu_count() or 1) // max(1, cpu_processes))


def _start_shards(job: Job, job_file: Path, total_waves: int) -> list[str]:
    shards = []
    for i in range(job.config.job.shards):
        ready = job.run_dir / f"ps-{i}.addr"
        ready.unlink(missing_ok=True)
        args = [
            "ps",
            "--config",
            str(job_file),
            "--shard-index",
            str(i),
            "--bind",
            f"tcp://{job.config.host}:0",
            "--expect-waves",
            str(total_waves),
            "--ready-file",
            str(ready),
            "--run-dir",
            str(job.run_dir),
            "--checkpoint-every",
            str(job.config.checkpoint_every),
            "--checkpoint-every-s",
            str(job.config.checkpoint_every_s),
        ]
        if job.keys:
            args += [
                "--curve-secret",
                str(job.keys.server_secret),
                "--curve-authorized",
                str(job.keys.authorized),
                # checkpoint and shutdown: only from the launcher's own authenticated key
                "--curve-admin-key",
                str(job.keys.client_public("launcher")),
            ]
        if job.config.insecure:
            args.append("--insecure")
        args += ["--metrics-port", str(_metrics_port(job.config, i))]
        shards.append((job.spawn(f"ps-{i}", args), ready))
    for child, ready in shards:
        child.address = _wait_ready(job, child, ready)
    return [child.address for child, _ in shards]


def _worker_processes(job: Job) -> list[tuple[int, str, int]]:
    """(rank, device, device index) of every worker process, devices in order."""
    per_device = job.config.processes_per_device
    return [
        (i * per_device + k, d, i)
        for i, d in enumerate(job.config.devices)
        for k in range(per_device)
    ]


def _start_ps_workers(job: Job, job_file: Path, addresses: list[str]) -> list[Child]:
    cfg = job.config
    processes = _worker_processes(job)
    # Each worker process gets its share of the cores and chooses its thread layout within it
    # by a short probe (worker/threads.py), unless --threads fixes it.
    budget = _threads_per_process(cfg.devices, cfg.processes_per_device)
    workers = []
    for rank, device, index in processes:
        args = [
            "worker",
            "--config",
            str(job_file),
            "--device",
            device,
            "--rank",
            str(rank),
            "--device-index",
            str(index),
            "--num-workers",
            str(len(processes)),
            "--threads",
            str(cfg.threads),
            "--core-budget",
            str(budget),
            "--run-dir",
            str(job.run_dir),
            "--schedule",
            cfg.schedule,
            "--transport",
            cfg.transport,
            "--cuda-memory-gib",
            str(cfg.cuda_memory_gib / cfg.processes_per_device),
            "--metrics-port",
            str(_metrics_port(cfg, cfg.job.shards + rank)),
        ]
        for a in addresses:
            args += ["--shard", a]
        if job.config.resume:
            args.append("--resume")
        if job.keys:
            args += [
                "--curve-secret",
                str(job.keys.client_secret(f"worker-{rank}")),
                "--curve-server-key",
                str(job.keys.server_public),
            ]
        workers.append(job.spawn(f"worker-{rank}", args))
    return workers


def _start_ranks(job: Job, job_file: Path) -> list[Child]:
    """DDP ranks with torchrun's environment variables (env:// rendezvous)."""
    processes = _worker_processes(job)
    threads = job.config.threads or _threads_per_process(
        job.config.devices, job.config.processes_per_device
    )
    env = {
        "MASTER_ADDR": job.config.host,
        "MASTER_PORT": str(_free_port(job.config.host)),
        "WORLD_SIZE": str(len(processes)),
    }
    ranks = []
    for rank, device, index in processes:
        args = [
            "worker",
            "--mode",
            "allreduce",
            "--config",
            str(job_file),
            "--device",
            device,
            "--device-index",
            str(index),
            "--threads",
            str(threads),
            "--run-dir",
            str(job.run_dir),
            "--cuda-memory-gib",
            str(job.config.cuda_memory_gib / job.config.processes_per_device),
            "--metrics-port",
            str(_metrics_port(job.config, rank)),
        ]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}  # all on this host
        ranks.append(job.spawn(f"worker-{rank}", args, rank_env))
    return ranks


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_ready(job: Job, child: Child, ready: Path) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        for c in job.children:  # a daemon that exits before it is ready stops the launch now
            code = c.proc.poll()
            if code is not None:
                raise ChildDidNotStart(c, code)
        if time.monotonic() > deadline:
            raise ChildFailed(child, None)
        time.sleep(0.05)
    return ready.read_text().strip()


def _finish(job: Job, job_cfg: JobConfig, addresses: list[str], progress: Progress) -> dict:
    keys = job.keys.client("launcher") if job.keys else None
    return summarize(
        job.run_dir, job.config.mode, job_cfg, addresses, progress, keys, job.admin_token
    )


def summarize(
    run_dir: Path,
    mode: str,
    job_cfg: JobConfig,
    addresses: list[str],
    progress: Progress,
    keys=None,
    admin_token: str = "",
) -> dict:
    """The end of a job: with shards, test their weights, fetch their statistics and stop them;
    then write and return summary.json (accuracy, samples/s, lost updates, staleness per wave)."""
    progress.read()
    if addresses:
        accuracy = evaluate_shards(addresses, job_cfg, keys=keys)
        stats = merge_wave_stats(fetch_stats(addresses, keys=keys))
        for a in addresses:
            call_shard(a, Op.SHUTDOWN, keys=keys, body=AdminRequest(token=admin_token).to_wire())
        staleness_histograms(push_staleness(run_dir), run_dir / "staleness.png")
    else:
        accuracy = progress.final_accuracy
        stats = {}
    if progress.board is not None and accuracy is not None:
        progress.board.final(accuracy)
    summary = {
        "run_dir": str(run_dir),
        "mode": mode,
        "test_accuracy": accuracy,
        "samples": progress.samples,
        "train_seconds": progress.elapsed(),
        "samples_per_s": progress.samples / max(progress.elapsed(), 1e-9),
        "lost_updates": progress.lost_updates,
        "waves": stats,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(s: dict) -> str:
    acc = s["test_accuracy"]
    lines = [
        f"final test accuracy: {100 * acc:.2f}%" if acc is not None else "no final accuracy",
        f"throughput: {s['samples_per_s']:.0f} samples/s ({s['samples']} samples in "
        f"{s['train_seconds']:.1f}s, all waves)",
    ]
    if s.get("lost_updates"):
        lines.append(f"restarted shards lost {s['lost_updates']} update(s) (see the records)")
    if s["waves"]:
        lines += [
            "staleness per wave (updates applied between a wave's read and its push):",
            format_wave_table(s["waves"]),
        ]
    lines.append(f"records, logs and summary.json: {s['run_dir']}")
    return "\n".join(lines)


class Progress:
    """Reads the workers' records as they grow and summarises them in one line."""

    def __init__(
        self,
        run_dir: Path,
        epochs: int,
        every_s: float = 2.0,
        since: float = 0.0,
        board: RunBoard | None = None,
    ):
        self.dir = run_dir / "records"
        self.board = board  # TensorBoard scalars, written from the same records
        self._board_t: float | None = None
        self.since = since  # records from before (a resumed run's first part) do not count
        self.epochs = epochs
        self.every_s = every_s
        self._offsets: dict[Path, int] = {}
        self._next = time.monotonic() + every_s
        self.samples = 0
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.loss: dict[str, float] = {}
        self.epoch = 0
        self.steps = 0
        self.accuracy: float | None = None
        self.final_accuracy: float | None = None
        self.lost_updates = 0  # most updates any wave saw a restarted shard lose
        self.tcp_reasons: list[str] = []  # why waves that could use shared memory do not
        self._told_tcp = False

    def due(self) -> bool:
        if time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + self.every_s
        return True

    def read(self) -> None:
        for path in sorted(self.dir.glob("worker-*.jsonl")):
            wave = path.stem.replace("worker-", "w").replace("-wave-", "/")
            for r in self._new_records(path):
                self._take(wave, r)
        if self.board:
            for path in sorted(self.dir.glob("ps-*-pushes.jsonl")):
                for r in self._new_records(path):
                    if r.get("t", self.since) >= self.since:
                        self.board.push(r)
            if self.elapsed() > 0 and self.last_t != self._board_t:
                self._board_t = self.last_t
                self.board.throughput(self.samples / self.elapsed(), self.elapsed(), self.last_t)

    def _new_records(self, path: Path):
        with open(path) as f:
            f.seek(self._offsets.get(path, 0))
            for line in f:
                if not line.endswith("\n"):
                    break
                self._offsets[path] = self._offsets.get(path, 0) + len(line.encode())
                yield json.loads(line)

    def _take(self, wave: str, r: dict) -> None:
        if r.get("t", self.since) < self.since:
            return
        if self.board:
            if r["kind"] == "step":
                self.board.step(wave, r)
            elif r["kind"] in ("eval", "final"):
                self.board.evaluation(r.get("epoch", self.epoch) + 1, r["test_acc"], r["t"])
        if r["kind"] == "start":
            self.first_t = r["t"] if self.first_t is None else min(self.first_t, r["t"])
            self.tcp_reasons += [
                f"{wave} to {shard}: {why}" for shard, why in r.get("tcp_reasons", {}).items()
            ]
        elif r["kind"] == "step":
            self.samples += r["samples"]
            self.steps += 1
            self.epoch = max(self.epoch, r["epoch"] + 1)
            self.loss[wave] = r["loss"]
            self.lost_updates = max(self.lost_updates, r.get("lost_updates", 0))
            self.last_t = r["t"] if self.last_t is None else max(self.last_t, r["t"])
        elif r["kind"] == "eval":
            self.accuracy = r["test_acc"]
        elif r["kind"] == "final":
            self.final_accuracy = r["test_acc"]

    def shared_memory_note(self) -> str:
        """Once, the first time waves fell back to TCP on a full shared-memory folder: one line
        saying why and what to do ("" otherwise)."""
        full = [r for r in self.tcp_reasons if "--shm-size" in r]
        if self._told_tcp or not full:
            return ""
        self._told_tcp = True
        return f"shared memory is full; {len(full)} wave link(s) use TCP instead ({full[0]})"

    def elapsed(self) -> float:
        if self.first_t is None or self.last_t is None:
            return 0.0
        return self.last_t - self.first_t

    def line(self, wall: float) -> str:
        # "-" until there is a number: no "loss nan  0 samples/s" before the first step
        loss = f"{sum(self.loss.values()) / len(self.loss):.4f}" if self.loss else "-"
        rate = f"{self.samples / self.elapsed():.0f}" if self.elapsed() > 0 else "-"
        acc = f"  test acc {100 * self.accuracy:.1f}%" if self.accuracy is not None else ""
        epochs = f"/{self.epochs}" if self.epochs else ""
        return (
            f"[{wall:6.1f}s] epoch {self.epoch}{epochs}  steps {self.steps}  "
            f"loss {loss}  {rate} samples/s{acc}"
        )


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def records_of(run_dir: Path) -> dict[str, list[dict]]:
    """Every worker record file of a run, by file name."""
    return {p.stem: list(read_records(p)) for p in sorted((run_dir / "records").glob("*.jsonl"))}
