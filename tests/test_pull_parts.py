"""Pulling during forward: shards answer in parts, in the model's order, and each layer's forward
waits for its own weights only (ps/datapath.py, worker/rounds.py, worker/pull_hooks.py)."""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
import zmq
from helpers import (
    TIMEOUT_S,
    ServiceWave,
    client_for,
    reply_of,
    run_threads,
    service_for,
    shard_values,
    tiny_model,
)

from wavelet.common.messages import WeightsReply, reply_header
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import ErrorCode, Header, Op, ShardError, decode, encode
from wavelet.worker.pull_hooks import PullDuringForward
from wavelet.worker.rounds import PullParts

pytestmark = pytest.mark.timeout(120)

STEPS = 5
BATCH = 8


def _push_pull(wave: ServiceWave, clock: int, part_bytes: int, read: int = 0) -> list:
    grads = [torch.full((c.numel,), 0.1) for c in wave.chunks]
    return wave.send(
        Op.PUSH_PULL,
        grads,
        clock=clock,
        read_version=read,
        keys=wave.keys,
        body={"part_bytes": part_bytes},
    )


def test_a_shard_answers_in_parts_in_its_order_with_the_weights_of_one_answer(tmp_path):
    service = service_for(tmp_path, job={"optimizer": OptimizerConfig("sgd", lr=0.1)})
    wave = ServiceWave(service)
    wave.join()
    sizes = [c.wire_nbytes for c in wave.chunks]
    assert len(sizes) >= 4
    parts = _push_pull(wave, 0, part_bytes=sizes[0])  # at least one chunk per part
    headers = [reply_of(m) for m in parts]
    assert len(parts) > 1
    assert [h.body["part"] for h in headers] == list(range(len(parts)))
    assert {h.body["parts"] for h in headers} == {len(parts)}
    assert {h.body["version"] for h in headers} == {1}
    # consecutive runs of the shard's chunks, all of them, each of at least part_bytes but the last
    assert [k for h in headers for k in h.keys] == wave.keys
    for m in parts[:-1]:
        assert sum(t.numel() * t.element_size() for t in m.tensors) >= sizes[0]
    # the same tensors as one answer: an observer's pull right after (no update in between)
    (whole,) = wave.send(Op.PULL, clock=0, body={"observer": True})
    got = [t for m in parts for t in m.tensors]
    assert all(torch.equal(a, b) for a, b in zip(got, whole.tensors, strict=True))
    # 0 (the default) is one message
    (one,) = _push_pull(wave, 1, part_bytes=0, read=1)
    assert reply_of(one).body["parts"] == 1 and len(one.tensors) == len(wave.keys)


def test_a_parked_pull_asked_in_parts_is_released_in_parts(tmp_path):
    job = {"optimizer": OptimizerConfig("sgd", lr=0.1), "staleness": 0}
    service = service_for(tmp_path, job=job, expect_waves=2)
    tick, tock = ServiceWave(service, "w0"), ServiceWave(service, "w1")
    tick.join()
    tock.join()
    assert _push_pull(tick, 0, part_bytes=1) == []  # bulk-synchronous: waits for tock
    out = _push_pull(tock, 0, part_bytes=0)
    to_tick = [reply_of(m) for m in out if m.peer == tick.peer]
    assert len(to_tick) == len(tick.keys)  # one part per chunk
    assert [h.keys[0] for h in to_tick] == tick.keys
    assert all(h.body["version"] == 1 and h.body["parked_s"] >= 0 for h in to_tick)
    assert len([m for m in out if m.peer == tock.peer]) == 1


def test_a_negative_part_size_is_refused_and_changes_nothing(tmp_path):
    service = service_for(tmp_path)
    wave = ServiceWave(service)
    wave.join()
    (reply,) = _push_pull(wave, 0, part_bytes=-1)
    h = reply_of(reply)
    assert h.op == Op.ERROR and h.body["code"] == ErrorCode.MALFORMED
    assert "part_bytes" in h.body["message"]
    assert service.shard.version == 0


def test_the_client_refuses_parts_out_of_order_or_of_other_chunks():
    model = tiny_model()
    client = client_for(model, ["tcp://127.0.0.1:9"])  # never contacted
    try:
        keys = [c.key for c in client.chunks[0]]
        values = [torch.zeros(c.numel) for c in client.chunks[0]]

        def part(i: int, of: int, run: slice) -> tuple[Header, list]:
            h = reply_header(1, WeightsReply(3, 0, 0.0, 0, part=i, parts=of))
            h.keys = keys[run]
            return h, values[run]

        parts = PullParts(client)
        with pytest.raises(ShardError, match="part 1 of 2 where part 0 was due"):
            parts.take(0, *part(1, 2, slice(1, None)))
        parts = PullParts(client)
        assert parts.take(0, *part(0, 2, slice(0, 1))) is False
        with pytest.raises(ShardError, match="were due"):  # chunk 0 again, not chunk 1
            parts.take(0, *part(1, 2, slice(0, 1)))
        parts = PullParts(client)
        assert parts.take(0, *part(0, 2, slice(0, 1))) is False
        with pytest.raises(ShardError, match="sent 2 of its"):  # a last part that ends early
            parts.take(0, *part(1, 2, slice(1, 2)))
        parts = PullParts(client)
        assert parts.take(0, *part(0, 2, slice(0, 1))) is False
        assert parts.take(0, *part(1, 2, slice(1, None))) is True
        assert parts.loaded == set(keys) and parts.result().versions == [3]
    finally:
        client.close()


def _batch(wave: int, step: int):
    g = torch.Generator().manual_seed(100 * wave + step)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _train_wave(addresses, wave: int, errors: list, first_waits: list) -> None:
    """STEPS steps, each forward taking the weights of the last push as they come, one part
    per chunk; ``first_waits``: the chunks loaded when the first layer's wait returned."""
    try:
        model = tiny_model()
        c = client_for(model, addresses, f"w{wave}", 0, transport="tcp", placement="layers")
        c.part_bytes = 1  # every chunk a part of its own
        tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
        puller = PullDuringForward(model, tensors, c.chunks)
        seen: list = []  # after the puller's own hook: what the first layer went ahead with

        def note(*_) -> None:  # a pre-hook's return value would replace the layer's input
            if pending is not None:
                seen.append(set(pending.loaded))

        model[1].register_forward_pre_hook(note)
        try:
            c.register(0)
            pulled, pending = c.pull(0), None
            for step in range(STEPS):
                x, y = _batch(wave, step)
                model.zero_grad()
                with puller.during(pending):
                    loss = F.cross_entropy(model(x), y)
                if pending is not None:
                    pulled = pending.result()
                    first_waits.append((seen[-1], sum(len(ch) for ch in c.chunks)))
                assert pulled.versions == [step] * len(addresses)
                push = c.start_push(step, pulled.versions)
                loss.backward()
                pending = push.finish(defer=True)
            assert pending.result().versions == [STEPS] * len(addresses)
            c.leave()
        finally:
            puller.close()
            c.close()
    except BaseException as e:  # surfaced by the test thread
        errors.append(e)


def test_bulk_synchronous_pulling_during_forward_equals_single_process(shard_daemons):
    """Every layer of every forward read the weights of the last update, though the forward
    started with some of them still on the wire (one shard: its parts come in order)."""
    args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
    daemons = shard_daemons(["--staleness", "0", *args], count=1, expect_waves=2)
    errors: list = []
    first_waits: list = []
    threads = [
        threading.Thread(target=_train_wave, args=(daemons.addresses, w, errors, first_waits))
        for w in range(2)
    ]
    run_threads(threads, errors)
    got = shard_values(daemons.addresses, placement="layers")

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(w, step) for w in range(2)), strict=True)
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    want = [t.detach() for t in model.state_dict().values()]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the first layer went ahead with its own two chunks (the first two parts) and the other
    # layers' weights still to come: a wait reads one part at a time, and stops when it may
    assert len(first_waits) == 2 * (STEPS - 1)
    assert all(len(loaded) == 2 and total == 6 for loaded, total in first_waits), first_waits


def test_the_parts_of_one_answer_count_as_one_reply_against_a_slow_reader(shard_daemons):
    """A shard refuses a client a fifth unsent weights reply (ps/server.py); the parts of one
    answer are one reply, however many there are and however slowly the client reads them."""
    daemons = shard_daemons(["--model", "mlp", "--dataset", "synthetic", "--staleness", "inf"])
    # 16 chunks, 8 of 4 MiB: more parts than the shard lets a client leave unread
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))
    seeder = client_for(model, daemons.addresses)
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)  # takes one message in, the rest wait on the shard's side
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.connect(daemons.addresses[0])
    try:
        seeder.register(0)
        fingerprint = seeder.plan.fingerprint
        for rid, op, body in [(1, Op.REGISTER, {}), (2, Op.PULL, {"part_bytes": 1})]:
            h = Header(op=op, request_id=rid, worker="slow", wave=0, clock=0, plan=fingerprint)
            h.body = body
            slow.send_multipart(encode(h))
            if op == Op.REGISTER:
                assert slow.poll(TIMEOUT_S * 1000)
                assert decode(slow.recv_multipart())[0].op == Op.REPLY
        time.sleep(1.0)  # the shard sent every part; most of them wait for this reader
        parts = []
        while len(parts) < 16 and slow.poll(TIMEOUT_S * 1000):
            h, tensors = decode(slow.recv_multipart())
            assert h.op == Op.REPLY, h.body  # not a limit error for the fifth part
            parts.append((h.body["part"], h.body["parts"], h.keys))
        assert [(p, n) for p, n, _ in parts] == [(i, 16) for i in range(16)]
        assert [k for _, _, keys in parts for k in keys] == [c.key for c in seeder.chunks[0]]
    finally:
        slow.close(0)
        seeder.close()
