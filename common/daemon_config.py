"""The daemons' configs: one type per command, each wrapping the job (``common/config.py``).

``PSConfig`` (``wavelet ps``), ``WorkerConfig`` (``wavelet worker``), ``LaunchConfig``
(``wavelet launch``) and ``RunConfig`` (``wavelet run`` under torchrun). Their flags are generated
from their fields (``common/settings.py``), so a launcher that builds one and passes
``command_line(config)`` to a child forgets no setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wavelet.common.config import JobConfig, launch_updates
from wavelet.common.settings import (
    ConfigError,
    check_address,
    check_device,
    check_metrics_port,
    check_settings,
    keyword_checked,
    non_negative,
    positive,
    setting,
)

MODES = ("ps", "allreduce")
SCHEDULES = ("ticktock", "together")
TRANSPORTS = ("auto", "shm", "tcp")  # how tensors move between a wave and a shard
SPAWN_METHODS = ("fork", "exec")  # how the launcher starts its daemons (scripts/forkserver.py)
# Help texts that more than one config class shows: written once.
# the launchers' settings for their shards (LaunchConfig, RunConfig)
SHARDS_CHECKPOINT_EVERY_HELP = "shards checkpoint every N updates (0: only when they stop)"
SHARDS_CHECKPOINT_EVERY_S_HELP = "shards checkpoint every S seconds (0: only when they stop)"
TRANSPORT_HELP = (
    "how tensors move to shards: shm (shared memory, same host), tcp (ZeroMQ frames), "
    "or auto (shm where a shard offers it and its segments open, else tcp)"
)
DAEMON_METRICS_PORT_HELP = (
    "serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; -1: off)"
)


def check_quorum(job: JobConfig, waves: int) -> None:
    """A k-of-n quorum the job's ``waves`` can meet: one larger would make every step wait for
    all of them (bulk-synchronous) without a word."""
    if job.updates == "k-of-n" and waves and job.sync_quorum > waves:
        raise ConfigError(
            f"sync_quorum = {job.sync_quorum} is more than the job's {waves} waves: give "
            f"--sync-quorum between 1 and {waves} (0: half of them)"
        )


@keyword_checked
@dataclass
class PSConfig:
    """One parameter-server shard daemon."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shard_index: int = setting(0, help="which shard of the job this daemon serves")
    bind: str = setting(
        "tcp://127.0.0.1:0", help="ZeroMQ address to listen on; port 0 picks a free one"
    )
    expect_waves: int = setting(
        0, help="hold first pulls until this many waves registered (0: no barrier)"
    )
    ready_file: str = setting("", help="write the bound address here once listening")
    run_dir: str = setting(
        "",
        help="per-push records, checkpoints and the admin token go here; a shard restarted "
        "with the same run dir resumes from its last checkpoint",
    )
    threads: int = setting(1, help="torch threads of the shard process")
    # Limits, so that no client can exhaust the shard's memory: larger messages are dropped by
    # ZeroMQ (the connection is closed), pulls parked beyond max_parked get an error reply.
    max_message_mib: float = setting(1024.0, help="larger messages are dropped")
    max_parked: int = setting(4096, help="pulls held back by the staleness bound at once, at most")
    max_waves: int = setting(
        0,
        help="waves this shard serves at once, at most (0: twice --expect-waves, at least 16, "
        "which leaves room for re-joins)",
    )
    # Checkpoints (into run_dir/checkpoints): every N updates and/or every S seconds (0: never),
    # and always when the daemon stops. A restarted shard resumes from its last checkpoint.
    checkpoint_every: int = setting(0, help="checkpoint every N updates (0: only when stopping)")
    checkpoint_every_s: float = setting(
        0.0, help="checkpoint every S seconds (0: only when stopping)"
    )
    # CURVE (common/security.py): this shard's secret key file and the folder of the public keys
    # of the clients it accepts. Binding beyond loopback without them needs insecure = True.
    curve_secret: str = setting("", help="CURVE: this shard's .key_secret file (wavelet keys)")
    curve_authorized: str = setting(
        "", help="CURVE: folder of the public .key files of the clients to accept"
    )
    curve_admin_key: str = setting(
        "",
        help="CURVE: public .key file of the client whose checkpoint and shutdown requests "
        "are obeyed (instead of the admin token)",
    )
    insecure: bool = setting(
        False, help="allow binding beyond loopback without CURVE (traffic in the clear)"
    )
    shm: bool = setting(
        True, help="offer shared-memory segments to waves on this host (--no-shm: TCP only)"
    )
    metrics_port: int = setting(-1, help=DAEMON_METRICS_PORT_HELP)
    metrics_host: str = setting(
        "", help="address the metrics port binds (default: the host of --bind)"
    )
    admin_token_file: str = setting(
        "",
        help="file of the token checkpoint and shutdown requests need (made 0600 if missing; "
        "default RUN_DIR/admin.token)",
    )
    # Standbys (docs/faults.md): shard i's standby is hosted by the daemon of shard i + 1.
    standby_bind: str = setting(
        "",
        help="also host the standby of the previous shard (index - 1, wrapping), listening on "
        "this ZeroMQ address; it takes that shard over when its primary is lost",
    )
    standby_ready_file: str = setting(
        "", help="write the hosted standby's address here once it listens"
    )
    standby_takeover_file: str = setting(
        "",
        help="when the hosted standby takes its shard over, write its address here (where "
        "that shard's address is looked up: the primary's --ready-file)",
    )
    standby_address: str = setting(
        "", help="where this shard's own standby listens: keep it seeded and tell the waves"
    )
    standby_address_file: str = setting(
        "", help="instead of --standby-address: a file the standby's host writes it to"
    )
    standby_role: bool = setting(False, help="this config is a hosted standby's", flag="")
    job_address_files: list[str] = setting(
        default_factory=list,
        help="every shard's address file, once per shard, in shard order (the launcher's): "
        "what a worker that joins the running job (wavelet worker --join) is told",
        flag="--job-address-file",
        repeated=True,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        non_negative("shard_index", self.shard_index)
        if bool(self.curve_secret) != bool(self.curve_authorized):
            raise ConfigError("CURVE needs both --curve-secret and --curve-authorized")
        if self.curve_admin_key and not self.curve_secret:
            raise ConfigError("--curve-admin-key needs CURVE (--curve-secret, --curve-authorized)")
        positive("max_message_mib", self.max_message_mib)
        positive("max_parked", self.max_parked)
        non_negative("max_waves", self.max_waves)
        non_negative("checkpoint_every", self.checkpoint_every)
        non_negative("checkpoint_every_s", self.checkpoint_every_s)
        if self.shard_index >= self.job.shards:
            raise ConfigError(
                f"shard_index {self.shard_index} is out of range for {self.job.shards} shards"
            )
        non_negative("expect_waves", self.expect_waves)
        check_quorum(self.job, self.expect_waves)
        positive("threads", self.threads)
        check_address("bind", self.bind)
        check_metrics_port(self.metrics_port)
        for name in ("standby_bind", "standby_address"):
            if getattr(self, name):
                check_address(name, getattr(self, name))
        if self.standby_address and self.standby_address_file:
            raise ConfigError("give --standby-address or --standby-address-file, not both")
        if self.standby_bind and self.job.shards < 2:
            raise ConfigError(
                "--standby-bind hosts another shard's standby: the job needs 2 or more shards"
            )

    @property
    def stands_by_for(self) -> int:
        """The shard whose standby this daemon hosts (with ``standby_bind``)."""
        return (self.shard_index - 1) % self.job.shards

    @property
    def wave_limit(self) -> int:
        """``max_waves``, or the default derived from ``expect_waves``."""
        return self.max_waves or max(2 * self.expect_waves, 16)

    @property
    def admin_token_path(self) -> str:
        """Where the admin token is ("" when the shard has neither a token file nor a run dir)."""
        if self.admin_token_file:
            return self.admin_token_file
        return str(Path(self.run_dir) / "admin.token") if self.run_dir else ""


@keyword_checked
@dataclass
class WorkerConfig:
    """One worker daemon: the waves of one device."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shard_addresses: list[str] = setting(
        default_factory=list,
        help="a shard's address, once per shard, in shard order (ps mode)",
        flag="--shard",
        repeated=True,
    )
    shard_address_files: list[str] = setting(
        default_factory=list,
        help="instead of --shard: a file a starting shard writes its address to, once per shard, "
        "in shard order; read once the worker has loaded its data (wavelet launch starts "
        "workers beside their shards this way)",
        flag="--shard-address-file",
        repeated=True,
    )
    device: str = setting("cpu", help="the device whose waves this daemon runs: cpu, cuda:N")
    rank: int = setting(0, help="this worker's index among --num-workers")
    num_workers: int = setting(1, help="worker daemons in the job")
    threads: int = setting(
        0, help="torch threads of this process (0: chosen by a short probe, worker/threads.py)"
    )
    core_budget: int = setting(
        0, help="CPU cores this process may use when it chooses its threads (0: all)"
    )
    run_dir: str = setting("runs/latest", help="where records go")
    mode: str = setting(
        "ps",
        help="ps: waves through the shards; allreduce: one DDP rank, rendezvous from "
        "torchrun's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)",
        choices=MODES,
    )
    schedule: str = setting(
        "ticktock",
        help="ticktock: forwards take turns; together: waves start at once",
        choices=SCHEDULES,
    )
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)
    device_index: int = setting(
        -1,
        help="physical device number for memory reports, when several workers share a device "
        "(default: the rank)",
    )
    resume: bool = setting(
        False,
        help="go on from the clocks the shards restored from their checkpoints (all-reduce: "
        "from rank 0's checkpoint)",
    )
    checkpoint_every_s: float = setting(
        0.0,
        help="all-reduce: rank 0 saves the model and optimizer every S seconds, so that a "
        "group torchrun restarts goes on from there (0: never)",
    )
    cuda_memory_gib: float = setting(
        0.0,
        help="cap this process's CUDA caching allocator at this many GiB, so a large card "
        "behaves like a smaller one (0: no cap)",
    )
    metrics_port: int = setting(-1, help=DAEMON_METRICS_PORT_HELP)
    metrics_host: str = setting("127.0.0.1", help="address the metrics port binds")
    curve_secret: str = setting("", help="CURVE: this worker's .key_secret file")
    curve_server_key: str = setting("", help="CURVE: the shards' public .key file")
    join: str = setting(
        "",
        help="join a running job through any of its shards (tcp://HOST:PORT): it tells the "
        "job, where every shard is and a worker slot; needs --join-token-file",
    )
    join_token_file: str = setting(
        "", help="--join: the job's admin token file (RUN_DIR/admin.token of its launcher)"
    )
    report: bool = setting(
        True,
        help="ps mode: print the progress of this worker's waves and, at the end, the test "
        "metrics of the shards' weights, samples/s and staleness (wavelet launch and wavelet "
        "run show their own)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        given = len(self.shard_addresses) or len(self.shard_address_files)
        if self.shard_addresses and self.shard_address_files:
            raise ConfigError("pass --shard addresses or --shard-address-file files, not both")
        if self.join:
            check_address("--join", self.join)
            if not self.join_token_file:
                raise ConfigError(
                    "--join needs --join-token-file: the job's admin token (RUN_DIR/admin.token "
                    "where its launcher runs)"
                )
        elif self.mode == "ps" and given != self.job.shards:
            raise ConfigError(
                f"got {given} shard addresses for a job of {self.job.shards} shards; pass one "
                "--shard address per shard, in shard order"
            )
        for a in self.shard_addresses:
            check_address("shard address", a)
        check_device(self.device)
        positive("num_workers", self.num_workers)
        if not 0 <= self.rank < self.num_workers:
            raise ConfigError(f"rank {self.rank} is out of range for {self.num_workers} workers")
        non_negative("threads", self.threads)
        non_negative("core_budget", self.core_budget)
        non_negative("cuda_memory_gib", self.cuda_memory_gib)
        non_negative("checkpoint_every_s", self.checkpoint_every_s)
        check_metrics_port(self.metrics_port)
        if self.device_index < 0:
            self.device_index = self.rank
        if bool(self.curve_secret) != bool(self.curve_server_key):
            raise ConfigError("CURVE needs both --curve-secret and --curve-server-key")


@keyword_checked
@dataclass
class LaunchConfig:
    """A whole job on this machine: the shards and one worker per device. From Python its
    settings are ``wavelet.launch``'s keywords::

        wavelet.launch(job, devices=["cpu", "cpu"], mode="allreduce", run_dir="runs/ddp")
    """

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    devices: list[str] = setting(
        default_factory=lambda: ["cpu"],
        help="comma-separated devices, one worker each: cpu, cuda:0,cuda:1, or cpu,cpu for two "
        "CPU workers",
    )
    run_dir: str = setting("", help="where logs, records and checkpoints go (default runs/<time>)")
    host: str = setting("127.0.0.1", help="address the shards bind")
    curve: bool = setting(
        False,
        help="make CURVE keys (in the run dir) and encrypt and authenticate all of the job's "
        "traffic with them",
    )
    insecure: bool = setting(False, help="allow a non-loopback --host without --curve")
    checkpoint_every: int = setting(0, help=SHARDS_CHECKPOINT_EVERY_HELP)
    checkpoint_every_s: float = setting(0.0, help=SHARDS_CHECKPOINT_EVERY_S_HELP)
    resume: bool = setting(False, help="run_dir holds a stopped job: restart it", flag="")
    mode: str = setting(
        "ps",
        help="ps: waves through the shards; allreduce: DDP over torch.distributed (gloo on "
        "CPU, NCCL on GPU), the baseline",
        choices=MODES,
    )
    schedule: str = setting(
        "ticktock",
        help="ps mode: ticktock (forwards take turns) or together (waves start at once)",
        choices=SCHEDULES,
    )
    # Worker processes (ps mode) or DDP ranks (allreduce mode) per device; 2 gives the
    # "two tasks on one device" baselines.
    processes_per_device: int = setting(
        1,
        help="worker processes (ps) or DDP ranks (allreduce) per device; 2 runs two tasks on "
        "each device side by side, the baseline tick-tock is compared with",
        choices=(1, 2),
    )
    threads: int = setting(
        0,
        help="torch threads per worker process (0: the cores divided among the waves that "
        "run at once)",
    )
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)
    cuda_memory_gib: float = setting(
        0.0,
        help="cap each device's CUDA memory at this many GiB, split among its processes, so a "
        "large card behaves like a smaller one (0: no cap)",
    )
    max_restarts: int = setting(
        0,
        help="restart a shard or worker that dies, up to N times in all (shards from their "
        "last checkpoint, workers from the shards' clocks); then stop the job",
    )
    metrics_port: int = setting(
        -1,
        help="every daemon serves Prometheus metrics: shard i on BASE+i, worker r on "
        "BASE+shards+r (0: free ports, listed at start; -1: off)",
    )
    slow_device: str = setting(
        "",
        help="D:PCT: cap the processes of device D (its index in --devices: its worker, or "
        "its all-reduce ranks) at PCT%% of a core through the cgroup cpu controller, alike "
        "for every mode: a slow or shared device (needs a writable cgroup cpu controller)",
    )
    spawn: str = setting(
        "fork",
        help="how daemons start: fork (from one process per job that imported torch once; a "
        "daemon starts in a fraction of a second) or exec (a fresh Python each, 2-5 s of CPU)",
        choices=SPAWN_METHODS,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        non_negative("cuda_memory_gib", self.cuda_memory_gib)
        check_metrics_port(self.metrics_port)
        non_negative("max_restarts", self.max_restarts)
        if not self.devices:
            raise ConfigError("devices is empty: name at least one device, e.g. cpu or cuda:0")
        for d in self.devices:
            check_device(d)
        non_negative("threads", self.threads)
        if self.mode == "ps":
            check_quorum(self.job, len(self.devices) * self.processes_per_device * self.job.waves)
        if self.slow_device:
            from wavelet.common.throttle import parse_cap, why_not

            try:
                parse_cap(self.slow_device, "--slow-device", len(self.devices))
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if why_not():
                raise ConfigError(f"--slow-device: {why_not()}")

    def concrete_job(self) -> JobConfig:
        """The job with ``updates`` and ``wire_dtype = "auto"`` decided for these devices of one
        host (``launch_updates``)."""
        return launch_updates(
            self.job, self.devices, self.mode, self.schedule, self.processes_per_device
        )


@keyword_checked
@dataclass
class RunConfig:
    """One process of a job torchrun started (``wavelet run``): the same on every node; the
    process's role (shard, worker or all-reduce rank) comes from torchrun's environment."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shards_per_node: int = setting(
        1, help="the first K local ranks of each node serve shards, the others are workers"
    )
    mode: str = setting(
        "ps",
        help="ps: shards and tick-tock workers; allreduce: every process a DDP rank",
        choices=MODES,
    )
    run_dir: str = setting(
        "", help="where records go on each node; none means runs/torchrun-<rendezvous id>"
    )
    curve_keys: str = setting(
        "",
        help="CURVE keys every node can read (wavelet keys --job DIR): encrypt and authenticate "
        "all of the job's PS traffic",
    )
    checkpoint_every: int = setting(0, help=SHARDS_CHECKPOINT_EVERY_HELP)
    checkpoint_every_s: float = setting(
        0.0,
        help="shards checkpoint every S seconds (0: only when they stop); all-reduce: rank 0 "
        "saves the model and optimizer, and a group torchrun restarts goes on from there",
    )
    insecure: bool = setting(False, help="allow shards on a non-loopback address without CURVE")
    resume: bool = setting(
        False,
        help="go on from the checkpoints in the run dir (the shards', all-reduce's rank 0's), "
        "as a group torchrun restarts does",
    )
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)

    def __post_init__(self) -> None:
        check_settings(self)
        positive("shards_per_node", self.shards_per_node)
