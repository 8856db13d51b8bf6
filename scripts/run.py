"""``wavelet run``: one process of a job started by torchrun, its role taken from torchrun's
environment, so the same command runs on every node (directly, under SLURM or Kubernetes).

PS mode: on each node the first ``--shards-per-node`` local ranks serve shards, the others are
workers (``cuda:<local rank - K>`` where CUDA is present, else ``cpu``). The job's shard count is
nodes x K and its waves follow from the world. Shards publish their addresses through a
key-value store of torch.distributed (a ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``, served by
global rank 0), and workers read them there: no files, no typed lists. Global worker 0 shows the
progress, and when every worker is done it tests the shards' weights, prints the summary, writes
``summary.json`` and stops the shards. All-reduce mode: every process is a DDP rank (env://).

Restarts: under ``torchrun --max-restarts N`` a failed process makes torchrun restart the group;
``TORCHELASTIC_RESTART_COUNT > 0`` means resume: shards restore their checkpoints (same run dir)
and workers go on from their clocks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from wavelet.common.config import JobConfig, concrete_updates, concrete_wire
from wavelet.common.daemon_config import PSConfig, RunConfig, WorkerConfig
from wavelet.common.machine import interface_of, usable_cores
from wavelet.common.settings import ConfigError
from wavelet.scripts.run_end import (
    job_throughput,
    member_ranks,
    publish_throughput,
    wait_for_workers,
)
from wavelet.scripts.signals import INTERRUPTED

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 300.0
CURVE_CLIENT = "worker"  # the client key every worker of a torchrun job uses (wavelet keys --job)
CURVE_ADMIN = "admin"  # the only client key whose checkpoint and shutdown the shards obey


def _job_keys(config: RunConfig):
    """The job's CURVE keys (``--curve-keys DIR``, made by ``wavelet keys --job DIR``)."""
    if not config.curve_keys:
        return None
    from wavelet.common.security import JobKeys

    keys = JobKeys(Path(config.curve_keys))
    for path in (keys.server_secret, keys.server_public, keys.client_secret(CURVE_CLIENT)):
        if not path.exists():
            raise ConfigError(
                f"{path} is missing: make the job's keys with wavelet keys --job "
                f"{config.curve_keys}, in a folder every node can read"
            )
    return keys


@dataclass(frozen=True)
class Role:
    """Where this process stands in the torchrun world."""

    rank: int
    local_rank: int
    world: int
    local_world: int
    node: int
    restart: int
    master_addr: str
    master_port: int
    run_id: str

    @property
    def nodes(self) -> int:
        return self.world // self.local_world

    @classmethod
    def from_env(cls, env=os.environ) -> Role:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        names += ("MASTER_ADDR", "MASTER_PORT")
        missing = [n for n in names if n not in env]
        if missing:
            raise ConfigError(
                f"wavelet run is one process of a torchrun job, but {', '.join(missing)} "
                "is not set; start it with torchrun (see README: Several machines)"
            )
        try:
            role = cls(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world=int(env["WORLD_SIZE"]),
                local_world=int(env["LOCAL_WORLD_SIZE"]),
                node=int(env.get("GROUP_RANK", 0)),
                restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            )
        except ValueError as e:
            raise ConfigError(f"torchrun's environment is malformed: {e}") from None
        if role.world % role.local_world:
            raise ConfigError(
                f"WORLD_SIZE {role.world} is not a multiple of LOCAL_WORLD_SIZE "
                f"{role.local_world}: wavelet run needs the same --nproc-per-node on every node"
            )
        return role


@dataclass(frozen=True)
class Layout:
    """The job's shape, from the world and --shards-per-node."""

    shards_per_node: int
    workers_per_node: int
    nodes: int

    @property
    def shards(self) -> int:
        return self.nodes * self.shards_per_node

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    def shard_index(self, role: Role) -> int | None:
        if role.local_rank < self.shards_per_node:
            return role.node * self.shards_per_node + role.local_rank
        return None

    def worker_rank(self, role: Role) -> int:
        return role.node * self.workers_per_node + role.local_rank - self.shards_per_node


def layout_for(role: Role, shards_per_node: int) -> Layout:
    if not 1 <= shards_per_node < role.local_world:
        raise ConfigError(
            f"--shards-per-node {shards_per_node} leaves no worker among --nproc-per-node "
            f"{role.local_world}: use 1 to {role.local_world - 1}"
        )
    return Layout(shards_per_node, role.local_world - shards_per_node, role.nodes)


def reachable_host(role: Role) -> str:
    """The address shards bind: WAVELET_HOST if set; loopback on a single node; else the address
    of the interface that routes to MASTER_ADDR (a UDP connect sends nothing)."""
    if os.environ.get("WAVELET_HOST"):
        return os.environ["WAVELET_HOST"]
    if role.nodes == 1:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((role.master_addr, role.master_port))
        return s.getsockname()[0]


def _gloo_interface(role: Role) -> None:
    """gloo picks the interface of the host name, often loopback; over several nodes it must use
    the one that routes to MASTER_ADDR, as the shards bind. Set unless the user set it."""
    if role.nodes == 1 or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(reachable_host(role))
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo uses interface %s (the route to %s)", name, role.master_addr)


def open_store(role: Role):
    """The job's key-value store on MASTER_ADDR:MASTER_PORT: torchrun's own agent store where it
    shares it (TORCHELASTIC_USE_AGENT_STORE), else one that global rank 0 serves."""
    import torch.distributed as dist

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(
        role.master_addr,
        role.master_port,
        role.world,
        is_master=role.rank == 0 and not agent_store,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def _key(role: Role, name: str) -> str:
    return f"wavelet/{role.restart}/{name}"  # a restarted group starts a fresh set of keys


def run(config: RunConfig) -> int:
    """This process's part of the job."""
    role = Role.from_env()
    config = replace(config, run_dir=config.run_dir or f"runs/torchrun-{role.run_id}")
    if config.mode == "allreduce":
        return _allreduce_rank(config, role)
    layout = layout_for(role, config.shards_per_node)
    config = replace(config, job=replace(config.job, shards=layout.shards))
    store = open_store(role)
    config = replace(config, job=_agreed_rules(config.job, role, store))
    index = layout.shard_index(role)
    if index is not None:
        return _shard(config, role, layout, index, store)
    return _worker(config, role, layout, store)


def _shard(config: RunConfig, role: Role, layout: Layout, index: int, store) -> int:
    import torch

    from wavelet.common.security import write_private
    from wavelet.ps.server import BindError, ShardServer

    host = reachable_host(role)
    token = _admin_token(role, store)
    token_file = write_private(Path(config.run_dir) / f"admin-{index}.token", token)
    keys = _job_keys(config)
    # Every shard's standby is hosted by the next shard's process (on the next node where the
    # job spans nodes): it takes the shard over when that node is lost (docs/faults.md).
    standbys = layout.shards >= 2
    shard_config = PSConfig(
        job=config.job,
        shard_index=index,
        bind=f"tcp://{host}:0",
        expect_waves=layout.workers * config.job.waves,
        run_dir=config.run_dir,
        checkpoint_every=config.checkpoint_every,
        checkpoint_every_s=config.checkpoint_every_s,
        insecure=config.insecure,
        admin_token_file=str(token_file),
        curve_secret=str(keys.server_secret) if keys else "",
        curve_authorized=str(keys.authorized) if keys else "",
        curve_admin_key=_admin_public_key(keys),
        standby_bind=f"tcp://{host}:0" if standbys else "",
    )
    torch.set_num_threads(1)
    try:
        server = ShardServer(shard_config)
    except BindError as e:
        raise ConfigError(str(e)) from None
    if standbys:
        hosted = shard_config.stands_by_for
        store.set(_key(role, f"standby/{hosted}"), server.hosted.address)
        own = _key(role, f"standby/{index}")
        store.wait([own])
        server.set_standby_address(store.get(own).decode())
        # a standby that takes its shard over is where that shard is looked up from then on
        server.on_takeover = lambda shard, address: store.set(_key(role, f"shard/{shard}"), address)
        if config.job.move_slow_shards and layout.nodes > 1:
            from wavelet.ps.placement import SpeedPlacement

            standby_of_mine = (index + 1) % layout.shards  # hosts this shard's standby
            server.placement = SpeedPlacement(
                server.service,
                own_node=role.node,
                standby_node=standby_of_mine // layout.shards_per_node,
                node_of_worker=lambda rank: rank // layout.workers_per_node,
                hosted_node=hosted // layout.shards_per_node,
            )
    store.set(_key(role, f"shard/{index}"), server.address)
    store.set(_key(role, f"process/{index}"), server.address)  # kept where a standby takes over
    # as the launcher's shards do: where to point wavelet stats, or a worker that joins
    (Path(config.run_dir) / f"ps-{index}.addr").write_text(server.address)
    # where every shard is now, for a worker that joins the job (wavelet worker --join)
    server.set_directory(
        lambda: [store.get(_key(role, f"shard/{i}")).decode() for i in range(layout.shards)]
    )
    log.info("shard %d of %d serving on %s", index, layout.shards, server.address)
    from wavelet.scripts.signals import on_signals, stop_with_parent

    on_signals(server.stop)
    stop_with_parent(server.stop)
    server.serve_forever()
    return 0


def _admin_public_key(keys) -> str:
    """The admin client's public key file of a job's CURVE keys ("" for keys made before
    there was one: the store's token is then what authorizes)."""
    if keys is None or not keys.client_public(CURVE_ADMIN).exists():
        return ""
    return str(keys.client_public(CURVE_ADMIN))


def _agreed_rules(job: JobConfig, role: Role, store) -> JobConfig:
    """``job`` with ``updates`` and ``wire_dtype = "auto"`` decided once, by global rank 0 from
    its node's devices and the number of nodes, and shared through the store: every shard and
    worker of the job must run the same rule and send the same dtype."""
    if job.updates != "auto" and job.wire_dtype != "auto":
        return job
    import torch

    key = _key(role, "rules")
    if role.rank == 0:
        decided = concrete_wire(
            concrete_updates(job, not torch.cuda.is_available()), role.nodes, mode="ps"
        )
        store.set(key, f"{decided.updates} {decided.wire_dtype}")
    store.wait([key])
    updates, wire = store.get(key).decode().split()
    return replace(job, updates=updates, wire_dtype=wire)


def _admin_token(role: Role, store) -> str:
    """One token for the job's shards, made by global rank 0 and shared through the store."""
    import secrets

    key = _key(role, "admin-token")
    if role.rank == 0:
        store.set(key, secrets.token_hex(32))
    store.wait([key])
    return store.get(key).decode()


def _worker(config: RunConfig, role: Role, layout: Layout, store) -> int:
    import torch

    from wavelet.common.job import check_job
    from wavelet.worker.daemon import WorkerDaemon

    rank = layout.worker_rank(role)
    names = [_key(role, f"shard/{i}") for i in range(layout.shards)]
    store.wait(names)
    addresses = [store.get(k).decode() for k in names]
    keys = _job_keys(config)
    job, run_dir = config.job, config.run_dir
    local = role.local_rank - layout.shards_per_node
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    cores = max(1, usable_cores() // layout.workers_per_node)
    worker_config = WorkerConfig(
        job=job,
        shard_addresses=addresses,
        device=device,
        rank=rank,
        num_workers=layout.workers,
        run_dir=run_dir,
        core_budget=cores,
        resume=role.restart > 0 or config.resume,
        transport=config.transport,
        curve_secret=str(keys.client_secret(CURVE_CLIENT)) if keys else "",
        curve_server_key=str(keys.server_public) if keys else "",
        report=False,  # worker 0 shows the job's progress and summary
    )
    check_job(job, layout.workers * job.waves)
    daemon = WorkerDaemon(worker_config)
    from wavelet.scripts.signals import on_signals, stop_with_parent

    on_signals(daemon.stop)
    stop_with_parent(daemon.stop)
    started = time.time()
    if rank == 0:
        code = _report_while(daemon, job, role, layout, store, addresses, run_dir, started, keys)
    else:
        code = daemon.run()
        publish_throughput(store, _key(role, f"throughput/{rank}"), Path(run_dir), rank)
    store.set(_key(role, f"done/{rank}"), str(code))
    return code


def _report_while(daemon, job, role, layout, store, addresses, run_dir, started, keys) -> int:
    """Worker 0: train, showing progress from this node's records; then, once every worker is
    done, test the shards' weights, print the summary, write summary.json, stop the shards."""
    from wavelet.scripts.report import Progress, ProgressLines, format_summary, summarize

    progress = Progress(Path(run_dir), job.epochs, since=started)
    with ProgressLines(progress, started):
        code = daemon.run()
    if daemon.stop_requested:
        # torchrun stops the group (a process failed, or Ctrl-C): a shard may be gone, so no
        # test of the weights and no summary, which would wait on it; the checkpoints stay
        print("wavelet run: stopped before the end; no summary", file=sys.stderr, flush=True)
        return INTERRUPTED
    publish_throughput(store, _key(role, "throughput/0"), Path(run_dir), 0)
    store.set(_key(role, "done/0"), str(code))
    # with CURVE, the admin key (not the token in the store) lets worker 0 stop the shards
    client_keys = None
    if keys:
        client_keys = keys.client(CURVE_ADMIN if _admin_public_key(keys) else CURVE_CLIENT)

    def shard_addresses() -> list[str]:  # where each shard is now (a standby took one over?)
        return [store.get(_key(role, f"shard/{i}")).decode() for i in range(layout.shards)]

    done = {r: _key(role, f"done/{r}") for r in range(layout.workers)}
    gone = wait_for_workers(
        store, done, members=lambda: member_ranks(shard_addresses(), client_keys)
    )
    finished = [r for r in done if r not in gone]
    if any(int(store.get(done[r])) != 0 for r in finished):
        print("wavelet run: a worker failed; see its log", file=sys.stderr)
        return 1
    summary = summarize(
        Path(run_dir),
        "ps (torchrun)",
        job,
        shard_addresses(),
        progress,
        client_keys,
        _admin_token(role, store),
        job_wide=job_throughput(
            store, [_key(role, f"throughput/{r}") for r in finished], lost=len(gone)
        ),
        also_stop=[store.get(_key(role, f"process/{i}")).decode() for i in range(layout.shards)],
    )
    print("\n" + format_summary(summary), flush=True)
    return 0


def _allreduce_rank(config: RunConfig, role: Role) -> NoReturn:
    import torch

    from wavelet.scripts.signals import stop_with_parent

    stop_with_parent(lambda: os._exit(1), grace_s=0.0)  # a rank alone has nothing to save
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nor when torchrun stops its group

    from wavelet.worker.allreduce import AllReduceWorker, exit_rank, run_rank

    _gloo_interface(role)
    device = f"cuda:{role.local_rank}" if torch.cuda.is_available() else "cpu"
    job, run_dir = config.job, config.run_dir
    rank_config = WorkerConfig(
        job=job,
        device=device,
        rank=0,
        num_workers=1,
        threads=max(1, usable_cores() // role.local_world),
        run_dir=run_dir,
        mode="allreduce",
        checkpoint_every_s=config.checkpoint_every_s,
        # torchrun restarted the group, or a new one goes on: from rank 0's checkpoint
        resume=role.restart > 0 or config.resume,
    )
    started = time.time()
    code = run_rank(AllReduceWorker(rank_config))
    store = open_store(role)
    publish_throughput(store, _key(role, f"throughput/{role.rank}"), Path(run_dir), role.rank)
    store.set(_key(role, f"done/{role.rank}"), str(code))
    if role.rank == 0 and code == 0:
        from wavelet.scripts.report import Progress, format_summary, summarize

        wait_for_workers(store, {r: _key(role, f"done/{r}") for r in range(role.world)})
        progress = Progress(Path(run_dir), job.epochs, since=started)
        throughput = job_throughput(
            store, [_key(role, f"throughput/{r}") for r in range(role.world)]
        )
        summary = summarize(
            Path(run_dir), "allreduce (torchrun)", job, [], progress, job_wide=throughput
        )
        print("\n" + format_summary(summary), flush=True)
    exit_rank(code)
