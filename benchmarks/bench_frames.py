"""A message's CPU on the wire, by how its tensors travel: every tensor in a zero-copy frame of
its own (``pack_below=0``, how every message went before protocol 8) against the small ones
packed into one frame (the default, ``common/protocol.PACK_BELOW``), side by side.

The message is what a wave pushes to shard 0 of a real model, or what shard 0 answers with
(the same tensors, sent tracked as a shard sends its weights), over TCP on loopback to a
receiving process that decodes it. Reported, medians (range) over ``--rounds`` rounds of
``--messages`` messages, the two ways alternating round by round: the sender's CPU per message
(its process, ZeroMQ's I/O thread included) and the receiver's (receive and decode).

    python benchmarks/bench_frames.py                 # narrow ResNet-18 (width 16), bf16 wire
    python benchmarks/bench_frames.py --width 64      # ResNet-18: most tensors over 64 KiB
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import zmq
from summarize_updates import median_range  # benchmarks/, beside this script

from wavelet.common.models import build_model
from wavelet.common.protocol import PACK_BELOW, Header, Op, decode, send_message
from wavelet.common.sharding import ShardingPlan

WAYS = {"a frame per tensor": 0, "small tensors packed": PACK_BELOW}


def _receiver(port_q, cpu_q) -> None:
    """Decode every message; after each burst (an empty message ends it) report CPU ms."""
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    cpu, count = 0.0, 0
    while sock.poll(60_000):
        started = time.process_time()
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and not frames[0].bytes:
            cpu_q.put(1000 * cpu / max(count, 1))
            cpu, count = 0.0, 0
            continue
        if frames[0].bytes == b"stop":
            break
        decode(frames)
        cpu += time.process_time() - started
        count += 1
    sock.close(0)
    ctx.term()


def _burst(sock, tensors, pack_below: int, track: bool, messages: int) -> float:
    """Sender CPU ms per message over ``messages`` messages."""
    started = time.process_time()
    for clock in range(messages):
        h = Header(op=Op.PUSH_PULL, clock=clock, keys=list(range(len(tensors))))
        tracker = send_message(sock, h, tensors, track=track, pack_below=pack_below)
        if tracker is not None:
            tracker.wait(30)  # as a shard waits before it writes those weights again
        time.sleep(0.001)  # the receiver keeps up; sleeping costs no CPU
    return 1000 * (time.process_time() - started) / messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16, help="the ResNet-18's width")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--wire", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=200, help="messages per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model("resnet18", (3, 32, 32), 10, 0, width=args.width)
    plan = ShardingPlan.for_model(model, args.shards, 4 << 20, args.wire)
    chunks = plan.for_shard(0)
    tensors = [torch.full((c.numel,), 1e-3, dtype=c.wire_desc.torch_dtype) for c in chunks]
    small = sum(t.nbytes < PACK_BELOW for t in tensors)
    print(
        f"shard 0 of {args.shards}: {len(tensors)} tensors ({small} under {PACK_BELOW} bytes), "
        f"{sum(t.nbytes for t in tensors) / 1e6:.2f} MB, wire {args.wire}; CPU ms per message, "
        f"medians (range) over {args.rounds} rounds of {args.messages}\n"
    )
    port_q, cpu_q = mp.Queue(), mp.Queue()
    receiver = mp.Process(target=_receiver, args=(port_q, cpu_q), daemon=True)
    receiver.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port_q.get(timeout=60)}")
    print("| message | way | sender, ms | receiver, ms | sender vs a frame per tensor |")
    print("|---|---|---:|---:|---:|")
    try:
        for kind, track in (("push (untracked)", False), ("weights reply (tracked)", True)):
            sent = {way: [] for way in WAYS}
            received = {way: [] for way in WAYS}
            for r in range(args.rounds + 1):  # round 0 warms up
                ways = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
                for way in ways:
                    ms = _burst(sock, tensors, WAYS[way], track, args.messages)
                    sock.send(b"")
                    got = cpu_q.get(timeout=120)
                    if r:
                        sent[way].append(ms)
                        received[way].append(got)
            base = statistics.median(sent["a frame per tensor"])
            for way in WAYS:
                ratio = statistics.median(sent[way]) / base
                out, back = median_range(sent[way], 3), median_range(received[way], 3)
                print(f"| {kind} | {way} | {out} | {back} | {ratio:.2f}x |")
    finally:
        sock.send(b"stop")
        receiver.join(30)
        sock.close(0)
        ctx.term()


if __name__ == "__main__":
    main()
