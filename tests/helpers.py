"""Small pieces shared by tests: a model with its plan and client, raw requests to a shard."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import msgpack
import torch
import zmq

from wavelet.common.config import JobConfig
from wavelet.common.daemon_config import PSConfig
from wavelet.common.models import build_model
from wavelet.common.protocol import PROTOCOL_VERSION, Header, Op, decode, encode
from wavelet.common.sharding import ShardingPlan, chunk_view, model_tensors
from wavelet.ps.service import ShardService
from wavelet.worker.client import PSClient

TIMEOUT_S = 20.0


def free_port() -> int:
    """A port nothing listens on right now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    return build_model("mlp", (4,), 3, seed, hidden=hidden)


def client_for(
    model,
    addresses,
    worker="w0",
    wave=0,
    stop=None,
    timeout_s=TIMEOUT_S,
    transport="auto",
    wire_dtype="fp32",
    error_feedback=False,
    placement="size",
    part_bytes=0,
):
    plan = ShardingPlan.for_model(model, len(addresses), 4 << 20, wire_dtype, placement)
    tensors = {n: t for n, t, _ in model_tensors(model)}
    return PSClient(
        addresses,
        plan,
        tensors,
        worker,
        wave,
        timeout_s,
        stop or threading.Event(),
        transport=transport,
        error_feedback=error_feedback,
        part_bytes=part_bytes,
    )


def shard_values(addresses, seed=0, wire_dtype="fp32", placement="size") -> list[torch.Tensor]:
    """The shards' current master weights, read as an observer into a fresh model."""
    model = tiny_model(seed)
    c = client_for(model, addresses, worker="observer", wire_dtype=wire_dtype, placement=placement)
    try:
        c.pull(0, observer=True, master=True)
    finally:
        c.close()
    return [t.detach().clone() for t in model.state_dict().values()]


def push_header(plan: str, chunks, worker: str = "w0", wave: int = 0, **over) -> Header:
    """A push of ``chunks`` (one shard's) for clock 0 from version 0, as a wave would build it;
    ``over`` replaces any field (clock, read_version, keys, body, op...)."""
    fields = dict(
        op=Op.PUSH,
        worker=worker,
        wave=wave,
        clock=0,
        read_version=0,
        plan=plan,
        keys=[c.key for c in chunks],
    )
    fields.update(over)
    return Header(**fields)


class RawClient:
    """A DEALER that sends hand-made frames, for bad-input tests."""

    def __init__(self, address: str):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send_frames(self, frames: list) -> Header:
        self.sock.send_multipart(frames)
        assert self.sock.poll(TIMEOUT_S * 1000), "shard did not answer"
        h, _ = decode(self.sock.recv_multipart())
        return h

    def request(self, header: Header, tensors=()) -> Header:
        return self.send_frames([bytes(f) for f in encode(header, list(tensors))])

    def raw_header(self, **fields) -> bytes:
        d = {
            "v": PROTOCOL_VERSION,
            "op": "stats",
            "rid": 1,
            "worker": "",
            "wave": -1,
            "clock": -1,
            "read": -1,
            "plan": "",
            "keys": [],
            "tensors": [],
            "body": {},
        }
        d.update(fields)
        return msgpack.packb(d)

    def close(self) -> None:
        self.sock.close(0)


class ServiceWave:
    """Frames a wave would send to a one-shard job, and the replies, through ``service.handle``."""

    def __init__(
        self,
        service: ShardService,
        worker: str = "w0",
        peer: bytes = b"",
        wave: int = 0,
        wire_dtype: str = "fp32",
        model: torch.nn.Module | None = None,
    ):
        self.service = service
        # its connection: one per wave, as a PSClient has
        self.peer = peer or f"{worker}/{wave}".encode()
        self.wave = wave
        self.model = model if model is not None else tiny_model()
        self.plan = ShardingPlan.for_model(self.model, 1, 4 << 20, wire_dtype)
        self.tensors = {n: t for n, t, _ in model_tensors(self.model)}
        self.chunks = self.plan.for_shard(0)
        self.worker = worker

    def request(self, op: Op, tensors=(), **fields) -> Header:
        out = self.send(op, tensors, **fields)
        assert len(out) == 1, out
        return reply_of(out[0])

    def send(self, op: Op, tensors=(), **fields) -> list:
        """Every message the service answers with (the reply, and pulls it released)."""
        h = Header(op=op, worker=self.worker, wave=self.wave, plan=self.plan.fingerprint, **fields)
        return self.service.handle(self.peer, [bytes(f) for f in encode(h, list(tensors))])

    def join(self, resume: bool = False) -> Header:
        h = self.request(Op.REGISTER, clock=0, body={"resume": resume})
        if not h.body["initialized"]:
            values = [chunk_view(self.tensors[c.name].detach(), c) for c in self.chunks]
            body = {"trainable": [c.trainable for c in self.chunks]}
            body["wire"] = [c.wire for c in self.chunks]
            assert self.request(Op.INIT, values, keys=self.keys, body=body)
        return h

    @property
    def keys(self) -> list[int]:
        return [c.key for c in self.chunks]

    def push(self, clock: int, read: int, value: float = 0.1, dtype=None) -> Header:
        """Gradients of ``value`` everywhere, in the plan's wire dtype unless ``dtype``."""
        grads = [
            torch.full((c.numel,), value, dtype=dtype or c.wire_desc.torch_dtype)
            for c in self.chunks
        ]
        return self.request(Op.PUSH, grads, clock=clock, read_version=read, keys=self.keys)


def run_threads(threads: list[threading.Thread], errors: list, timeout_s: float = 90) -> None:
    """Start ``threads``, wait for each within ``timeout_s``, and fail with what they put in
    ``errors``."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a wave did not finish"
    assert not errors, errors


def reply_of(message) -> Header:
    header, _ = decode([bytes(f) for f in encode(message.header, list(message.tensors))])
    return header


def service_for(tmp_path, job: dict | None = None, **ps) -> ShardService:
    """An in-process shard of a one-shard job (asynchronous unless ``job`` says otherwise)."""
    settings = dict(model="mlp", dataset="synthetic", shards=1, staleness=float("inf"))
    job_config = JobConfig(**{**settings, **(job or {})})
    return ShardService(PSConfig(job=job_config, run_dir=str(tmp_path), **ps), admin_token="secret")


def record_samples(run_dir) -> int:
    """Training samples in a run dir's worker records (steps of every wave and rank)."""
    from wavelet.common.records import read_records

    return sum(
        r["samples"]
        for path in (Path(run_dir) / "records").glob("worker-*.jsonl")
        for r in read_records(path)
        if r["kind"] == "step"
    )


def mse_step(model, batch):
    """A user's own step, importable as ``helpers:mse_step``: regression of the model's outputs
    on float targets, logging the batch's mean absolute error."""
    x, y = batch
    out = model(x)
    return torch.nn.functional.mse_loss(out, y), {"mae": (out - y).abs().mean().item()}


def processes_mentioning(text: str) -> list[int]:
    """The pids of the processes (not this one) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found
