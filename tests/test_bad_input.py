"""Every kind of bad request against a real shard daemon: an error reply naming the problem,
the shard keeps serving, and its parameters are unchanged."""

import pytest
import torch
from helpers import RawClient, client_for, push_header, shard_values, tiny_model

from wavelet.common.protocol import Header, Op

JOB = ["--model", "mlp", "--dataset", "synthetic", "--staleness", "inf"]


@pytest.fixture
def shard(shard_daemons):
    daemons = shard_daemons(JOB, count=1)
    model = tiny_model()
    c = client_for(model, daemons.addresses, worker="seed")  # seeds the shard's weights
    c.register(0)
    raw = RawClient(daemons.addresses[0])
    # the bad pushes below name wave w0/0, registered on the raw client's own connection
    joined = raw.request(Header(op=Op.REGISTER, worker="w0", wave=0, plan=c.plan.fingerprint))
    assert joined.op == "reply", joined.body
    yield daemons, c, raw
    raw.close()
    c.close()


def _push(c, **over) -> tuple[Header, list[torch.Tensor]]:
    chunks = c.chunks[0]
    h = push_header(over.pop("plan", c.plan.fingerprint), chunks, **over)
    return h, [torch.full((ch.numel,), 0.5) for ch in chunks]


REFUSED = []  # every refusal _expect_error saw, to check the shard counted each one


def _expect_error(h: Header, code: str, words: str = ""):
    REFUSED.append(code)
    assert h.op == "error", h
    assert h.body["code"] == code, h.body
    assert words.lower() in h.body["message"].lower(), h.body


def test_every_bad_request_is_refused_and_changes_nothing(shard):
    daemons, c, raw = shard
    REFUSED.clear()
    before = shard_values(daemons.addresses)
    good_header, good = _push(c)

    # not msgpack at all, and an empty frame
    _expect_error(raw.send_frames([b"\xc1\xc1\xc1"]), "malformed")
    _expect_error(raw.send_frames([b""]), "malformed")
    # unknown op, wrong protocol version
    _expect_error(raw.send_frames([raw.raw_header(op="explode")]), "unknown_op", "explode")
    _expect_error(raw.send_frames([raw.raw_header(v=0)]), "bad_protocol_version")
    # header promises more tensors than frames follow
    frames = [raw.raw_header(op="push", tensors=[["float32", [3]], ["float32", [3]]]), b"\x00" * 12]
    _expect_error(raw.send_frames(frames), "malformed", "2 tensors")
    # unknown key, wrong shape, wrong dtype
    h, ts = _push(c, keys=[999] + good_header.keys[1:])
    _expect_error(raw.request(h, ts), "unknown_key", "999")
    h, ts = _push(c)
    ts[0] = torch.zeros(ts[0].numel() + 1)
    _expect_error(raw.request(h, ts), "bad_shape")
    h, ts = _push(c)
    ts[0] = ts[0].double()
    _expect_error(raw.request(h, ts), "bad_dtype")
    # a frame whose size does not match its descriptor
    frames = [raw.raw_header(op="push", tensors=[["float32", [3]]]), b"\x00" * 15]
    _expect_error(raw.send_frames(frames), "bad_shape", "15 bytes")
    # NaN and Inf gradients
    for bad in (float("nan"), float("inf")):
        h, ts = _push(c)
        ts[-1][0] = bad
        _expect_error(raw.request(h, ts), "non_finite")
    # a version from the future, a plan that is not the shard's, an unregistered wave
    h, ts = _push(c, read_version=5)
    _expect_error(raw.request(h, ts), "future_version")
    h, ts = _push(c, plan="0123456789abcdef")
    refused = raw.request(h, ts)
    _expect_error(refused, "plan_mismatch", "plan differs")
    assert c.plan.fingerprint not in refused.body["message"]  # the registration secret stays
    h, ts = _push(c, worker="nobody")
    _expect_error(raw.request(h, ts), "not_registered")
    # pushes for the wrong clock
    h, ts = _push(c, clock=3)
    _expect_error(raw.request(h, ts), "stale_clock")
    # a push with the right keys in the wrong order does not match the plan
    h, ts = _push(c, keys=list(reversed(good_header.keys)))
    _expect_error(raw.request(h, ts), "plan_mismatch")

    after = shard_values(daemons.addresses)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert daemons.procs[0].poll() is None, "shard died"

    # ...and it still serves a correct push, which does change the parameters
    reply = raw.request(good_header, good)
    assert reply.op == "reply" and reply.body["version"] == 1
    changed = shard_values(daemons.addresses)
    assert not all(torch.equal(a, b) for a, b in zip(before, changed, strict=True))
    stats = raw.request(Header(op=Op.STATS))
    assert len(REFUSED) == 16
    assert stats.body["rejected"] == len(REFUSED)


def test_a_bad_init_does_not_seed_the_shard(shard_daemons):
    daemons = shard_daemons(JOB, count=1)
    raw = RawClient(daemons.addresses[0])
    try:
        h = Header(
            op=Op.INIT, worker="w0", wave=0, plan="p", keys=[0, 1], body={"trainable": [True]}
        )
        _expect_error(raw.request(h, [torch.zeros(3), torch.zeros(2)]), "malformed")
        h = Header(op=Op.INIT, worker="w0", wave=0, plan="p", keys=[0], body={"trainable": [True]})
        _expect_error(raw.request(h, [torch.zeros(3, dtype=torch.int64)]), "bad_dtype")
        # nothing was seeded: a pull is refused as not initialised, not served garbage
        h = Header(op=Op.PULL, plan="p", body={"observer": True})
        _expect_error(raw.request(h), "not_initialized")
    finally:
        raw.close()
