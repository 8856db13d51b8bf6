"""WorkerDaemon: one process per device, running that device's waves as threads.

Threads rather than processes: on a GPU the waves then share one CUDA caching allocator, so memory
freed by one wave's backward is really available to the other wave's forward (two processes would
each hold their own pool), and on the CPU their computation shares the daemon's thread and its one
sized pool of torch threads instead of fighting for cores (worker/compute.py). See docs/design.md
for the measurements behind this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path

import torch
import zmq

from wavelet.common.daemon_config import WorkerConfig
from wavelet.common.datasets import build_dataset
from wavelet.common.job import loader_settings
from wavelet.common.machine import usable_cores
from wavelet.common.protocol import ShardTimeout
from wavelet.worker.baton import ForwardBaton, NoBaton
from wavelet.worker.compute import InlineCompute, SharedCompute
from wavelet.worker.connection import client_keys, wait_for_addresses
from wavelet.worker.heartbeat import Heartbeat
from wavelet.worker.memory import cap_cuda_memory
from wavelet.worker.metrics import serve_worker_metrics
from wavelet.worker.threads import ThreadChoice, computes_one_at_a_time, probe_threads
from wavelet.worker.wave import Wave, WaveIdentity

log = logging.getLogger(__name__)
# how long a worker started beside its shards waits for their addresses (the launcher gives
# them 60 s to bind, then stops the job)
SHARD_ADDRESS_WAIT_S = 120.0


class WorkerDaemon:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.stop_event = threading.Event()
        self.stop_requested = False  # by a signal or a caller, before the waves' end
        self.shard_addresses = list(config.shard_addresses)

    def stop(self) -> None:
        self.stop_requested = True
        self.stop_event.set()

    def run(self) -> int:
        """Train all waves to the end; 0 on success, 1 if any wave failed."""
        cfg, job = self.config, self.config.job
        settings = loader_settings(job, cfg.device)
        dataset = build_dataset(job.dataset, job.seed, settings, **job.dataset_kwargs)
        if cfg.shard_address_files:  # the shards started beside us: their addresses by now
            try:
                addresses = wait_for_addresses(
                    cfg.shard_address_files, SHARD_ADDRESS_WAIT_S, self.stop_event
                )
            except ShardTimeout as e:
                print(f"wavelet worker: {e}", file=sys.stderr)
                return 1
            if addresses is None:
                return 0
            cfg = self.config = dataclasses.replace(
                cfg, shard_addresses=addresses, shard_address_files=[]
            )
        choice = self._threads(dataset)
        torch.set_num_threads(choice.threads)
        device = torch.device(cfg.device)
        shared = computes_one_at_a_time(cfg.device, choice)
        compute = SharedCompute(choice.threads) if shared else InlineCompute()
        cap_cuda_memory(device, cfg.cuda_memory_gib)
        if cfg.schedule == "ticktock":
            # under wave turns the shards say which wave steps first
            first = None if job.updates == "wave-turns" else 0
            baton = ForwardBaton(job.waves, job.baton_timeout_s, first)
        else:
            baton = NoBaton()
        metrics, endpoint = serve_worker_metrics(cfg, cfg.rank)
        context = zmq.Context()
        # where each shard is served: the waves update it when a standby takes one over
        self.shard_addresses = list(cfg.shard_addresses)
        waves = [
            Wave(
                WaveIdentity(
                    f"w{cfg.rank}", i, cfg.rank * job.waves + i, cfg.num_workers * job.waves
                ),
                cfg,
                dataset,
                baton,
                self.stop_event,
                context,
                evaluate=(cfg.rank == 0 and i == 0),
                metrics=metrics,
                compute=compute,
                on_move=self._shard_moved,
            )
            for i in range(job.waves)
        ]
        log.info(
            "worker %d on %s: %d wave(s), %s%s",
            cfg.rank,
            cfg.device,
            job.waves,
            choice.describe(),
            ", computing on one thread" if compute.shared else "",
        )
        record_threads(cfg, choice, compute.shared)
        runners = [
            threading.Thread(target=w.run, name=f"wave-{i}", daemon=True)
            for i, w in enumerate(waves)
        ]
        for r in runners:
            r.start()
        heartbeat = Heartbeat(
            self.shard_addresses,
            f"w{cfg.rank}",
            lambda: [i for i, r in enumerate(runners) if r.is_alive()],
            job.heartbeat_s,
            context,
            client_keys(cfg),
        )
        heartbeat.start()
        try:
            # A wave that fails leaves the baton, and the others go on alone (DESIGN.md).
            compute.serve(lambda: not any(r.is_alive() for r in runners))
        finally:
            heartbeat.stop()
            heartbeat.join(5.0)
            self.stop_event.set()
            for r in runners:
                r.join(5.0)
            if not any(r.is_alive() for r in runners):
                context.term()
            if endpoint:
                endpoint.stop()
        return report_failures(waves)

    def _shard_moved(self, shard: int, address: str) -> None:
        if self.shard_addresses[shard] != address:
            log.warning("shard %d is served at %s from now on", shard, address)
            self.shard_addresses[shard] = address

    def _threads(self, dataset) -> ThreadChoice:
        cfg = self.config
        budget = cfg.core_budget or usable_cores()
        return probe_threads(cfg.job, cfg.device, budget, dataset, fixed=cfg.threads)


def record_threads(cfg: WorkerConfig, choice: ThreadChoice, shared_compute: bool) -> None:
    """The torch threads, their layout and whether the waves computed on one thread, in the run's
    records beside the waves'."""
    path = Path(cfg.run_dir) / "records" / f"worker-{cfg.rank}-threads.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**dataclasses.asdict(choice), "shared_compute": shared_compute}))


def report_failures(waves: list[Wave]) -> int:
    """One line per distinct failure (both waves of a device usually fail alike, e.g. on an
    unreachable shard), on stderr; 1 if any wave failed, else 0."""
    seen: dict[str, list[str]] = {}
    for w in waves:
        if w.error is not None:
            seen.setdefault(str(w.error) or type(w.error).__name__, []).append(w.ident.name)
    for message, names in seen.items():
        print(f"wavelet worker: wave {', '.join(names)} failed: {message}", file=sys.stderr)
    return 1 if seen else 0
