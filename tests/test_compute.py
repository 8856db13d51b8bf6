"""The waves' computation on one thread (worker/compute.py): calls run on the serving thread,
results and errors come back to the caller, nothing waits forever once serving ends, and the
process keeps one pool of torch threads; under wave turns any step faster on all cores goes wide."""

import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import CHILD_ENV, ROOT, run_benchmark

from wavelet.common.config import JobConfig
from wavelet.common.datasets import build_dataset
from wavelet.worker.compute import ComputeStopped, InlineCompute, SharedCompute
from wavelet.worker.threads import goes_wide, probe_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_compute import SETTINGS  # noqa: E402


def _in_thread(fn):
    """Run ``fn`` on a new thread; its result or exception, as ("ok"|"error", value)."""
    out = []

    def body():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(("error", e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_calls_run_on_the_serving_thread_and_hand_back_results_and_errors():
    compute = SharedCompute(threads=1)
    owner = threading.get_ident()

    def where(x):
        return threading.get_ident(), x * 2

    def fails():
        raise ValueError("bad batch")

    t1, out1 = _in_thread(lambda: compute(where, 21))
    t2, out2 = _in_thread(lambda: compute(fails))
    compute.serve(lambda: not (t1.is_alive() or t2.is_alive()), poll_s=0.05)
    t1.join(10)
    t2.join(10)
    assert out1 == [("ok", (owner, 42))]
    kind, error = out2[0]
    assert kind == "error" and isinstance(error, ValueError) and str(error) == "bad batch"
    # the serving thread's own calls run at once
    assert compute(where, 1) == (owner, 2)


def test_a_call_made_after_serving_ended_fails_instead_of_waiting():
    compute = SharedCompute(threads=1)
    compute.serve(lambda: True)  # the waves are gone
    t, out = _in_thread(lambda: compute(lambda: "never"))
    t.join(10)
    assert not t.is_alive()
    assert out[0][0] == "error" and isinstance(out[0][1], ComputeStopped)


def test_inline_compute_runs_where_it_is_called():
    compute = InlineCompute()
    t, out = _in_thread(lambda: compute(threading.get_ident))
    t.join(10)
    assert out == [("ok", t.ident)]
    compute.serve(lambda: True)


ONE_POOL = """
import json, os, threading, torch
from wavelet.worker.compute import SharedCompute

def task_count():
    return len(os.listdir("/proc/self/task"))

x = torch.randn(600, 600)
compute = SharedCompute(threads=2)
compute(torch.mm, x, x)  # the serving thread's pool: one helper
before = task_count()
counts = []

def wave():
    compute.enter_wave_thread()
    for _ in range(5):
        compute(torch.mm, x, x)
        (x * 2).sum()  # work of the wave's own: big enough for torch to split
    counts.append((torch.get_num_threads(), task_count()))

waves = [threading.Thread(target=wave) for _ in range(2)]
for w in waves:
    w.start()
compute.serve(lambda: len(counts) == 2)
print(json.dumps({"before": before, "waves": counts, "owner": torch.get_num_threads()}))
"""


def test_waves_add_no_pool_of_torch_threads_of_their_own():
    env = {k: v for k, v in CHILD_ENV.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", ONE_POOL], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["owner"] == 2
    for wave_threads, tasks in seen["waves"]:
        assert wave_threads == 1
        # the two wave threads themselves, at most; no helpers of their own
        assert tasks <= seen["before"] + 2, seen


@pytest.mark.parametrize("compute", [InlineCompute(), SharedCompute(threads=1)])
def test_serve_returns_once_done(compute):
    flag = threading.Event()
    t = threading.Timer(0.2, flag.set)
    t.start()
    compute.serve(flag.is_set, poll_s=0.05)
    assert flag.is_set()


def test_the_benchmark_runs_every_setting(tmp_path):
    done = run_benchmark(
        "bench_compute.py",
        *[
            "--config",
            str(ROOT / "configs" / "digits.toml"),
            "--steps",
            "3",
            "--repeats",
            "1",
            "--threads",
            "2",
        ],  # fmt: skip
        env={k: v for k, v in CHILD_ENV.items() if k != "OMP_NUM_THREADS"},
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == list(SETTINGS)
    assert rows[0].endswith("| 1.00x |")


def test_under_wave_turns_any_step_faster_wide_goes_wide_and_a_busy_machine_stays_narrow():
    """Under wave turns no two waves' steps overlap, so a short step that runs faster on every
    core goes wide (other rules keep short steps narrow: their waves' steps overlap); where
    another job keeps the cores busy, wide steps run slower, and the worker stays narrow (two
    default jobs side by side that went wide regardless trained 33x slower)."""
    assert goes_wide(0.0029, 0.0016, overlap=False)
    assert not goes_wide(0.0029, 0.0016, overlap=True)  # digits: its waves' steps overlap
    assert goes_wide(0.098, 0.061, overlap=True)  # the narrow ResNet: long and faster wide
    assert not goes_wide(0.007, 0.31, overlap=False)  # measured beside another job
    assert not goes_wide(0.098, 0.090, overlap=False)  # too little gain for twice the threads
    job = JobConfig(batch_size=8)
    dataset = build_dataset(job.dataset, job.seed)
    turns = probe_threads(dataclasses.replace(job, updates="wave-turns"), "cpu", 2, dataset)
    assert turns.narrow_s > 0 and turns.wide_s > 0
    assert "wave turns" in turns.describe() and "ms wide" in turns.describe()
    assert turns.layout == ("wide" if goes_wide(turns.narrow_s, turns.wide_s, False) else "narrow")
    probed = probe_threads(job, "cpu", 2, dataset)
    assert probed.narrow_s > 0 and probed.wide_s > 0 and not probed.reason


@pytest.mark.parametrize("step_s, rounds", [(0.0, 4), (0.2, 2)])
def test_the_probe_takes_more_rounds_where_they_are_cheap(monkeypatch, step_s, rounds):
    """Four timed rounds after the warm-up where they fit the probe's time budget (a moment's
    load on the wide steps then misleads it less often), at least two however long a step."""
    import torch

    from wavelet.worker import threads

    monkeypatch.setattr(threads, "PROBE_BUDGET_S", 0.5)
    calls = []

    def step(model, batch):
        calls.append(torch.get_num_threads())
        threading.Event().wait(step_s)
        return (model(batch).sum(),)

    model = torch.nn.Linear(4, 2)
    before = torch.get_num_threads()
    try:
        best = threads._step_times(model, torch.ones(3, 4), (1, 2), step)
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 2] * (1 + rounds)  # the warm-up, then the timed rounds, in turns
    assert all(0 < b < float("inf") for b in best)
