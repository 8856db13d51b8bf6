"""Small pieces shared by tests: a model with its plan and client, raw requests to a shard."""

from __future__ import annotations

import threading

import msgpack
import torch
import zmq

from wavelet.common.models import build_model
from wavelet.common.protocol import PROTOCOL_VERSION, Header, decode, encode
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.worker.client import PSClient

TIMEOUT_S = 20.0


def tiny_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    return build_model("mlp", (4,), 3, seed, hidden=hidden)


def client_for(
    model, addresses, worker="w0", wave=0, stop=None, timeout_s=TIMEOUT_S, transport="auto"
):
    plan = ShardingPlan.for_model(model, len(addresses), 4 << 20)
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
    )


def shard_values(addresses, seed=0) -> list[torch.Tensor]:
    """The shards' current weights, read as an observer into a fresh model."""
    model = tiny_model(seed)
    c = client_for(model, addresses, worker="observer")
    try:
        c.pull(0, observer=True)
    finally:
        c.close()
    return [t.detach().clone() for t in model.state_dict().values()]


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
