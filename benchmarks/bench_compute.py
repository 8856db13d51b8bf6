"""Where a CPU worker's waves should compute: on threads of their own, or all on one thread
(worker/compute.py). Forward and backward of the job's model at its batch, samples/s, in a fresh
process per setting (torch's OpenMP thread pools live as long as the threads that made them),
settings alternating over repeats, medians reported against the first, the way an all-reduce
rank computes (on its process's main thread):

- ``main``: one wave's steps on the main thread;
- ``own-thread``: the same on a thread of its own, after the main thread computed (a worker's
  main thread builds the dataset and probes the model before the waves start);
- ``two-own-threads``: two waves, each on its own thread with every core, taking turns at
  forward and overlapping the other's backward (the worker before worker/compute.py);
- ``two-shared``: the same two waves, their forwards and backwards on one thread
  (worker/compute.SharedCompute), their own threads kept to one torch thread.

The forward baton here hands over at the forward's end; a job's memory-aware baton waits for
most of backward. Which layout a job should use (one torch thread per wave, or all cores with
one computing thread) is the worker's start-up probe's choice (worker/threads.py).

    .venv/bin/python benchmarks/bench_compute.py            # narrow ResNet-18, batch 32
    .venv/bin/python benchmarks/bench_compute.py --config configs/digits.toml --repeats 5
    .venv/bin/python benchmarks/bench_compute.py --probe 15 --batch-size 41  # the probe's noise
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

SETTINGS = ("main", "own-thread", "two-own-threads", "two-shared")


def _job(config: str | None, batch_size: int):
    from wavelet.common.config import JobConfig
    from wavelet.common.settings import from_dict, load_toml

    settings = load_toml(config) if config else {}
    if batch_size:
        settings["batch_size"] = batch_size
    return from_dict(JobConfig, settings)


def _measure(setting: str, config: str | None, batch_size: int, count: int, threads: int) -> dict:
    """One setting in this process: samples/s over ``count`` steps per wave after a warm-up."""
    import torch

    from wavelet.common.datasets import build_dataset
    from wavelet.common.job import loader_settings
    from wavelet.common.models import build_model
    from wavelet.common.step import load_step
    from wavelet.worker.compute import InlineCompute, SharedCompute

    job = _job(config, batch_size)
    torch.get_num_threads()
    torch.set_num_threads(threads)
    settings = loader_settings(job, "cpu")
    dataset = build_dataset(job.dataset, job.seed, settings, **job.dataset_kwargs)
    step = load_step(job.step, job.precision)
    batch = dataset.sample_batch(job.batch_size)
    waves = 2 if setting.startswith("two") else 1
    models = [
        build_model(
            job.model, dataset.input_shape, dataset.num_classes, job.seed, **job.model_kwargs
        )
        for _ in range(waves)
    ]
    compute = SharedCompute(threads) if setting == "two-shared" else InlineCompute()
    turn = threading.Semaphore(1)  # the forward baton: one forward at a time

    def forward(model):
        return step(model, batch)[0]

    def backward(model, loss):
        model.zero_grad(set_to_none=True)
        loss.backward()

    def steps(model, count: int) -> None:
        for _ in range(count):
            with turn:
                loss = compute(forward, model)
            compute(backward, model, loss)

    def wave(model, count: int) -> None:
        compute.enter_wave_thread()
        steps(model, count)

    steps(models[0], 3)  # warm-up, on the main thread: as a worker's probe does
    if setting == "main":
        began = time.perf_counter()
        steps(models[0], count)
        elapsed = time.perf_counter() - began
    else:
        runners = [threading.Thread(target=wave, args=(m, count)) for m in models]
        began = time.perf_counter()
        for r in runners:
            r.start()
        compute.serve(lambda: not any(r.is_alive() for r in runners), poll_s=0.01)
        for r in runners:
            r.join()
        elapsed = time.perf_counter() - began
    return {"setting": setting, "samples_per_s": waves * count * job.batch_size / elapsed}


def _probe_stability(config: str | None, batch_size: int, trials: int, threads: int) -> None:
    """How often the worker's thread probe (worker/threads.py) would choose narrow, taking the
    best of its first two timed rounds against the best of four: ``trials`` probes of the job's
    model, one thread against ``threads``, one step each in turns, the same steps read both
    ways."""
    from wavelet.common.job import build_dataset_and_model
    from wavelet.common.step import load_step
    from wavelet.worker.threads import WIDE_GAIN, timed_rounds

    job = _job(config, batch_size)
    dataset, model = build_dataset_and_model(job)
    step = load_step(job.step, job.precision)
    batch = dataset.sample_batch(job.batch_size)
    ratios: dict[int, list[float]] = {2: [], 4: []}
    for _ in range(trials):
        # the probe's own rounds, four of them whatever they take
        narrow, wide = timed_rounds(model, batch, (1, threads), step, rounds=(4, 4))
        for best_of in ratios:
            ratios[best_of].append(min(narrow[:best_of]) / min(wide[:best_of]))
    print(f"{config}, batch {job.batch_size}: narrow/wide step time over {trials} probes")
    for best_of, values in ratios.items():
        narrow = sum(r < WIDE_GAIN for r in values)
        print(
            f"best of {best_of}: median {statistics.median(values):.2f} "
            f"(range {min(values):.2f}-{max(values):.2f}); below {WIDE_GAIN} (narrow): "
            f"{narrow} of {trials}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/narrow_resnet.toml")
    parser.add_argument("--batch-size", type=int, default=0, help="0: the job's")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per wave")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--probe", type=int, default=0, help="instead: N thread probes, best of 2 against 4"
    )
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child's setting
    args = parser.parse_args()
    from wavelet.common.machine import usable_cores

    threads = args.threads or usable_cores()
    if args.probe:
        _probe_stability(args.config, args.batch_size, args.probe, threads)
        return 0
    if args.one:
        print(json.dumps(_measure(args.one, args.config, args.batch_size, args.steps, threads)))
        return 0
    rates: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:
            cmd = [sys.executable, __file__, "--one", setting, "--config", args.config]
            cmd += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
            cmd += ["--threads", str(threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
            rates[setting].append(json.loads(done.stdout.strip().splitlines()[-1])["samples_per_s"])
    base = statistics.median(rates["main"])
    print(f"{args.config}, {threads} torch threads, medians of {args.repeats} alternating runs")
    print("| setting | samples/s: median (range) | vs main |")
    print("|---|---:|---:|")
    for setting, values in rates.items():
        median = statistics.median(values)
        print(
            f"| {setting} | {median:.0f} ({min(values):.0f}-{max(values):.0f}) "
            f"| {median / base:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
