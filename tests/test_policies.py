"""Stale-gradient policies against a NumPy reference, through a live shard daemon."""

import json

import numpy as np
import pytest
import torch
from conftest import run_wavelet
from helpers import client_for, shard_values, tiny_model

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


@pytest.mark.parametrize("policy", ["apply", "scale", "drop", "dc-asgd"])
def test_policy_update_matches_numpy(shard_daemons, policy):
    daemons, (a, am), (b, bm) = _two_waves(shard_daemons, policy, ["--set", "drop_limit=0"])
    try:
        w0 = _params(shard_values(daemons.addresses))
        ra, rb = a.pull(0), b.pull(0)  # both read version 0
        gb = _set_grads(bm, 1)
        b.push_pull(0, rb.versions)  # tau 0: applied as is by every policy
        w1 = _params(shard_values(daemons.addresses))
        for w, g, x in zip(w0, gb, w1, strict=True):
            np.testing.assert_allclose(x, w - LR * g, atol=1e-6)
        ga = _set_grads(am, 2)
        reply = a.push_pull(0, ra.versions)  # read version 0, shard is at 1: tau 1
        w2 = _params(shard_values(daemons.addresses))
        for w_read, w_now, g, got in zip(w0, w1, ga, w2, strict=True):
            if policy == "apply":
                want = w_now - LR * g
            elif policy == "scale":
                want = w_now - LR / (1 + 1) * g
            elif policy == "drop":  # limit 0 < tau 1: dropped, nothing changes
                want = w_now
            else:
                want = w_now - LR * (g + LAM * g * g * (w_now - w_read))
            np.testing.assert_allclose(got, want, atol=1e-6)
        assert reply.dropped == (1 if policy == "drop" else 0)
    finally:
        a.close(), b.close()


def test_drop_never_applies_a_gradient_over_the_limit(shard_daemons):
    daemons, (a, am), (b, bm) = _two_waves(shard_daemons, "drop", ["--set", "drop_limit=1"])
    try:
        ra, rb = a.pull(0), b.pull(0)
        for clock in range(12):  # b pushes 3 times for each push of a: a's gradients go stale
            for k in range(3):
                _set_grads(bm, 100 + 3 * clock + k)
                rb = b.push_pull(3 * clock + k, rb.versions)
            _set_grads(am, clock)
            before = _params(shard_values(daemons.addresses))
            ra = a.push_pull(clock, ra.versions)
            after = _params(shard_values(daemons.addresses))
            # a read the weights right after its previous push, so 3 updates came in between
            assert ra.dropped == 1
            assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    finally:
        a.close(), b.close()
    pushes = [
        json.loads(line)
        for line in (daemons.tmp / "records" / "ps-0-pushes.jsonl").read_text().splitlines()
    ]
    for p in pushes:
        assert (p["action"] == "dropped") == (p["staleness"] > 1), p
    assert sum(p["action"] == "dropped" for p in pushes) == 12


def test_scale_with_no_staleness_equals_apply(shard_daemons):
    results = {}
    for policy in ("apply", "scale"):
        daemons, (a, am), (b, _) = _two_waves(shard_daemons, policy)
        try:
            r = a.pull(0)
            for clock in range(3):
                _set_grads(am, clock)
                r = a.push_pull(clock, r.versions)  # alone: every gradient is fresh
            results[policy] = _params(shard_values(daemons.addresses))
        finally:
            a.close()
            b.close()
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
