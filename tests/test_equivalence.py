"""With staleness bound 0, W waves through the PS equal one process on the concatenated batches,
with the waves' tensors moving over both transports in one job (even waves through shared
memory, odd ones over TCP)."""

import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import client_for, shard_values, tiny_model

from wavelet.common.step import load_step

STEPS = 6
BATCH = 8


def _batch(wave: int, step: int, regression: bool = False):
    g = torch.Generator().manual_seed(100 * wave + step)
    x = torch.randn(BATCH, 4, generator=g)
    if regression:  # float targets for the model's 3 outputs
        return x, torch.randn(BATCH, 3, generator=g)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def _train_wave(addresses, wave: int, errors: list, step_name: str = "classification"):
    try:
        model = tiny_model()
        step_fn = load_step(step_name)
        transport = "tcp" if wave % 2 else "shm"
        c = client_for(model, addresses, worker=f"w{wave}", wave=0, transport=transport)
        try:
            c.register(0)
            assert c.transports == [transport] * len(addresses)
            pulled = c.pull(0)
            for step in range(STEPS):
                x, y = _batch(wave, step, step_name != "classification")
                model.zero_grad()
                step_fn(model, (x, y))[0].backward()
                pulled = c.push_pull(step, pulled.versions)
                assert pulled.versions == [step + 1] * len(addresses)
            c.leave()
        finally:
            c.close()
    except BaseException as e:  # surfaced by the test thread
        errors.append(e)


def _reference(waves: int, make_opt, step_name: str = "classification"):
    model = tiny_model()
    opt = make_opt(model.parameters())
    regression = step_name != "classification"
    for step in range(STEPS):
        xs, ys = zip(*(_batch(w, step, regression) for w in range(waves)), strict=True)
        opt.zero_grad()
        x, y = torch.cat(xs), torch.cat(ys)
        loss = F.mse_loss(model(x), y) if regression else F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return [t.detach() for t in model.state_dict().values()]


@pytest.mark.parametrize(
    "waves,optimizer,policy,step_name",
    [
        (2, "sgd", "apply", "classification"),
        (3, "sgd", "apply", "classification"),
        (2, "adam", "apply", "classification"),
        (3, "adam", "apply", "classification"),
        (2, "sgd", "scale", "classification"),
        (2, "sgd", "drop", "classification"),
        (2, "adam", "dc-asgd", "classification"),
        (2, "sgd", "apply", "helpers:mse_step"),  # a user's own step (regression)
    ],
)
def test_bulk_synchronous_equals_single_process(shard_daemons, waves, optimizer, policy, step_name):
    if optimizer == "sgd":
        args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
        make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    else:
        args = ["--optimizer", "adam", "--lr", "0.01"]
        make_opt = lambda p: torch.optim.Adam(p, lr=0.01)
    args += ["--stale-policy", policy, "--set", "drop_limit=0"]
    daemons = shard_daemons(["--staleness", "0", *args], count=2, expect_waves=waves)
    errors: list = []
    threads = [
        threading.Thread(target=_train_wave, args=(daemons.addresses, w, errors, step_name))
        for w in range(waves)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a wave did not finish"
    assert not errors, errors
    got = shard_values(daemons.addresses)
    want = _reference(waves, make_opt, step_name)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    initial = [t.detach() for t in tiny_model().state_dict().values()]
    assert not all(torch.equal(a, b) for a, b in zip(got, initial, strict=True)), "nothing trained"
