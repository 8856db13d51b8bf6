"""WorkerDaemon: one process per device, running that device's waves as threads.

Threads rather than processes: on a GPU the waves then share one CUDA caching allocator, so memory
freed by one wave's backward is really available to the other wave's forward (two processes would
each hold their own pool), and on the CPU they share one sized thread pool instead of fighting for
cores. See docs/design.md for the measurements behind this.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch
import zmq

from wavelet.common.config import WorkerConfig
from wavelet.common.datasets import build_dataset
from wavelet.worker.baton import ForwardBaton, NoBaton
from wavelet.worker.client import client_keys
from wavelet.worker.heartbeat import Heartbeat
from wavelet.worker.wave import Wave, WaveIdentity

log = logging.getLogger(__name__)


class WorkerDaemon:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.stop_event = threading.Event()

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        """Train all waves to the end; 0 on success, 1 if any wave failed."""
        cfg, job = self.config, self.config.job
        threads = cfg.threads or max(1, (os.cpu_count() or 1))
        torch.set_num_threads(threads)
        dataset = build_dataset(job.dataset, job.seed, **job.dataset_kwargs)
        if cfg.schedule == "ticktock":
            baton = ForwardBaton(job.waves, job.baton_timeout_s)
        else:
            baton = NoBaton()
        context = zmq.Context()
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
            )
            for i in range(job.waves)
        ]
        log.info(
            "worker %d on %s: %d wave(s), %d torch thread(s)",
            cfg.rank,
            cfg.device,
            job.waves,
            threads,
        )
        runners = [
            threading.Thread(target=w.run, name=f"wave-{i}", daemon=True)
            for i, w in enumerate(waves)
        ]
        for r in runners:
            r.start()
        heartbeat = Heartbeat(
            cfg.shard_addresses,
            f"w{cfg.rank}",
            lambda: [i for i, r in enumerate(runners) if r.is_alive()],
            job.heartbeat_s,
            context,
            client_keys(cfg),
        )
        heartbeat.start()
        try:
            # A wave that fails leaves the baton, and the others go on alone (DESIGN.md).
            for r in runners:
                while r.is_alive():
                    r.join(0.2)
        finally:
            heartbeat.stop()
            heartbeat.join(5.0)
            self.stop_event.set()
            for r in runners:
                r.join(5.0)
            if not any(r.is_alive() for r in runners):
                context.term()
        return report_failures(waves)


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
