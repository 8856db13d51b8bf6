"""Tick-tock on one device: forwards never overlap and alternate, tock starts half a cycle late;
saved-activation bytes are measured exactly."""

import json
import threading

import pytest
import torch
from conftest import run_wavelet
from torch import nn

from wavelet.common.records import read_records
from wavelet.worker.baton import ForwardBaton
from wavelet.worker.memory import SavedActivationMeter
from wavelet.worker.metrics import TIMES

JOB = [
    "--model",
    "digits_cnn",
    "--dataset",
    "digits",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--staleness",
    "1",
]


def test_meter_counts_saved_activations_once_and_releases_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    meter = SavedActivationMeter(model.parameters())
    meter.tracing = True
    x = torch.randn(16, 4)
    with meter.hooks():
        loss = model(x).sum()
    # Linear 1 saves its input (16x4 floats); ReLU saves its output (16x8), which Linear 2 saves
    # again (same storage, counted once); the weights are parameters, not activations.
    assert meter.current == 16 * 4 * 4 + 16 * 8 * 4
    loss.backward()
    assert meter.current == 0
    assert meter.peak == 16 * 4 * 4 + 16 * 8 * 4
    assert meter.trace[-1][1] == 0 and max(b for _, b in meter.trace) == meter.peak


def _turn(baton: ForwardBaton, wave: int, order: list[int]) -> None:
    """One forward turn, which must be granted at once: the baton's own stall timeout is an
    hour, so a turn that is not granted fails here instead of being skipped after a wait."""
    t = threading.Thread(target=lambda: (baton.acquire(wave), order.append(wave)), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), f"wave {wave} was not given its turn"
    baton.release(wave)


def test_baton_alternates_and_skips_a_wave_that_left():
    baton = ForwardBaton(2, timeout_s=3600)
    order = []
    _turn(baton, 0, order)
    _turn(baton, 1, order)
    baton.leave(1)
    _turn(baton, 0, order)
    _turn(baton, 0, order)  # tock left: tick goes on alone, without waiting for tock's turn
    assert order == [0, 1, 0, 0]


def test_a_baton_with_no_first_turn_gives_it_to_the_first_wave_that_asks():
    # wave turns: the shards decide who steps first (a resumed job: whose turn it was)
    baton = ForwardBaton(2, timeout_s=3600, first=None)
    order = []
    _turn(baton, 1, order)  # tock first, without waiting out tick's turn
    _turn(baton, 0, order)
    _turn(baton, 1, order)
    assert order == [1, 0, 1]


def test_baton_makes_a_wave_wait_for_its_turn():
    baton = ForwardBaton(2, timeout_s=3600)
    _turn(baton, 0, [])
    got = threading.Event()
    t = threading.Thread(target=lambda: (baton.acquire(0), got.set()), daemon=True)
    t.start()
    assert not got.wait(0.5), "tick forwarded twice while tock was waiting for its turn"
    _turn(baton, 1, [])
    assert got.wait(5)
    baton.release(0)
    t.join(5)
    assert not t.is_alive()


def test_a_garbage_collection_inside_the_meter_does_not_deadlock():
    """Autograd frees saved tensors from ``__del__``, which may run while the same thread holds
    the meter's lock (a collection triggered inside ``_pack``)."""
    meter = SavedActivationMeter()
    x = torch.ones(64, requires_grad=True)
    with meter.hooks():
        y = (x * 2).sin()
    assert meter.current > 0
    holder = {"y": y}
    del y

    def collect_while_locked():
        with meter._lock:
            holder.clear()  # the graph and its saved tensors go now, on this thread

    t = threading.Thread(target=collect_while_locked, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the meter deadlocked on its own lock"
    meter.cancel_watch()  # any call that takes the lock counts what was freed meanwhile
    assert meter.current == 0


def _run_worker(
    shard_daemons, tmp_path, waves: int, *job: str, threads: int = 1, transport: str = "auto"
):
    job = (*JOB, *job)
    daemons = shard_daemons([*job, "--waves", str(waves)], count=2, expect_waves=waves)
    args = [
        "worker",
        *job,
        "--waves",
        str(waves),
        "--shards",
        "2",
        "--threads",
        str(threads),
        "--transport",
        transport,
        "--run-dir",
        str(tmp_path / "run"),
    ]
    for a in daemons.addresses:
        args += ["--shard", a]
    done = run_wavelet(*args, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = json.loads((tmp_path / "run" / "records" / "worker-0-threads.json").read_text())
    # more than one torch thread per wave on a CPU: one thread computes for all the waves
    assert layout["shared_compute"] == (threads > 1)
    records = {}
    for w in range(waves):
        path = tmp_path / "run" / "records" / f"worker-0-wave-{w}.jsonl"
        records[w] = list(read_records(path))
    return records


# Each update rule with one of the thread layouts (a launch costs more than its checks): with
# 2 threads one thread computes for both waves. Wave turns over TCP, pulling during forward,
# run with both layouts below.
@pytest.mark.parametrize("threads, updates", [(1, "async"), (2, "wave-turns")])
def test_tick_and_tock_take_turns_at_forward(shard_daemons, tmp_path, threads, updates):
    records = _run_worker(shard_daemons, tmp_path, 2, "--updates", updates, threads=threads)
    steps = {w: [r for r in recs if r["kind"] == "step"] for w, recs in records.items()}
    assert len(steps[0]) == len(steps[1]) > 10
    intervals = sorted(
        (r["t_forward_start"], r["t_forward_end"], w) for w in steps for r in steps[w]
    )
    for (_, end, _), (start, _, _) in zip(intervals, intervals[1:], strict=False):
        assert end <= start, "two forward passes overlapped"
    # strict alternation: tick, tock, tick, tock...
    assert [w for _, _, w in intervals] == [0, 1] * len(steps[0])
    # tock's first forward starts when tick's first forward has ended (the half-cycle offset)
    assert steps[1][0]["t_forward_start"] >= steps[0][0]["t_forward_end"]
    # every step carries its timings (those Prometheus counts), versions read and memory
    for r in steps[0] + steps[1]:
        for key in (*TIMES, "versions_read", "saved_bytes_peak", "loss"):
            assert key in r
        assert r["saved_bytes_peak"] > 0
    traces = [r for r in records[0] if r["kind"] == "memory_trace"]
    assert traces and traces[0]["trace"]
    if updates == "wave-turns":
        # one worker: each group is one wave, and every update is one wave's push, so tick's
        # step k reads version 2k on every shard and tock's 2k + 1: the other's update of the
        # same turn
        for w, recs in steps.items():
            for k, r in enumerate(recs):
                assert r["versions_read"] == [2 * k + w] * 2, (w, k, r["versions_read"])


@pytest.mark.parametrize("threads", [1, 2])
def test_waves_pulling_during_forward_read_the_same_versions(shard_daemons, tmp_path, threads):
    # weights in parts of 1 KiB over TCP, each layer's forward waiting for its own: wave turns
    # still read exactly the other wave's update of the same turn, in every layer (the hooks
    # run on the computing thread with 2 threads)
    job = ("--updates", "wave-turns", "--pull-during-forward", "true", "--pull-part-kib", "1")
    records = _run_worker(shard_daemons, tmp_path, 2, *job, threads=threads, transport="tcp")
    steps = {w: [r for r in recs if r["kind"] == "step"] for w, recs in records.items()}
    assert len(steps[0]) == len(steps[1]) > 10
    for w, recs in steps.items():
        for k, r in enumerate(recs):
            assert r["versions_read"] == [2 * k + w] * 2, (w, k, r["versions_read"])
            assert r["transport"] == ["tcp", "tcp"]
        # every step but the first took its weights during its forward
        assert all(r["pull_wait_s"] >= 0 for r in recs[1:]) and recs[0]["pull_wait_s"] == 0
    assert any(r["kind"] == "eval" for r in records[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_single_wave_baseline_runs_and_pushes_during_backward(shard_daemons, tmp_path, threads):
    # with 2 threads the gradient hooks, and so the pushes, run on the computing thread
    records = _run_worker(shard_daemons, tmp_path, 1, "--placement", "layers", threads=threads)
    steps = [r for r in records[0] if r["kind"] == "step"]
    assert steps and all(r["baton_wait_s"] < 1.0 for r in steps)
    assert any(r["kind"] == "eval" for r in records[0])
    # both shards' pushes left from gradient hooks, the first while backward still ran
    assert all(r["pushed_in_backward"] == 2 and r["push_overlap_s"] > 0 for r in steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_meter_and_device_memory_on_gpu():
    from wavelet.worker.memory import device_memory

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    meter = SavedActivationMeter(model.parameters())
    with meter.hooks():
        loss = model(torch.randn(128, 64, device="cuda")).sum()
    assert meter.current == 128 * 64 * 4 + 128 * 256 * 4
    loss.backward()
    assert meter.current == 0
    mem = device_memory(torch.device("cuda:0"))
    assert mem["cuda_allocated"] > 0
