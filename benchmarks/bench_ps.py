"""Benchmark: one push-and-pull through the sharded PS, against raw pyzmq and gloo all_reduce.

All three move the same tensor (11M float32 by default, ResNet-18's size) on loopback, measured
side by side in one run, in alternating rounds, reported as medians with ratios:

- wavelet PS: a PSClient pushes the gradient to 2 shard daemons (``wavelet ps``) and pulls the
  updated weights, in one round trip per shard; the shards validate the push and run SGD. Twice:
  tensors through shared memory (the default on one host) and as ZeroMQ frames over TCP.
- raw pyzmq: the same bytes, split the same way, sent to 2 server processes that answer with the
  same number of bytes (DEALER/ROUTER, zero-copy, no protocol, no optimizer).
- the wavelet PS again with a bf16 wire (``--wire-dtype bf16``: 16-bit gradients and weights,
  fp32 master weights on the shards), over shared memory and TCP. Bytes per round trip of every
  PS row come from the shards' own byte counters (their Prometheus endpoint), not from sizes.
- gloo all_reduce: the tensor all-reduced between 2 processes (what DDP does with gradients).
- with ``--curve``: the wavelet PS round trip again, with CURVE encryption and authentication.
- with ``--slow-reader N [N ...]``: the wavelet PS round trip again, on shards that N other
  clients keep sending weight replies they never read (the shards must neither wait for them
  nor tear a reply; target: within 1.2x of the plain TCP round trip).

Run: ``python benchmarks/bench_ps.py`` (``--help`` for sizes and repeats).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
import zmq

from wavelet.common.protocol import Header, Op, encode
from wavelet.common.security import JobKeys
from wavelet.common.sharding import ShardingPlan
from wavelet.worker.client import PSClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- raw pyzmq ------------------------------------------------------------------------------


def _raw_server(port_queue, nbytes: int) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    port_queue.put(port)
    reply = bytearray(nbytes)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            break
        sock.send_multipart([frames[0], memoryview(reply)], copy=False)
    sock.close(0)
    ctx.term()


class RawZmq:
    def __init__(self, shards: int, nbytes_per_shard: int):
        self.ctx = zmq.Context()
        q = mp.get_context("spawn").Queue()
        self.procs = [
            mp.get_context("spawn").Process(
                target=_raw_server, args=(q, nbytes_per_shard), daemon=True
            )
            for _ in range(shards)
        ]
        for p in self.procs:
            p.start()
        self.socks = []
        for _ in self.procs:
            s = self.ctx.socket(zmq.DEALER)
            s.connect(f"tcp://127.0.0.1:{q.get(timeout=60)}")
            self.socks.append(s)
        self.payload = [torch.randn(nbytes_per_shard // 4).numpy() for _ in self.procs]

    def step(self) -> None:
        for s, p in zip(self.socks, self.payload, strict=True):
            s.send(p, copy=False)
        for s in self.socks:
            if not s.poll(60_000):
                raise TimeoutError("raw server did not answer")
            s.recv(copy=False)

    def close(self) -> None:
        for s in self.socks:
            s.send(b"stop")
            s.close(linger=1000)
        for p in self.procs:
            p.join(10)
        self.ctx.term()


# --- wavelet PS -----------------------------------------------------------------------------


class WaveletPS:
    def __init__(
        self, shards: int, numel: int, workdir: Path, curve: bool = False, wire_dtype="fp32"
    ):
        self.procs = []
        self.waves: dict[str, list] = {}
        self.wire_dtype = wire_dtype
        self.keys = JobKeys.create(workdir / "keys", ["bench"]) if curve else None
        self.numel = numel
        tag = f"{'-curve' if curve else ''}-{wire_dtype}"
        self.run_dir = workdir / f"ps{tag}"
        try:
            self.addresses = [
                self._start(i, shards, workdir / f"ps-{i}{tag}.addr") for i in range(shards)
            ]
            self.client = self._join("tcp")
        except BaseException:
            self.close()  # no shard outlives a failed start
            raise
        self.step = lambda: self._step("tcp")

    def _start(self, i: int, shards: int, ready: Path) -> str:
        """Start shard ``i``; its address once it listens."""
        keys = self.keys
        cmd = [
            sys.executable,
            "-m",
            "wavelet.scripts.cli",
            "--log-level",
            "WARNING",
            "ps",
            "--shards",
            str(shards),
            "--shard-index",
            str(i),
            "--staleness",
            "inf",
            "--ready-file",
            str(ready),
            "--run-dir",
            str(self.run_dir),
            "--metrics-port",
            "0",
            "--wire-dtype",
            self.wire_dtype,
        ]
        if keys:
            cmd += [
                "--curve-secret",
                str(keys.server_secret),
                "--curve-authorized",
                str(keys.authorized),
            ]
        self.procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError("shard daemon did not start")
            time.sleep(0.05)
        return ready.read_text().strip()

    def _join(self, transport: str) -> PSClient:
        """A client of its own (model, worker name) for ``transport``, registered and pulled."""
        weight = torch.nn.Parameter(torch.randn(self.numel) * 0.01)
        weight.grad = torch.randn(self.numel) * 1e-4
        plan = ShardingPlan.build(
            [("w", weight, True)], len(self.addresses), 4 << 20, self.wire_dtype
        )
        client = PSClient(
            self.addresses,
            plan,
            {"w": weight},
            f"bench-{transport}",
            0,
            120.0,
            keys=self.keys.client("bench") if self.keys else None,
            transport=transport,
        )
        try:
            client.register(0)
            self.waves[transport] = [client, client.pull(0), 0, weight]
        except BaseException:
            client.close()
            raise
        return client

    def step_over(self, transport: str):
        """The push+pull step of a client of this transport (joined on first use)."""
        if transport not in self.waves:
            self._join(transport)
        return lambda: self._step(transport)

    def _step(self, transport: str) -> None:
        wave = self.waves[transport]
        client, pulled, clock, _ = wave
        wave[1] = client.push_pull(clock, pulled.versions)
        wave[2] = clock + 1

    def shard_bytes(self) -> int:
        """Bytes all shards received and sent over ZeroMQ so far, from their own counters."""
        total = 0
        for url in sorted((self.run_dir / "metrics").glob("ps-*.url")):
            with urllib.request.urlopen(url.read_text().strip(), timeout=10) as reply:
                for line in reply.read().decode().splitlines():
                    name = line.split("{")[0]
                    if name in (
                        "wavelet_shard_received_bytes_total",
                        "wavelet_shard_sent_bytes_total",
                    ):
                        total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def add_slow_readers(self, readers: int, pulls: int = 6) -> None:
        """``readers`` clients per shard that each ask for the weights ``pulls`` times and
        never read."""
        self.slow = []
        for address in self.addresses:
            for _ in range(readers):
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 1)
                sock.connect(address)
                for i in range(pulls):
                    h = Header(op=Op.PULL, request_id=i + 1, plan=self.client.plan.fingerprint)
                    h.body = {"observer": True}
                    sock.send_multipart([bytes(f) for f in encode(h)])
                self.slow.append(sock)
        time.sleep(0.5)  # the replies fill every buffer between the shards and them

    def keep_asking(self) -> None:
        """Each non-reader asks once more, so every timed step meets fresh refusals."""
        h = Header(op=Op.PULL, request_id=99, plan=self.client.plan.fingerprint)
        h.body = {"observer": True}
        frames = [bytes(f) for f in encode(h)]
        for sock in self.slow:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        for sock in getattr(self, "slow", []):
            sock.close(0)
        for client, *_ in self.waves.values():
            client.leave()
            client.close()
        for p in self.procs:
            p.terminate()
            p.wait(15)


# --- gloo all_reduce ------------------------------------------------------------------------


def _gloo_rank(rank: int, port: int, numel: int, iters: int, rounds_q, go_q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(numel)
    while True:
        cmd = go_q[rank].get()
        if cmd == "stop":
            break
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        if rank == 0:
            rounds_q.put(times)
    dist.destroy_process_group()


class Gloo:
    def __init__(self, numel: int, iters: int):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.go = [ctx.Queue(), ctx.Queue()]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_gloo_rank, args=(r, port, numel, iters, self.results, self.go), daemon=True
            )
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def round(self) -> list[float]:
        for q in self.go:
            q.put("run")
        return self.results.get(timeout=600)

    def close(self) -> None:
        for q in self.go:
            q.put("stop")
        for p in self.procs:
            p.join(30)


def _slow_row(readers: int) -> str:
    return f"wavelet PS push+pull, {readers} client(s) per shard never read"


def _timed(step, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=11_000_000, help="float32 elements moved")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="timed operations per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, methods alternating")
    p.add_argument(
        "--curve",
        action="store_true",
        help="also time push+pull with CURVE encryption and authentication",
    )
    p.add_argument(
        "--slow-reader",
        type=int,
        nargs="*",
        metavar="N",
        help="also time push+pull while N other clients per shard never read their weight "
        "replies (one row per N; no N: 1)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    nbytes = args.numel * 4
    per_shard = nbytes // args.shards
    times: dict[str, list[float]] = {
        "wavelet PS push+pull, shared memory": [],
        "wavelet PS push+pull, TCP": [],
        "wavelet PS push+pull, bf16 wire, shared memory": [],
        "wavelet PS push+pull, bf16 wire, TCP": [],
        "raw pyzmq same bytes": [],
        "gloo all_reduce (2 procs)": [],
    }
    if args.curve:
        times["wavelet PS push+pull, CURVE"] = []
    readers = [] if args.slow_reader is None else (args.slow_reader or [1])
    for n in readers:
        times[_slow_row(n)] = []
    with tempfile.TemporaryDirectory() as tmp:
        ps = WaveletPS(args.shards, args.numel, Path(tmp))
        shm_step = ps.step_over("shm")
        ps16 = WaveletPS(args.shards, args.numel, Path(tmp), wire_dtype="bf16")
        shm16_step = ps16.step_over("shm")
        moved: dict[str, list[float]] = {}  # per PS row: bytes per round trip, per round

        def timed_ps(name: str, step, server: WaveletPS) -> None:
            before = server.shard_bytes()
            times[name] += _timed(step, args.iters)
            moved.setdefault(name, []).append((server.shard_bytes() - before) / args.iters)

        secure = WaveletPS(args.shards, args.numel, Path(tmp), curve=True) if args.curve else None
        slowed = {}
        for n in readers:
            slowed[n] = WaveletPS(args.shards, args.numel, Path(tmp) / f"slow-{n}")
            slowed[n].add_slow_readers(n)
        raw = RawZmq(args.shards, per_shard)
        gloo = Gloo(args.numel, args.iters)
        try:
            extra = tuple(x.step for x in (secure, *slowed.values()) if x)
            for step in (shm_step, ps.step, shm16_step, ps16.step, raw.step, *extra):
                # warm-up: first touches page in buffers
                _timed(step, 2)
            for r in range(args.rounds):
                times["raw pyzmq same bytes"] += _timed(raw.step, args.iters)
                timed_ps("wavelet PS push+pull, shared memory", shm_step, ps)
                timed_ps("wavelet PS push+pull, TCP", ps.step, ps)
                timed_ps("wavelet PS push+pull, bf16 wire, shared memory", shm16_step, ps16)
                timed_ps("wavelet PS push+pull, bf16 wire, TCP", ps16.step, ps16)
                if secure:
                    times["wavelet PS push+pull, CURVE"] += _timed(secure.step, args.iters)
                for n, slow in slowed.items():

                    def step(slow=slow):
                        slow.keep_asking()
                        slow.step()

                    times[_slow_row(n)] += _timed(step, args.iters)
                gloo_times = gloo.round()
                times["gloo all_reduce (2 procs)"] += gloo_times if r else gloo_times[2:]
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            ps.close()
            ps16.close()
            for extra_ps in (secure, *slowed.values()):
                if extra_ps:
                    extra_ps.close()
            raw.close()
            gloo.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    raw_t = medians["raw pyzmq same bytes"]
    gloo_t = medians["gloo all_reduce (2 procs)"]
    tcp_t = medians["wavelet PS push+pull, TCP"]
    print(
        f"\n{args.numel:,} float32 ({nbytes / 1e6:.0f} MB), {args.shards} shards, "
        f"{args.rounds}x{args.iters} operations each, medians on {os.cpu_count()} cores\n"
    )
    # Per process, each method sends and receives the tensor's size once (a 2-rank ring
    # all_reduce sends 2 * (n - 1) / n of it and receives as much), so GB/s compare directly.
    # GB/s counts the fp32 tensor's bytes for every row (bf16 rows: the job done per second);
    # "MB per round trip" is what the shards' counters saw cross ZeroMQ.
    print(
        "| method | median ms | GB/s (fp32 bytes sent + received) | MB per round trip "
        "(shard counters) | throughput vs raw pyzmq | time vs gloo all_reduce | "
        "speed vs PS over TCP |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, t in medians.items():
        wire = f"{statistics.median(moved[name]) / 1e6:.1f}" if name in moved else "-"
        print(
            f"| {name} | {1000 * t:.1f} | {2 * nbytes / t / 1e9:.2f} | {wire} | "
            f"{raw_t / t:.2f}x | {t / gloo_t:.2f}x | {tcp_t / t:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
