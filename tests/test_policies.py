"""Stale-gradient policies against a NumPy reference: the rules in-process on a ShardService,
and what `wavelet stats` shows of them through a live shard daemon."""

import json

import numpy as np
import pytest
import torch
from conftest import run_wavelet
from helpers import (
    ServiceWave,
    client_for,
    push_header,
    reply_of,
    service_for,
    tiny_model,
)

from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import Op, encode

LR = 0.1
LAM = 0.5


def _two_waves(shard_daemons, policy, extra=()):
    daemons = shard_daemons(
        [
            "--staleness",
            "inf",
            "--lr",
            str(LR),
            "--set",
            "optimizer.kwargs.momentum=0",
            "--stale-policy",
            policy,
            "--set",
            f"dc_lambda={LAM}",
            *extra,
        ],
        count=1,
    )
    a_model, b_model = tiny_model(), tiny_model()
    a = client_for(a_model, daemons.addresses, worker="a")
    b = client_for(b_model, daemons.addresses, worker="b")
    a.register(0)
    b.register(0)
    return daemons, (a, a_model), (b, b_model)


def _set_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    grads = []
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
        grads.append(p.grad.numpy().copy())
    return grads


def _params(values):
    return [v.numpy().copy() for v in values]


def _service(tmp_path, policy, drop_limit=0):
    """An in-process shard with two waves a and b registered (both at version 0)."""
    job = dict(
        optimizer=OptimizerConfig(lr=LR, kwargs={"momentum": 0}),
        stale_policy=policy,
        dc_lambda=LAM,
        drop_limit=drop_limit,
    )
    service = service_for(tmp_path, job=job, expect_waves=2, shm=False)
    a, b = ServiceWave(service, worker="a"), ServiceWave(service, worker="b")
    a.join(), b.join()
    return service, a, b


def _grads(wave, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.numel, generator=g) for c in wave.chunks]


def _push(wave, clock, read, grads):
    """Push ``grads`` for ``clock`` having read version ``read``; the push's action."""
    h = push_header(wave.plan.fingerprint, wave.chunks, wave.worker, clock=clock, read_version=read)
    reply = reply_of(wave.service.handle(wave.peer, [bytes(f) for f in encode(h, grads)])[0])
    assert reply.op == "reply", reply.body
    return reply.body["action"]


def _weights(service):
    return [v.numpy().copy() for v in service.shard.values()]


@pytest.mark.parametrize("policy", ["apply", "scale", "drop", "dc-asgd"])
def test_policy_update_matches_numpy(tmp_path, policy):
    service, a, b = _service(tmp_path, policy)
    try:
        w0 = _weights(service)
        for wave in (a, b):  # both read version 0
            assert wave.request(Op.PULL, clock=0).body["version"] == 0
        gb = _grads(b, 1)
        _push(b, 0, 0, gb)  # tau 0: applied as is by every policy
        w1 = _weights(service)
        for w, g, x in zip(w0, gb, w1, strict=True):
            np.testing.assert_allclose(x, w - LR * g.numpy(), atol=1e-6)
        ga = _grads(a, 2)
        action = _push(a, 0, 0, ga)  # read version 0, shard is at 1: tau 1
        w2 = _weights(service)
        for w_read, w_now, g, got in zip(w0, w1, ga, w2, strict=True):
            g = g.numpy()
            if policy == "apply":
                want = w_now - LR * g
            elif policy == "scale":
                want = w_now - LR / (1 + 1) * g
            elif policy == "drop":  # limit 0 < tau 1: dropped, nothing changes
                want = w_now
            else:
                want = w_now - LR * (g + LAM * g * g * (w_now - w_read))
            np.testing.assert_allclose(got, want, atol=1e-6)
        assert (action == "dropped") == (policy == "drop")
    finally:
        service.close()


def test_drop_never_applies_a_gradient_over_the_limit(tmp_path):
    service, a, b = _service(tmp_path, "drop", drop_limit=1)
    try:
        read_a = read_b = 0
        for clock in range(12):  # b pushes 3 times for each push of a: a's gradients go stale
            for k in range(3):
                _push(b, 3 * clock + k, read_b, _grads(b, 100 + 3 * clock + k))
                read_b = service.shard.version
            before = _weights(service)
            # a read the weights right after its previous push, so 3 updates came in between
            assert _push(a, clock, read_a, _grads(a, clock)) == "dropped"
            assert all(np.array_equal(x, y) for x, y in zip(before, _weights(service), strict=True))
            read_a = service.shard.version
    finally:
        service.close()
    pushes = [
        json.loads(line)
        for line in (tmp_path / "records" / "ps-0-pushes.jsonl").read_text().splitlines()
    ]
    for p in pushes:
        assert (p["action"] == "dropped") == (p["staleness"] > 1), p
    assert sum(p["action"] == "dropped" for p in pushes) == 12


def test_scale_with_no_staleness_equals_apply(tmp_path):
    results = {}
    for policy in ("apply", "scale"):
        service, a, _ = _service(tmp_path / policy, policy)
        try:
            for clock in range(3):  # alone: every gradient is fresh
                _push(a, clock, service.shard.version, _grads(a, clock))
            results[policy] = _weights(service)
        finally:
            service.close()
    for x, y in zip(results["apply"], results["scale"], strict=True):
        assert np.array_equal(x, y)


def test_wavelet_stats_shows_each_wave(shard_daemons):

    daemons, (a, am), (b, bm) = _two_waves(shard_daemons, "drop", ["--set", "drop_limit=0"])
    try:
        ra, rb = a.pull(0), b.pull(0)
        _set_grads(bm, 1)
        b.push_pull(0, rb.versions)
        _set_grads(am, 2)
        a.push_pull(0, ra.versions)  # stale by one: dropped
        done = run_wavelet("stats", *daemons.addresses, timeout=60)
    finally:
        a.close(), b.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "version 1" in lines[0] and "staleness bound inf" in lines[0]
    header = lines[1].split()
    rows = {ln.split()[0]: dict(zip(header, ln.split(), strict=False)) for ln in lines[2:]}
    assert rows["a/0"]["dropped"] == "1" and rows["b/0"]["dropped"] == "0"
    assert rows["a/0"]["read"] == "1" and rows["a/0"]["clock"] == "1"
