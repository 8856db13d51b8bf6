"""A shard's own CPU per push, in process: what one ``push_pull`` costs a shard of a real model
(validating the push, the update, the weights of the reply), with no sockets and no waves'
compute, so the figure is the shard's alone.

    python benchmarks/bench_shard_cpu.py                  # narrow ResNet, 2 shards, bf16 wire
    python benchmarks/bench_shard_cpu.py --wire fp32 --rounds 9

A model of many small tensors (the narrow ResNet: 0.7M parameters in 122 chunks) is where a
shard's cost per tensor shows. Shard 0 of a job of ``--shards`` shards takes pushes from
``--waves`` waves in turn, each asynchronous push answered with the new weights at once (every
push an update, and every reply a fresh 16-bit copy of the weights and the waves' mean of the
BatchNorm statistics). Reported, medians (range) over ``--rounds`` rounds of ``--pushes``
pushes: CPU milliseconds per push in ``ShardService.handle``, and two of its parts, each timed
alone on shard 0 after every wave pushed once: checking that a push is finite, and the waves'
mean of the buffers a reply serves, each done tensor by tensor (how the shard did it before)
and over all tensors of a dtype at once (how it does now), with the ratio. Whole pushes before
and after a change: run this script with each checkout's package first on ``PYTHONPATH``
(as benchmarks/side_by_side.sh does), alternating, with ``--whole-pushes-only``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from summarize_updates import median_range  # benchmarks/, beside this script

from wavelet.common.config import JobConfig
from wavelet.common.daemon_config import PSConfig
from wavelet.common.models import build_model
from wavelet.common.protocol import Header, Op, encode
from wavelet.common.sharding import ShardingPlan, chunk_view, model_tensors
from wavelet.ps import finite
from wavelet.ps.service import ShardService


def _service(args, plan: ShardingPlan, tensors: dict, run_dir: str):
    job = JobConfig(
        model="resnet18",
        model_kwargs={"width": args.width},
        dataset="patterns",
        shards=args.shards,
        staleness=float("inf"),
        updates="async",
        wire_dtype=args.wire,
        optimizer={"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}},
    )
    service = ShardService(PSConfig(job=job, run_dir=run_dir, expect_waves=0))
    chunks = plan.for_shard(0)
    keys = [c.key for c in chunks]
    peers = []
    for wave in range(args.waves):
        peer = f"w{wave // 2}/{wave % 2}".encode()
        fields = dict(worker=f"w{wave // 2}", wave=wave % 2, plan=plan.fingerprint)
        h = Header(op=Op.REGISTER, clock=0, body={"resume": False}, **fields)
        service.handle(peer, [bytes(f) for f in encode(h)])
        if wave == 0:
            values = [chunk_view(tensors[c.name].detach(), c) for c in chunks]
            body = {"trainable": [c.trainable for c in chunks], "wire": [c.wire for c in chunks]}
            h = Header(op=Op.INIT, keys=keys, body=body, **fields)
            reply = service.handle(peer, [bytes(f) for f in encode(h, values)])
            assert reply[0].header.op == Op.REPLY, reply[0].header.body
        peers.append((peer, fields))
    return service, chunks, keys, peers


def _push_frames(chunks, keys, fields, clock: int, version: int) -> list[bytes]:
    grads = [
        torch.full((c.numel,), 1e-3, dtype=c.wire_desc.torch_dtype)
        if c.trainable
        else torch.zeros(c.numel, dtype=c.wire_desc.torch_dtype)
        for c in chunks
    ]
    h = Header(
        op=Op.PUSH_PULL,
        clock=clock,
        read_version=version,
        keys=keys,
        body={"samples": 32},
        **fields,
    )
    return [bytes(f) for f in encode(h, grads)]


def handle_ms(args, plan, tensors) -> list[float]:
    """CPU ms per push in ShardService.handle, per round."""
    out = []
    with tempfile.TemporaryDirectory() as run_dir:
        service, chunks, keys, peers = _service(args, plan, tensors, run_dir)
        clocks = [0] * len(peers)
        total = args.warmup + args.rounds * args.pushes
        for i in range(total):
            if i >= args.warmup and (i - args.warmup) % args.pushes == 0:
                started = time.process_time()
            w = i % len(peers)
            peer, fields = peers[w]
            frames = _push_frames(chunks, keys, fields, clocks[w], service.shard.version)
            replies = service.handle(peer, frames)
            assert replies[0].header.op == Op.REPLY, replies[0].header.body
            clocks[w] += 1
            if i >= args.warmup and (i - args.warmup) % args.pushes == args.pushes - 1:
                out.append(1000 * (time.process_time() - started) / args.pushes)
        service.close()
    return out


def parts_ms(args, plan, tensors) -> dict[str, tuple[list[float], list[float]]]:
    """Two parts of a push's work on shard 0, after every wave pushed once: tensor by tensor
    (how the shard did them before) and all at once (how it does now), ms per call, per round."""
    with tempfile.TemporaryDirectory() as run_dir:
        service, chunks, keys, peers = _service(args, plan, tensors, run_dir)
        for peer, fields in peers:
            frames = _push_frames(chunks, keys, fields, 0, service.shard.version)
            service.handle(peer, frames)
        shard = service.shard
        pushed = [torch.full((c.numel,), 1e-3, dtype=c.wire_desc.torch_dtype) for c in chunks]
        buffers = [spec for spec in shard.specs if not spec.trainable]
        cases = {
            "finite check": (
                lambda: all(finite._all_finite(t) for t in pushed if t.is_floating_point()),
                lambda: finite.first_non_finite(pushed) is None,
            ),
            "buffers' mean": (
                lambda: [shard._buffer_value(spec) for spec in buffers],
                shard._buffer_values,
            ),
        }
        out = {}
        for name, (each, at_once) in cases.items():
            times: tuple[list[float], list[float]] = ([], [])
            for r in range(args.rounds):
                order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate which goes first
                for way in order:
                    fn = (each, at_once)[way]
                    fn()
                    started = time.process_time()
                    for _ in range(args.pushes):
                        fn()
                    times[way].append(1000 * (time.process_time() - started) / args.pushes)
            out[name] = times
        service.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--width", type=int, default=16, help="the ResNet-18's width")
    parser.add_argument("--wire", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pushes", type=int, default=100, help="pushes per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--whole-pushes-only",
        action="store_true",
        help="leave the parts out (a checkout from before they were batched has not both ways)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a shard runs (one core per node)
    model = build_model("resnet18", (3, 32, 32), 10, 0, width=args.width)
    plan = ShardingPlan.for_model(model, args.shards, 4 << 20, args.wire)
    tensors = {name: t for name, t, _ in model_tensors(model)}
    chunks = plan.for_shard(0)
    print(
        f"shard 0 of {args.shards}: {len(chunks)} chunks, "
        f"{sum(c.numel for c in chunks)} values, wire {args.wire}, {args.waves} waves; "
        f"medians (range) over {args.rounds} rounds of {args.pushes}"
    )
    per_push = median_range(handle_ms(args, plan, tensors), 3)
    print(f"\nCPU ms per push in ShardService.handle: {per_push}")
    if args.whole_pushes_only:
        return
    print("\n| part of a push | tensor by tensor, ms | all at once, ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, (each, at_once) in parts_ms(args, plan, tensors).items():
        ratio = statistics.median(at_once) / statistics.median(each)
        print(f"| {name} | {median_range(each, 3)} | {median_range(at_once, 3)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
