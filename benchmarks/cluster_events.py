"""What happens to the emulated nodes during a run (``benchmarks/cluster.py``): CPU caps (a slow
node, a co-tenant that comes and goes) and membership changes (a node killed, preempted, started
again), the same for every mode.

Every process of a node lives in a cgroup of its own (``common/throttle.py``): the cap applies
to whatever the node starts, and a kill reaches everything it started, whatever session it is in.
Times count from the moment the job starts training (its first step record on any node).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from wavelet.common.records import read_records
from wavelet.common.throttle import CpuCap


@dataclass(frozen=True)
class Event:
    kind: str  # leave (kill -9), preempt (SIGTERM), join (start the node's worker again)
    node: int
    at_s: float


def parse_event(kind: str, text: str, nodes: int) -> Event:
    """``NODE@T`` -> Event; a bad one is a ValueError with one line."""
    node, sep, at = text.partition("@")
    try:
        ok = sep and 0 < int(node) < nodes and float(at) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"--{kind} {text!r}: expected NODE@SECONDS with NODE from 1 to {nodes - 1} (node 0 "
            "holds the job's store), e.g. 1@10"
        )
    return Event(kind, int(node), float(at))


@dataclass
class NodeTimeline:
    """What happened, when (wall clock), per node: the report shades and marks it."""

    caps: list[tuple[int, float, float, float]] = field(default_factory=list)  # node, t0, t1, pct
    events: list[dict] = field(default_factory=list)  # {"t", "node", "kind"}


class Disturbances:
    """Runs the caps and events of one run in a thread of its own; ``stop()`` lifts them."""

    def __init__(self, caps: list[CpuCap], args, started: threading.Event, join):
        self.caps = caps
        self.args = args
        self.started = started  # set when the job's first step record appears
        self.join = join  # callable(node, at_s): start the node's worker again
        self.timeline = NodeTimeline()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disturbances", daemon=True)

    def start(self) -> None:
        for node, pct in self.args.slow:
            self.caps[node].set(pct)
            self.timeline.caps.append((node, time.time(), float("inf"), pct))
        self._thread.start()

    def _run(self) -> None:
        if not self.started.wait(self.args.grace_s):
            return
        t0 = time.monotonic()
        todo = sorted(self.args.events, key=lambda e: e.at_s)
        noisy = list(self.args.noisy)
        on: dict[int, float] = {}  # node -> wall time its co-tenant came
        while not self._stop.wait(0.05):
            now = time.monotonic() - t0
            while todo and todo[0].at_s <= now:
                self._fire(todo.pop(0), now)
            for node, on_s, off_s, pct in noisy:
                in_cycle = now % (on_s + off_s)
                busy = in_cycle < on_s
                if busy and node not in on:
                    self.caps[node].set(pct)
                    on[node] = time.time()
                elif not busy and node in on:
                    self.caps[node].set(None)
                    self.timeline.caps.append((node, on.pop(node), time.time(), pct))
        for node, since in on.items():
            self.timeline.caps.append((node, since, time.time(), self.caps[node].pct or 0))

    def _fire(self, event: Event, now: float) -> None:
        self.timeline.events.append({"t": time.time(), "node": event.node, "kind": event.kind})
        print(f"   {event.kind} node {event.node} at {now:.1f} s of training", flush=True)
        cap = self.caps[event.node]
        if event.kind == "leave":
            cap.kill_all()
        elif event.kind == "preempt":
            for pid in cap.pids():
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        elif event.kind == "join":
            self.join(event.node, event.at_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for cap in self.caps:
            cap.set(None)


def first_step_seen(run_dir: Path, nodes: int, started: threading.Event, done: threading.Event):
    """Set ``started`` once any node's records hold a step (polled; the run's own thread)."""

    def watch():
        while not done.wait(0.2):
            for n in range(nodes):
                for path in (run_dir / f"node{n}" / "records").glob("worker-*-wave-*.jsonl"):
                    try:
                        if '"kind": "step"' in path.read_text():
                            started.set()
                            return
                    except OSError:
                        pass

    threading.Thread(target=watch, name="first-step", daemon=True).start()


def step_records(node_dir: Path) -> Iterator[dict]:
    """The step records of every wave in one node's run dir."""
    for path in node_dir.glob("records/worker-*-wave-*.jsonl"):
        yield from (r for r in read_records(path) if r.get("kind") == "step")


def node_samples(run_dir: Path, nodes: int) -> list[int]:
    """Samples each node's workers trained (a node started again counts its second life)."""
    return [
        sum(r["samples"] for d in (f"node{n}", f"node{n}-join") for r in step_records(run_dir / d))
        for n in range(nodes)
    ]


def stalls(run_dir: Path, node: int, after_t: float | None) -> float | None:
    """The longest time without a step of ``node``'s waves after wall time ``after_t`` (all
    its waves together: a stall is when none of them steps)."""
    times = sorted(r["t"] for r in step_records(run_dir / f"node{node}"))
    if after_t is not None:
        before = [t for t in times if t <= after_t]
        times = ([before[-1]] if before else []) + [t for t in times if t > after_t]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps, default=None)


def first_push_after(run_dir: Path, started_t: float) -> float | None:
    """Seconds from ``started_t`` (a joiner's process start) to its first step record."""
    first = min((r["t"] for r in step_records(run_dir)), default=None)
    return first - started_t if first is not None else None


def run_logged(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
