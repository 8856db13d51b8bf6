import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import run_benchmark

from wavelet.common.protocol import (
    PACK_ALIGN,
    PACK_BELOW,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Op,
    ProtocolError,
    TensorDesc,
    decode,
    encode,
    send_message,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (1, 1, 1, 9)]


def _sample(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_in_memory(dtype):
    tensors = [_sample(dtype, s) for s in SHAPES]
    h = Header(
        op=Op.PUSH,
        request_id=7,
        worker="w0",
        wave=1,
        clock=3,
        read_version=2,
        plan="abc",
        keys=list(range(len(tensors))),
        body={"x": [1, 2]},
    )
    frames = encode(h, tensors)
    h2, out = decode([bytearray(f) for f in frames])
    assert (h2.op, h2.request_id, h2.worker, h2.wave, h2.clock, h2.read_version, h2.plan) == (
        "push",
        7,
        "w0",
        1,
        3,
        2,
        "abc",
    )
    assert h2.body == {"x": [1, 2]}
    for a, b in zip(tensors, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def pair():
    """Two PAIR sockets joined over loopback TCP: (sender, receiver)."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    yield a, b
    a.close(0), b.close(0), ctx.term()


def test_round_trip_over_zmq_is_zero_copy_on_receive(pair):
    a, b = pair
    tensors = [_sample(d, (64, 33)) for d in DTYPES] + [torch.randn(300_000)]
    send_message(a, Header(op=Op.PUSH), tensors)
    assert b.poll(5000), "no message within 5 s"
    frames = b.recv_multipart(copy=False)
    h, out = decode(frames)
    assert [TensorDesc.of(t) for t in tensors] == h.tensors
    for x, y in zip(tensors, out, strict=True):
        assert torch.equal(x, y)
    # the big tensor aliases the received frame's memory (no copy was made)
    assert out[-1].data_ptr() == np.frombuffer(frames[-1].buffer, np.uint8).ctypes.data


def _mixed():
    """Small tensors of several dtypes (packed) between two over PACK_BELOW (a frame each)."""
    big = PACK_BELOW // 4 + 1  # float32 values: one byte past the bound
    return [
        _sample(torch.bfloat16, (3, 5)),
        torch.randn(big),
        _sample(torch.int64, (7,)),
        _sample(torch.bool, ()),
        _sample(torch.float32, (0,)),
        torch.randn(2, big),
        _sample(torch.float16, (9,)),
    ]


def test_small_tensors_travel_in_one_pack_and_large_ones_in_frames_of_their_own():
    tensors = _mixed()
    frames = encode(Header(op=Op.PUSH), tensors)
    assert len(frames) == 1 + 1 + 2  # header, the pack, the two large tensors
    h, out = decode([bytearray(f) for f in frames])
    assert h.pack_below == PACK_BELOW
    for a, b in zip(tensors, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # with pack_below 0 every tensor has its frame, as before protocol 8
    frames = encode(Header(op=Op.PUSH), tensors, pack_below=0)
    assert len(frames) == 1 + len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, decode(frames)[1], strict=True))


def test_packed_tensors_are_aligned_views_of_the_received_pack(pair):
    a, b = pair
    tensors = _mixed()
    send_message(a, Header(op=Op.PUSH), tensors)
    assert b.poll(5000), "no message within 5 s"
    frames = b.recv_multipart(copy=False)
    _, out = decode(frames)
    pack = np.frombuffer(frames[1].buffer, np.uint8).ctypes.data
    for i in (0, 2, 3, 6):  # the packed ones (the empty tensor has no memory to share)
        offset = out[i].data_ptr() - pack
        assert 0 <= offset < len(frames[1]) and offset % PACK_ALIGN == 0
        assert torch.equal(out[i], tensors[i])


def test_a_packed_tensor_may_change_once_sent_and_the_message_keeps_its_value(pair):
    # packing copies: a sender may write a small tensor again at once (a large one it may not
    # before the tracker says ZeroMQ let go of it)
    a, b = pair
    small = torch.arange(10.0)
    tracker = send_message(a, Header(op=Op.PUSH), [small], track=True)
    small.fill_(-1.0)
    assert b.poll(5000), "no message within 5 s"
    _, (got,) = decode(b.recv_multipart(copy=False))
    assert torch.equal(got, torch.arange(10.0))
    tracker.wait(5)  # a message of small tensors only is still tracked: it has left
    assert tracker.done


def _header_dict(**over):
    d = {
        "v": PROTOCOL_VERSION,
        "op": "pull",
        "rid": 1,
        "worker": "w",
        "wave": 0,
        "clock": 0,
        "read": -1,
        "plan": "",
        "keys": [],
        "tensors": [],
        "body": {},
    }
    d.update(over)
    return d


@pytest.mark.parametrize(
    "raw,code",
    [
        (b"\xc1\xff garbage", ErrorCode.MALFORMED),
        (msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(v=99)), ErrorCode.BAD_PROTOCOL_VERSION),
        (msgpack.packb({"op": "pull"}), ErrorCode.BAD_PROTOCOL_VERSION),
        (msgpack.packb(_header_dict(rid="one")), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(wave=True)), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(tensors=[["float99", [3]]])), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(tensors=[["float32", [-3]]])), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(keys=["a"])), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(pack=-1)), ErrorCode.MALFORMED),
        (msgpack.packb(_header_dict(pack="64")), ErrorCode.MALFORMED),
    ],
)
def test_bad_headers_are_refused_with_a_code(raw, code):
    with pytest.raises(ProtocolError) as e:
        decode([raw])
    assert e.value.code == code


def test_a_descriptor_seen_before_is_looked_up_and_its_look_alikes_still_refused():
    raw = msgpack.packb(_header_dict(tensors=[["float32", [1, 3]]]))
    first, again = Header.unpack(raw), Header.unpack(raw)
    assert first.tensors[0] is again.tensors[0]
    assert again.tensors[0] == TensorDesc("float32", (1, 3))
    # equal to (1, 3) and hashed alike, but not dimensions
    for dims in ([True, 3], [1.0, 3]):
        with pytest.raises(ProtocolError) as e:
            Header.unpack(msgpack.packb(_header_dict(tensors=[["float32", dims]])))
        assert e.value.code == ErrorCode.MALFORMED


def test_frame_count_and_size_must_match_the_header():
    frames = encode(Header(op=Op.PUSH), [torch.zeros(4)])
    with pytest.raises(ProtocolError) as e:
        decode([frames[0]])
    assert e.value.code == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError) as e:
        decode([frames[0], bytearray(15)])
    assert e.value.code == ErrorCode.BAD_SHAPE
    # packed: the pack must be there, once, and hold exactly the layout's bytes
    frames = encode(Header(op=Op.PUSH), _mixed())
    for wrong in ([frames[0], *frames[2:]], [*frames, frames[1]]):
        with pytest.raises(ProtocolError) as e:
            decode(wrong)
        assert e.value.code == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError) as e:
        decode([frames[0], bytes(frames[1])[:-1], *frames[2:]])
    assert e.value.code == ErrorCode.BAD_SHAPE


def test_no_pickle_anywhere():
    # msgpack cannot carry arbitrary objects: encoding one fails instead of pickling it
    with pytest.raises(TypeError):
        Header(op=Op.PUSH, body={"obj": object()}).pack()


def test_the_frames_benchmark_runs():
    out = run_benchmark(
        "bench_frames.py", "--rounds", "1", "--messages", "3", "--width", "4", timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for message in ("push (untracked)", "weights reply (tracked)"):
        for way in ("a frame per tensor", "small tensors packed"):
            assert f"| {message} | {way} |" in out.stdout, out.stdout
