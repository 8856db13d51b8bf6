"""A client that never reads its replies must not stall a shard, pin its weights mid-update, or
starve its timers; every weight set any reply carries equals exactly one version."""

import threading
import time

import pytest
import torch
import zmq
from conftest import wait_for
from helpers import TIMEOUT_S, RawClient, client_for, tiny_model

from wavelet.common.protocol import Header, Op, decode, encode
from wavelet.common.sharding import chunk_view

JOB = ["--model", "mlp", "--dataset", "synthetic", "--staleness", "inf"]


def _hostile_reader(address: str) -> zmq.Socket:
    """A DEALER that takes one message into its queue and then reads nothing."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    return sock


def _observer_pull(sock: zmq.Socket, plan: str, request_id: int) -> None:
    h = Header(op=Op.PULL, request_id=request_id, plan=plan, body={"observer": True})
    sock.send_multipart([bytes(f) for f in encode(h)])


@pytest.mark.timeout(120)
def test_unread_replies_delay_no_one_and_never_carry_torn_weights(shard_daemons):
    daemons = shard_daemons(JOB, count=1)
    address = daemons.addresses[0]
    # 2.3M floats (9 MB) per reply: a few unread ones fill every socket buffer on the way
    model = tiny_model(hidden=1500)
    wave = client_for(model, daemons.addresses, worker="w", timeout_s=15)
    hostile = _hostile_reader(address)
    heart = RawClient(address)
    try:
        wave.register(0)
        pulled = wave.pull(0)
        plan = wave.plan.fingerprint
        seen = {}  # version -> the weights the (prompt) wave read at that version
        seen[pulled.versions[0]] = {n: t.detach().clone() for n, t in wave.tensors.items()}
        for i in range(6):
            _observer_pull(hostile, plan, 100 + i)
        # those replies fill every buffer on the way: the shard refuses the reads beyond its
        # per-client budget of unsent replies
        wait_for(
            lambda: heart.request(Header(op=Op.STATS)).body["rejected"] >= 1,
            TIMEOUT_S,
            "the shard never refused the reader that does not read",
        )
        for clock in range(12):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (clock + 1))
            # each step would wait behind the unread replies if the shard waited for them
            pulled = wave.push_pull(clock, pulled.versions)
            seen[pulled.versions[0]] = {n: t.detach().clone() for n, t in wave.tensors.items()}
            _observer_pull(hostile, plan, 200 + clock)
            # heartbeats are answered all along
            beat = heart.request(Header(op=Op.HEARTBEAT, worker="w", body={"waves": [0]}))
            assert beat.op == "reply", beat
        assert pulled.versions == [12]

        # now read everything the hostile client was sent
        weights_replies = refused = 0
        while hostile.poll(3000):
            h, tensors = decode(hostile.recv_multipart())
            if h.op == Op.ERROR:
                assert h.body["code"] == "limit", h.body
                refused += 1
                continue
            version = h.body["version"]
            want = seen[version]
            for chunk, got in zip(wave.chunks[0], tensors, strict=True):
                assert torch.equal(got, chunk_view(want[chunk.name], chunk)), (
                    f"a reply labelled version {version} carries other weights"
                )
            weights_replies += 1
        assert weights_replies + refused == 18
        assert weights_replies >= 4 and refused >= 1  # the per-client budget of unsent replies
        assert daemons.procs[0].poll() is None
    finally:
        hostile.close(0)
        heart.close()
        wave.close()


@pytest.mark.timeout(60)
def test_silent_waves_are_dropped_on_time_while_the_queue_never_empties(shard_daemons):
    daemons = shard_daemons([*JOB, "--wave-timeout-s", "4"], count=1)
    address = daemons.addresses[0]
    # over TCP (no shared-memory attach after registering), and a wave timeout longer than the
    # gaps a loaded machine puts between the registering requests (over 1 s seen on one core)
    silent = client_for(tiny_model(), daemons.addresses, worker="silent", transport="tcp")
    silent.register(0)  # ...and then says nothing more
    stop = threading.Event()

    def flood():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        stats = [bytes(f) for f in encode(Header(op=Op.STATS))]
        try:
            while not stop.is_set():
                try:
                    sock.send_multipart(stats, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the shard's queue for us is full: it never empties
                while sock.poll(0):
                    sock.recv_multipart()
        finally:
            sock.close(0)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    watcher = RawClient(address)
    try:
        deadline = time.monotonic() + 20
        live = True
        while live and time.monotonic() < deadline:
            time.sleep(0.5)
            live = watcher.request(Header(op=Op.STATS)).body["waves"]["silent/0"]["live"]
        assert not live, "the silent wave was not dropped while requests kept coming"
        assert flooder.is_alive()  # still flooding: the drop happened during the flood
    finally:
        stop.set()
        flooder.join(TIMEOUT_S)
        assert not flooder.is_alive()
        watcher.close()
        silent.close()
