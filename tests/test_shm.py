"""The shared-memory data path: same results as TCP, never a torn read, bad pushes refused from
the segment, private segments that are always cleaned up, and TCP where segments cannot open."""

import signal
import stat
import threading

import pytest
import torch
from conftest import run_wavelet
from helpers import RawClient, client_for, push_header, shard_values, tiny_model

from wavelet.common import shm
from wavelet.common.messages import PushRequest
from wavelet.common.protocol import Header, Op, RemoteError, ShardError
from wavelet.worker.wave_memory import WaveMemory

JOB = ["--model", "mlp", "--dataset", "synthetic", "--staleness", "inf"]


def _segments(prefix: str = "wavelet-") -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(prefix + "*"))


def _wave_segments(prefix: str) -> list[str]:
    """The waves' own segments, not the shard's weight slots (ps/weight_slots.py)."""
    return [n for n in _segments(prefix) if not n.startswith(prefix + "s0-w-")]


def _prefix(daemons) -> str:
    return shm.run_prefix(daemons.tmp)


def _step(model, client, pulled, clock, value):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return client.push_pull(clock, pulled.versions)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("wave_memory", [True, False], ids=["into-wave-memory", "from-slots"])
def test_concurrent_waves_never_read_torn_weights(shard_daemons, monkeypatch, wave_memory):
    """Two waves push as fast as they can while a third only reads: whoever read version v
    got the same weights, whole: written by the shard into the wave's own parameters
    (worker/wave_memory.py), or, for a wave that offers none, read in place from the shard's
    weight slots or copied."""
    if not wave_memory:
        monkeypatch.setattr(WaveMemory, "fits", staticmethod(lambda tensors, chunks: False))
    daemons = shard_daemons(JOB, count=1)
    seen: list[dict] = [{}, {}, {}]
    errors = []
    writing = threading.Event()

    def wave(i):
        try:
            model = tiny_model(hidden=512)
            c = client_for(model, daemons.addresses, worker=f"w{i}", transport="shm")
            try:
                # a wave that registers after another pushed joins at the slowest live
                # wave's clock, which may be past 0: push from the clock it was given
                first = max(c.register(0))
                pulled = c.pull(first)
                for clock in range(first, first + 60):
                    if i == 2:  # the reader: reads at its first clock (s = inf lets it)
                        if clock > first and not writing.is_set():
                            break
                        pulled = c.pull(first)
                    else:
                        pulled = _step(model, c, pulled, clock, 0.001 * (i + 1))
                    seen[i][pulled.versions[0]] = [p.detach().clone() for p in model.parameters()]
            finally:
                c.close()
        except BaseException as e:
            errors.append(e)

    writing.set()
    threads = [threading.Thread(target=wave, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(60)
        assert not t.is_alive()
    writing.clear()
    threads[2].join(60)
    assert not threads[2].is_alive()
    assert not errors, errors
    compared = 0
    for v, weights in seen[2].items():
        for writer in seen[:2]:
            if v in writer:
                compared += 1
                for a, b in zip(weights, writer[v], strict=True):
                    assert torch.equal(a, b), f"two reads of version {v} differ"
    assert compared >= 5, "the reader and the writers shared too few versions to compare"
    stats = RawClient(daemons.addresses[0])
    try:
        reads = stats.request(Header(op=Op.STATS)).body["shm_reads"]
    finally:
        stats.close()
    if wave_memory:  # every pull went straight into the pulling wave's parameters
        assert reads["into_wave"] > 0 and reads["in_place"] == reads["copied"] == 0, reads
    else:  # the weights were read where the shard keeps them
        assert reads["in_place"] > 0 and reads["into_wave"] == 0, reads


def test_a_bad_push_through_the_segment_changes_nothing(shard_daemons):
    daemons = shard_daemons(JOB, count=1)
    model = tiny_model()
    c = client_for(model, daemons.addresses, transport="shm")
    try:
        c.register(0)
        pulled = c.pull(0)
        before = shard_values(daemons.addresses)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        link = c.data.links[0]
        keys = [ch.key for ch in c.chunks[0]]
        for bad in (float("nan"), float("inf")):
            for view in link.push_views:
                view.zero_()
            link.push_views[-1][0] = bad
            h = c._header(Op.PUSH, PushRequest(shm=True), clock=0, read_version=0, keys=keys)
            with pytest.raises(RemoteError, match="NaN or Inf"):
                c._request_one(0, h)
        # frames and a segment at once, a wave without segments: refused too
        h = c._header(Op.PUSH, PushRequest(shm=True), clock=0, read_version=0, keys=keys)
        with pytest.raises(RemoteError, match="no tensor frames"):
            c._request_one(0, h, [torch.zeros(ch.numel) for ch in c.chunks[0]])
        stranger = RawClient(daemons.addresses[0])
        try:
            reply = stranger.request(
                Header(op=Op.REGISTER, worker="x", wave=0, plan=c.plan.fingerprint, clock=0)
            )
            assert reply.op == "reply"
            push = push_header(c.plan.fingerprint, c.chunks[0], "x", body={"shm": True})
            reply = stranger.request(push)
            assert reply.op == "error" and reply.body["code"] == "not_attached"
        finally:
            stranger.close()
        after = shard_values(daemons.addresses)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        pulled = _step(model, c, pulled, 0, 0.5)  # and a good one goes through
        assert pulled.versions == [1]
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_segments_are_private_and_removed_on_stop_and_after_a_kill(shard_daemons, tmp_path):
    daemons = shard_daemons(JOB, count=1)
    prefix = _prefix(daemons)
    model = tiny_model()
    c = client_for(model, daemons.addresses, transport="shm")
    try:
        c.register(0)
        names = _segments(prefix)
        # one push and one pull segment for the wave, and the shard's 3 weight slots
        assert len(_wave_segments(prefix)) == 2 and len(names) == 5
        for name in names:
            mode = (shm.SHM_DIR / name).stat().st_mode
            assert stat.S_IMODE(mode) == 0o600
            assert len(name) >= len(prefix) + 20  # an unguessable part
        c.leave()  # a wave that is done frees its segments; the slots are the shard's memory
        assert _wave_segments(prefix) == [] and len(_segments(prefix)) == 3
        c.register(0)
        assert len(_segments(prefix)) == 5
    finally:
        c.close()
    # kill -9: the segments stay behind...
    daemons.procs[0].send_signal(signal.SIGKILL)
    daemons.procs[0].wait(10)
    assert len(_segments(prefix)) == 5
    # ...until a shard of the same run dir starts, and that one removes its own on SIGTERM
    with daemons.restarted(0, tmp_path / "restarted.log") as proc:
        c = client_for(model, daemons.addresses, transport="shm")
        try:
            c.register(0)
            assert len(_segments(prefix)) == 5  # the new wave's and slots, the stale ones gone
        finally:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert _segments(prefix) == []


def test_a_client_that_cannot_open_the_segments_stays_on_tcp(shard_daemons, tmp_path, monkeypatch):
    daemons = shard_daemons(JOB, count=1)
    prefix = _prefix(daemons)
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "elsewhere")  # as if on another host
    model = tiny_model()
    c = client_for(model, daemons.addresses, transport="auto")
    try:
        c.register(0)
        assert c.transports == ["tcp"]
        pulled = c.pull(0)
        pulled = _step(model, c, pulled, 0, 0.1)
        assert pulled.versions == [1]
        stats = RawClient(daemons.addresses[0])
        try:
            waves = stats.request(Header(op=Op.STATS)).body["waves"]
            assert waves["w0/0"]["transport"] == "tcp"
        finally:
            stats.close()
        monkeypatch.undo()
        assert _wave_segments(prefix) == []  # the shard dropped the segments it had offered
    finally:
        c.close()
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "elsewhere")
    strict = client_for(tiny_model(), daemons.addresses, worker="strict", transport="shm")
    try:
        with pytest.raises(ShardError, match="--transport shm"):
            strict.register(0)
    finally:
        strict.close()


def test_a_shard_without_shared_memory_serves_tcp(shard_daemons):
    daemons = shard_daemons([*JOB, "--no-shm"], count=1)
    c = client_for(tiny_model(), daemons.addresses, transport="auto")
    try:
        c.register(0)
        assert c.transports == ["tcp"]
    finally:
        c.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_wave_moves_tensors_through_pinned_segments(shard_daemons):
    daemons = shard_daemons(JOB, count=2)
    model = tiny_model().cuda()
    c = client_for(model, daemons.addresses, transport="shm")
    try:
        c.register(0)
        assert c.transports == ["shm", "shm"]
        pulled = c.pull(0)
        for clock in range(3):
            pulled = _step(model, c, pulled, clock, 0.01)
        torch.cuda.synchronize()
        on_shards = shard_values(daemons.addresses)  # read over TCP into a CPU model
        on_gpu = [t.detach().cpu() for t in model.state_dict().values()]
        assert pulled.versions == [3, 3]
        for a, b in zip(on_gpu, on_shards, strict=True):
            assert torch.equal(a, b)
    finally:
        c.close()


EMPTY_TENSORS = """
import torch
from torch import nn


class WithEmpty(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = nn.Linear(64, num_classes)
        self.nothing = nn.Parameter(torch.empty(0))  # a size-0 parameter and buffer
        self.register_buffer("none", torch.empty(0, 3))

    def forward(self, x):
        return self.linear(x.flatten(1)) + self.nothing.sum()


def with_empty(input_shape, num_classes):
    return WithEmpty(input_shape, num_classes)
"""


def test_an_empty_tensor_has_a_place_in_a_segment():
    segment = shm.Segment.create("wavelet-test-empty-", 64)
    try:
        assert segment.tensor(64, 0, torch.float32).shape == (0,)
    finally:
        segment.close()


@pytest.mark.timeout(150)
def test_a_model_with_empty_tensors_trains_through_shared_memory(tmp_path):
    (tmp_path / "empties.py").write_text(EMPTY_TENSORS)
    done = run_wavelet(
        "launch", "--model", "empties:with_empty", "--transport", "shm", "--epochs", "1",
        "--threads", "1", "--run-dir", "run", timeout=140, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shm" in done.stdout  # the waves' tensors went through the segments
