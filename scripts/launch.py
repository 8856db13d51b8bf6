"""``wavelet launch``: a whole job on this machine, as child processes.

Starts the shard daemons, waits for each to announce its address, starts one worker daemon per
device, shows progress from the workers' records, and at the end tests the shards' weights and
prints accuracy, throughput and staleness per wave. Everything is torn down on success, on Ctrl-C
and as soon as any child fails, whose error is then shown.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from wavelet.common.config import JobConfig
from wavelet.common.daemon_config import LaunchConfig, PSConfig, WorkerConfig
from wavelet.common.job import check_job
from wavelet.common.machine import usable_cores
from wavelet.common.protocol import ShardError
from wavelet.common.records import new_run_dir
from wavelet.common.security import JobKeys, admin_token_file, check_bind, load_admin_token
from wavelet.common.settings import ConfigError, command_line, to_dict
from wavelet.scripts.forkserver import ForkServer
from wavelet.scripts.report import Progress, format_summary, summarize
from wavelet.scripts.signals import INTERRUPTED
from wavelet.scripts.supervisor import (
    Child,
    ChildDidNotStart,
    ChildFailed,
    Job,
    start_fork_server,
)
from wavelet.scripts.tensorboard_log import RunBoard

READY_TIMEOUT_S = 60.0


RESTART_PATIENCE_S = 120.0  # --max-restarts: how long waves wait for a shard to be restarted
FP16_ON_CPU = (
    "warning: --precision fp16 on a CPU device: CPU convolutions have no fp16 kernel and run "
    "over 100x slower than fp32 (benchmarks/bench_precision.py); use --precision bf16 on CPUs"
)


def launch(
    config: LaunchConfig,
    quiet: bool = False,
    fork_server: ForkServer | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> int:
    """Run the job to the end; 0 on success, 1 if a child failed, ``INTERRUPTED`` on Ctrl-C.
    ``fork_server``: one the caller keeps for several jobs (``start_fork_server``), so that its
    imports are paid once; else the job starts and stops its own. ``on_failure`` hears the first
    failing process's reason (the Python API's ``JobFailed.reason``)."""
    config = dataclasses.replace(config, job=config.concrete_job())  # every process, one rule
    if config.max_restarts and config.job.shard_replicas == 1:
        # a killed shard comes back where it was: its waves wait for it as long as a restart
        # may take on a busy machine, not only the lease of a shard that is gone for good
        patience = max(config.job.shard_timeout_s, RESTART_PATIENCE_S)
        config = dataclasses.replace(
            config, job=dataclasses.replace(config.job, shard_timeout_s=patience)
        )
    job_cfg = _job_per_process(config)
    tasks = len(config.devices) * config.processes_per_device * job_cfg.waves
    owned = fork_server is None or config.spawn != "fork"
    # a server of its own starts now: its imports run beside the job's trial batch
    server = start_fork_server(config.spawn) if owned else fork_server
    try:
        check_job(job_cfg, tasks, try_one_batch=True)
        run_dir = _prepare_run_dir(config, job_cfg)
    except BaseException:
        if server is not None and owned:
            server.close()
        raise
    job = Job(config, run_dir, _server=server, _owns_server=owned)
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
    board = None
    try:
        # records from before this start (a resumed run's first part) do not count
        started, since = time.monotonic(), time.time()
        job_file = run_dir / "job.json"
        if config.mode == "ps":
            # workers start beside the shards and load their data while the shards bind,
            # reading the addresses from the files the shards write
            shards = _start_shards(job, job_file, tasks)
            workers = _start_ps_workers(job, job_file, [str(ready) for _, ready in shards])
            addresses = _wait_ready(shards)
        else:
            addresses = []
            workers = _start_ranks(job, job_file, job_cfg)
        if config.slow_device:
            _cap_device(job, config.slow_device, workers)
        _say(quiet, f"run dir {run_dir}: {describe(config, job_cfg)}")
        if job_cfg.precision == "fp16" and any(d.startswith("cpu") for d in config.devices):
            print(FP16_ON_CPU, file=sys.stderr)
        if config.metrics_port >= 0:
            urls = metrics_urls(run_dir, len(addresses) + len(workers), alive=job.all_running)
            job.check(allow_exit=tuple(workers))  # a daemon that could not serve them stops it
            _say(quiet, "metrics: " + ", ".join(urls))
        board = RunBoard(run_dir / "tensorboard")
        progress = Progress(run_dir, job_cfg.epochs, since=since, board=board)
        _supervise_until_done(job, workers, progress, started, quiet)
        if config.mode == "ps":  # where each shard is now: a standby may have taken one over
            addresses = [ready.read_text().strip() for _, ready in shards]
        summary = _finish(job, job_cfg, addresses, progress)
        _say(quiet, "\n" + format_summary(summary))
        code = 0
    except KeyboardInterrupt:
        job.stopping()  # a second Ctrl-C from here hurries the teardown
        print("\ninterrupted: stopping the job", file=sys.stderr)
        code = INTERRUPTED
    except (ChildFailed, ShardError) as e:
        print(f"wavelet launch: {e}", file=sys.stderr)
        if on_failure is not None:
            on_failure(str(e))
        code = 1
    finally:
        job.stopping()
        if board is not None:
            board.close()
        stopped_late = job.teardown()
    # a Ctrl-C while the job was torn down still stops the caller (compare, tune: the run)
    return INTERRUPTED if stopped_late and code == 0 else code


def _job_per_process(config: LaunchConfig) -> JobConfig:
    """The job each worker process runs; refuses an unencrypted job reachable from other
    machines before anything starts."""
    job = config.job
    if config.mode == "ps":
        check_bind(f"tcp://{config.host}:0", secure=config.curve, insecure=config.insecure)
        return job
    # All-reduce: one rank per device does the work of that device's waves (same samples per
    # step, same data split); with two ranks per device, each rank is one wave.
    per_device = config.processes_per_device
    return dataclasses.replace(job, batch_size=job.batch_size * job.waves // per_device, waves=1)


def _prepare_run_dir(config: LaunchConfig, job: JobConfig) -> Path:
    """The run dir, refused if it holds another run; a new run's job.json and launch.json."""
    run_dir = Path(config.run_dir) if config.run_dir else new_run_dir()
    if config.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise ConfigError(f"{run_dir} holds no checkpoints to resume from")
    elif (run_dir / "records").exists() and any((run_dir / "records").iterdir()):
        raise ConfigError(
            f"run dir {run_dir} already holds a run; choose another --run-dir, or --resume it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not config.resume:
        (run_dir / "job.json").write_text(json.dumps(to_dict(job), indent=2, default=str))
        launch_record = {k: v for k, v in to_dict(config).items() if k != "job"}
        (run_dir / "launch.json").write_text(json.dumps(launch_record, indent=2))
    return run_dir


def _supervise_until_done(
    job: Job, workers, progress: Progress, started: float, quiet: bool
) -> None:
    """Restart or stop on failures (``job.supervise``) and show progress until every worker
    exited 0."""
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


def describe(config: LaunchConfig, job: JobConfig) -> str:
    processes = len(config.devices) * config.processes_per_device
    if config.mode == "allreduce":
        how = f"all-reduce, {processes} rank(s) on {len(config.devices)} device(s)"
    else:
        rule = f"staleness bound {job.staleness}" if job.updates == "async" else job.updates
        how = (
            f"{job.shards} shard(s), {processes} worker(s) x {job.waves} wave(s) "
            f"({config.schedule}), {rule}"
        )
    wire = f", wire {job.wire}" if job.wire != "fp32" else ""
    return f"{how}{wire}, model {job.model} on {job.dataset}"


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


def threads_per_process(devices: list[str], per_device: int = 1) -> int:
    cpu_processes = sum(per_device for d in devices if d.startswith("cpu"))
    return max(1, usable_cores() // max(1, cpu_processes))


def _start_shards(job: Job, job_file: Path, total_waves: int) -> list[tuple[Child, Path]]:
    """Spawn the shards; each writes its address to the file beside it once bound."""
    cfg = job.config
    shards = []
    # shard_replicas = 2: each shard daemon also hosts the previous shard's standby
    standbys = cfg.job.shard_replicas == 2 and cfg.job.shards >= 2
    for i in range(cfg.job.shards):
        ready = job.run_dir / f"ps-{i}.addr"
        ready.unlink(missing_ok=True)
        (job.run_dir / f"standby-{i}.addr").unlink(missing_ok=True)
        ps = PSConfig(
            job=cfg.job,
            shard_index=i,
            bind=f"tcp://{cfg.host}:0",
            expect_waves=total_waves,
            ready_file=str(ready),
            run_dir=str(job.run_dir),
            checkpoint_every=cfg.checkpoint_every,
            checkpoint_every_s=cfg.checkpoint_every_s,
            insecure=cfg.insecure,
            metrics_port=_metrics_port(cfg, i),
            job_address_files=[str(job.run_dir / f"ps-{k}.addr") for k in range(cfg.job.shards)],
        )
        if standbys:
            hosted = (i - 1) % cfg.job.shards
            ps = dataclasses.replace(
                ps,
                standby_bind=f"tcp://{cfg.host}:0",
                standby_ready_file=str(job.run_dir / f"standby-{hosted}.addr"),
                standby_takeover_file=str(job.run_dir / f"ps-{hosted}.addr"),
                standby_address_file=str(job.run_dir / f"standby-{i}.addr"),
            )
        if job.keys:
            ps = dataclasses.replace(
                ps,
                curve_secret=str(job.keys.server_secret),
                curve_authorized=str(job.keys.authorized),
                # checkpoint and shutdown: only from the launcher's own authenticated key
                curve_admin_key=str(job.keys.client_public("launcher")),
            )
        args = ["ps", "--config", str(job_file), *command_line(ps)]
        child = job.spawn(f"ps-{i}", args)
        if standbys:
            job.expendable.add(child.name)  # its standby takes over: no restart, no failure
        shards.append((child, ready))
    return shards


def _worker_processes(job: Job) -> list[tuple[int, str, int]]:
    """(rank, device, device index) of every worker process, devices in order."""
    per_device = job.config.processes_per_device
    return [
        (i * per_device + k, d, i)
        for i, d in enumerate(job.config.devices)
        for k in range(per_device)
    ]


def _start_ps_workers(job: Job, job_file: Path, address_files: list[str]) -> list[Child]:
    cfg = job.config
    processes = _worker_processes(job)
    # Each worker process gets its share of the cores and chooses its thread layout within it
    # by a short probe (worker/threads.py), unless --threads fixes it.
    budget = threads_per_process(cfg.devices, cfg.processes_per_device)
    workers = []
    for rank, device, index in processes:
        worker = WorkerConfig(
            job=cfg.job,
            shard_address_files=address_files,
            device=device,
            rank=rank,
            device_index=index,
            num_workers=len(processes),
            threads=cfg.threads,
            core_budget=budget,
            run_dir=str(job.run_dir),
            schedule=cfg.schedule,
            transport=cfg.transport,
            cuda_memory_gib=cfg.cuda_memory_gib / cfg.processes_per_device,
            metrics_port=_metrics_port(cfg, cfg.job.shards + rank),
            resume=bool(cfg.resume),
            curve_secret=str(job.keys.client_secret(f"worker-{rank}")) if job.keys else "",
            curve_server_key=str(job.keys.server_public) if job.keys else "",
            report=False,  # the launcher shows the job's progress and summary
        )
        args = ["worker", "--config", str(job_file), *command_line(worker)]
        workers.append(job.spawn(f"worker-{rank}", args))
    return workers


def _start_ranks(job: Job, job_file: Path, job_cfg: JobConfig) -> list[Child]:
    """DDP ranks with torchrun's environment variables (env:// rendezvous)."""
    cfg = job.config
    processes = _worker_processes(job)
    threads = cfg.threads or threads_per_process(cfg.devices, cfg.processes_per_device)
    env = {
        "MASTER_ADDR": cfg.host,
        "MASTER_PORT": str(_free_port(cfg.host)),
        "WORLD_SIZE": str(len(processes)),
    }
    ranks = []
    for rank, device, index in processes:
        worker = WorkerConfig(
            job=job_cfg,
            mode="allreduce",
            device=device,
            device_index=index,
            threads=threads,
            run_dir=str(job.run_dir),
            cuda_memory_gib=cfg.cuda_memory_gib / cfg.processes_per_device,
            metrics_port=_metrics_port(cfg, rank),
        )
        args = ["worker", "--config", str(job_file), *command_line(worker)]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}  # all on this host
        ranks.append(job.spawn(f"worker-{rank}", args, rank_env))
    return ranks


def _cap_device(job: Job, spec: str, workers: list[Child]) -> None:
    """``--slow-device D:PCT``: the processes of device D (its workers, or its all-reduce
    ranks) under one CPU cap, whatever the mode (common/throttle.py)."""
    from wavelet.common.throttle import CpuCap, parse_cap

    device, pct = parse_cap(spec, "--slow-device", len(job.config.devices))
    job.cap = CpuCap(f"device{device}", cores=1, pct=pct)
    for (_, _, index), child in zip(_worker_processes(job), workers, strict=True):
        if index == device:
            job.cap.add(child.proc.pid)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_ready(shards: list[tuple[Child, Path]]) -> list[str]:
    """Each shard's address, once it has bound it. A shard that exits first stops the launch
    now; a worker that does is reported by the supervision that follows."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for child, ready in shards:
        while not ready.exists():
            for c, _ in shards:
                code = c.proc.poll()
                if code is not None:
                    raise ChildDidNotStart(c, code)
            if time.monotonic() > deadline:
                raise ChildFailed(child, None)
            time.sleep(0.05)
        child.address = ready.read_text().strip()
    return [child.address for child, _ in shards]


def _finish(job: Job, job_cfg: JobConfig, addresses: list[str], progress: Progress) -> dict:
    keys = job.keys.client("launcher") if job.keys else None
    return summarize(
        job.run_dir, job.config.mode, job_cfg, addresses, progress, keys, job.admin_token
    )


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)
