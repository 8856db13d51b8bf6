"""With staleness bound 0, W waves through the PS equal one process on the concatenated batches,
with the waves' tensors moving over both transports in one job (even waves through shared
memory, odd ones over TCP)."""

import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from helpers import client_for, run_threads, shard_values, tiny_model

from wavelet.common.datasets import LoaderDataset
from wavelet.common.step import load_step
from wavelet.worker.push_hooks import PushDuringBackward

STEPS = 6
BATCH = 8


def _batch(wave: int, step: int, regression: bool = False):
    g = torch.Generator().manual_seed(100 * wave + step)
    x = torch.randn(BATCH, 4, generator=g)
    if regression:  # float targets for the model's 3 outputs
        return x, torch.randn(BATCH, 3, generator=g)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def _loader_batches(waves: int) -> list[list]:
    """Each wave's STEPS batches of regression targets, read through a DataLoader from a
    map-style dataset, as a job's waves read theirs (common/datasets.py ``LoaderPart``)."""
    g = torch.Generator().manual_seed(7)
    n = waves * STEPS * BATCH
    data = tud.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g))
    loader = LoaderDataset(data, data)
    return [list(loader.part(w, waves, seed=3).batches(BATCH, 0, seed=0)) for w in range(waves)]


def _train_wave(
    addresses,
    wave: int,
    errors: list,
    step_name: str = "classification",
    wire_dtype="fp32",
    loader_waves: int = 0,
    early: list | None = None,
    parts: list | None = None,
):
    """``early``: push each shard as backward makes its gradients (layers placement), and
    append, per step, the order the shards went out in and whether the first layer's gradient
    was still to come then (backward still running). ``parts``: push during backward with every
    parameter's gradient a part of its own over TCP, and append, per step of the TCP wave,
    how many chunks went ahead in parts."""
    try:
        model = tiny_model()
        step_fn = load_step(step_name)
        transport = "tcp" if wave % 2 else "shm"
        placement = "layers" if early is not None else "size"
        c = client_for(
            model, addresses, f"w{wave}", 0, transport=transport, wire_dtype=wire_dtype,
            placement=placement,
        )  # fmt: skip
        pusher = None
        if early is not None or parts is not None:
            pusher = PushDuringBackward(dict(model.named_parameters()), c.chunks)
        if parts is not None:
            c.push_part_bytes = 1
        try:
            c.register(0)
            assert c.transports == [transport] * len(addresses)
            pulled = c.pull(0)
            batches = _loader_batches(loader_waves)[wave] if loader_waves else None
            for step in range(STEPS):
                if batches:
                    x, y = batches[step]
                else:
                    x, y = _batch(wave, step, step_name != "classification")
                model.zero_grad()
                push = c.start_push(step, pulled.versions)
                order = []
                first = next(model.parameters())
                if pusher:

                    def send(shard, push=push, order=order, first=first):
                        order.append((shard, first.grad is None))
                        push.send(shard)

                    pusher.arm(send, push.part)
                step_fn(model, (x, y))[0].backward()
                if pusher:
                    pusher.disarm()
                    if early is not None:
                        early.append(order)
                pulled = push.finish()
                if parts is not None and transport == "tcp":
                    parts.append(sum(map(len, push.parted)))
                assert pulled.versions == [step + 1] * len(addresses)
            c.leave()
        finally:
            c.close()
    except BaseException as e:  # surfaced by the test thread
        errors.append(e)


def _reference(waves: int, make_opt, step_name: str = "classification", loader: bool = False):
    model = tiny_model()
    opt = make_opt(model.parameters())
    regression = step_name != "classification"
    read = _loader_batches(waves) if loader else None
    for step in range(STEPS):
        if read:
            xs, ys = zip(*(read[w][step] for w in range(waves)), strict=True)
        else:
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
    got = _train_waves(daemons.addresses, waves, step_name)
    _assert_equal(got, _reference(waves, make_opt, step_name))


def test_bulk_synchronous_equals_single_process_when_pushing_during_backward(shard_daemons):
    """Each wave pushes to the shard of the last layers while backward still runs (layers
    placement): the same updates as one process, and the pushes did go out early."""
    args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
    daemons = shard_daemons(["--staleness", "0", *args], count=2, expect_waves=2)
    early: list[int] = []
    got = _train_waves(daemons.addresses, 2, early=early)
    _assert_equal(got, _reference(2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))
    # every step of both waves: the last layers' shard while backward ran, then the first's
    assert early == [[(1, True), (0, False)]] * (2 * STEPS)


def test_bulk_synchronous_equals_single_process_when_pushing_in_parts(shard_daemons):
    """Over TCP each parameter's gradients go ahead as a part of its shard's push as soon as
    backward made them (ps/push_parts.py): each push is still applied whole, as one process."""
    args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
    daemons = shard_daemons(["--staleness", "0", *args], count=2, expect_waves=2)
    parts: list[int] = []
    got = _train_waves(daemons.addresses, 2, parts=parts)
    _assert_equal(got, _reference(2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))
    assert len(parts) == STEPS and all(n > 0 for n in parts), parts  # parts did go ahead


def _train_waves(
    addresses,
    waves: int,
    step_name="classification",
    wire_dtype="fp32",
    loader: bool = False,
    early: list | None = None,
    parts: list | None = None,
):
    """The shards' master weights after ``waves`` waves trained STEPS steps."""
    errors: list = []
    loader_waves = waves if loader else 0
    threads = [
        threading.Thread(
            target=_train_wave,
            args=(addresses, w, errors, step_name, wire_dtype, loader_waves, early, parts),
        )
        for w in range(waves)
    ]
    run_threads(threads, errors, timeout_s=60)
    placement = "layers" if early is not None else "size"
    return shard_values(addresses, wire_dtype=wire_dtype, placement=placement)


def _assert_equal(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    initial = [t.detach() for t in tiny_model().state_dict().values()]
    assert not all(torch.equal(a, b) for a, b in zip(got, initial, strict=True)), "nothing trained"


def _reference_rounded(waves: int, make_opt, wire: torch.dtype):
    """Single-process training where, as on a 16-bit wire, each wave's forward reads the fp32
    master weights rounded to ``wire`` and each wave's gradient is rounded to ``wire`` before
    the fp32 mean and update."""
    master, reader = tiny_model(), tiny_model()
    opt = make_opt(master.parameters())
    for step in range(STEPS):
        with torch.no_grad():
            for r, m in zip(reader.parameters(), master.parameters(), strict=True):
                r.copy_(m.to(wire))
        grads = []
        for w in range(waves):
            x, y = _batch(w, step)
            reader.zero_grad()
            F.cross_entropy(reader(x), y).backward()
            grads.append([p.grad.to(wire).float() for p in reader.parameters()])
        for i, p in enumerate(master.parameters()):
            p.grad = sum(g[i] for g in grads) / waves
        opt.step()
    return [t.detach() for t in master.state_dict().values()]


@pytest.mark.parametrize("wire_dtype,wire", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_bulk_synchronous_on_a_16_bit_wire_equals_training_with_the_same_rounding(
    shard_daemons, wire_dtype, wire
):
    """The rounding is the only difference a 16-bit wire makes: shards keep fp32 master weights
    and apply the widened mean in fp32 (one wave over shared memory, one over TCP)."""
    args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
    daemons = shard_daemons(["--staleness", "0", *args], count=2, expect_waves=2)
    got = _train_waves(daemons.addresses, 2, wire_dtype=wire_dtype)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    _assert_equal(got, _reference_rounded(2, make_opt, wire))
    # and the rounding does make a difference: fp32 training ends elsewhere
    exact = _reference(2, make_opt)
    assert any((a - b).abs().max() > 1e-5 for a, b in zip(got, exact, strict=True))


def test_bulk_synchronous_with_a_users_step_and_a_dataloader_equals_single_process(
    shard_daemons,
):
    """A user's step (regression) on batches a DataLoader reads from a map-style dataset, each
    wave its own part: still single-process training on the concatenated batches."""
    args = ["--optimizer", "sgd", "--lr", "0.1", "--set", "optimizer.kwargs.momentum=0.9"]
    daemons = shard_daemons(["--staleness", "0", *args], count=2, expect_waves=2)
    got = _train_waves(daemons.addresses, 2, "helpers:mse_step", loader=True)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    _assert_equal(got, _reference(2, make_opt, "helpers:mse_step", loader=True))
