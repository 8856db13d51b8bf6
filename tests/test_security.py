"""CURVE: shards accept only the clients whose public keys they were given."""

import json
import time

import pytest
import torch
import zmq
from conftest import run_wavelet
from helpers import TIMEOUT_S, RawClient, client_for, tiny_model

from wavelet.common.protocol import ShardTimeout
from wavelet.common.security import ClientKeys, JobKeys, check_bind, generate_keys, is_loopback
from wavelet.common.settings import ConfigError
from wavelet.worker.client import PSClient


@pytest.fixture
def secure_shard(shard_daemons, tmp_path):
    keys = JobKeys.create(tmp_path / "keys", ["good"])
    generate_keys(tmp_path / "strangers", "stranger")
    daemons = shard_daemons(
        [
            "--staleness",
            "inf",
            "--curve-secret",
            str(keys.server_secret),
            "--curve-authorized",
            str(keys.authorized),
        ],
        count=1,
    )
    return daemons, keys, tmp_path


def _client(model, daemons, keys, timeout_s=3.0):
    c = client_for(model, daemons.addresses, worker="x", timeout_s=timeout_s)
    # rebuild with keys (client_for makes plain clients)
    c.close()
    return PSClient(daemons.addresses, c.plan, c.tensors, "x", 0, timeout_s, keys=keys)


def test_only_authorized_clients_get_in(secure_shard):
    daemons, keys, tmp = secure_shard
    model = tiny_model()
    good = _client(model, daemons, keys.client("good"), timeout_s=20)
    try:
        good.register(0)
        before = good.pull(0)
        weights = [t.clone() for t in model.state_dict().values()]
        stranger_keys = ClientKeys.load(
            str(tmp / "strangers" / "stranger.key_secret"), str(keys.server_public)
        )
        for intruder_keys in (stranger_keys, None):
            intruder = _client(tiny_model(seed=1), daemons, intruder_keys)
            try:
                with pytest.raises(ShardTimeout):
                    intruder.register(0)
                for p in intruder.tensors.values():
                    if p.requires_grad:
                        p.grad = torch.full_like(p, 100.0)
                with pytest.raises(ShardTimeout):
                    intruder.push_pull(0, [0])
            finally:
                intruder.close()
        # a plain, unencrypted request gets nothing either
        raw = RawClient(daemons.addresses[0])
        try:
            # Never a blocking send: after the shard refuses the handshake the connection is torn
            # down until ZeroMQ reconnects, and a DEALER with no connection blocks a send forever
            # (a run pinned to one core hung here). Either way nothing may come back.
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    raw.sock.send_multipart([b"\x80"], zmq.NOBLOCK)
                    break
                except zmq.Again:
                    time.sleep(0.1)
            assert not raw.sock.poll(1000)
        finally:
            raw.close()
        # and the parameters are as they were
        after = good.pull(0, observer=True)
        assert after.versions == before.versions
        for a, b in zip(weights, model.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    finally:
        good.close()


def test_binding_beyond_loopback_needs_keys_or_insecure():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://localhost:1")
    assert is_loopback("ipc:///tmp/x") and not is_loopback("tcp://0.0.0.0:5555")
    check_bind("tcp://127.0.0.1:0", secure=False, insecure=False)
    check_bind("tcp://0.0.0.0:0", secure=True, insecure=False)
    check_bind("tcp://0.0.0.0:0", secure=False, insecure=True)
    with pytest.raises(ConfigError, match="--insecure"):
        check_bind("tcp://0.0.0.0:0", secure=False, insecure=False)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_with_curve_trains_through_encrypted_links(tmp_path):
    run_dir = tmp_path / "run"
    done = run_wavelet("launch", "--curve", "--epochs", "2", "--run-dir", str(run_dir), timeout=170)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["samples"] > 0
    assert (run_dir / "keys" / "server" / "server.key_secret").exists()
    assert sorted(p.name for p in (run_dir / "keys" / "authorized").iterdir()) == [
        "launcher.key",
        "worker-0.key",
    ]
    assert json.loads((run_dir / "launch.json").read_text())["curve"] is True
