"""Wavelet from Python: what ``import wavelet`` gives (the top-level package re-exports it).

    import wavelet
    from mymodels import build_net, my_step  # top-level functions of an importable module

    job = wavelet.JobConfig(model=build_net, step=my_step, dataset="digits", epochs=3)
    summary = wavelet.launch(job, devices=["cpu"], run_dir="runs/mine")
    print(summary["test_accuracy"], summary["samples_per_s"])
    figures = wavelet.compare(job, modes=["ticktock", "allreduce"], target=0.9)
    model = wavelet.load_model("runs/mine")  # the trained model, in eval mode

Functions may stand where the command line takes import paths (``model``, ``dataset``, ``step``):
they are turned into their import path, because every worker is another process that imports
them; a lambda, a nested function or one defined in the ``__main__`` of a script run by path is
refused with one ``ConfigError`` saying so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wavelet.common.config import JobConfig
from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.datasets import Dataset
from wavelet.common.job import load_trained_model
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.records import new_run_dir
from wavelet.common.settings import ConfigError

__all__ = [
    "ConfigError",
    "Dataset",
    "JobConfig",
    "JobFailed",
    "LaunchConfig",
    "OptimizerConfig",
    "compare",
    "launch",
    "load_model",
]


class JobFailed(RuntimeError):
    """A job that did not run to its end: ``exit_code`` as ``wavelet launch`` would exit with,
    ``reason`` the first failing process's own words, and ``run_dir`` with the logs::

        try:
            wavelet.launch(job)
        except wavelet.JobFailed as e:
            print(e.reason, e.run_dir)
    """

    def __init__(self, message: str, exit_code: int, run_dir: str, reason: str = ""):
        super().__init__(message)
        self.exit_code = exit_code
        self.run_dir = run_dir
        self.reason = reason


def launch(job: JobConfig, *, quiet: bool = False, **settings: Any) -> dict:
    """Run ``job`` to its end as ``wavelet launch`` does, with ``settings`` of ``LaunchConfig``
    (``devices``, ``run_dir``, ``mode``, ``transport``, ...); returns the run's summary (its
    ``summary.json``: test accuracy, samples/s, staleness per wave). Raises ``ConfigError`` for
    a bad setting and ``JobFailed`` when the job stops early::

        summary = wavelet.launch(wavelet.JobConfig(epochs=3), devices=["cpu"], quiet=True)
        print(summary["test_accuracy"])
    """
    known = {f.name for f in dataclasses.fields(LaunchConfig)} - {"job"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"unknown launch setting {unknown[0]!r}; known: {sorted(known)}")
    config = LaunchConfig(job=job, **settings)
    if not config.run_dir:  # made here, so that the summary is found where launch wrote it
        config = dataclasses.replace(config, run_dir=str(new_run_dir()))
    from wavelet.scripts.launch import launch as launch_job

    failures: list[str] = []
    code = launch_job(config, quiet=quiet, on_failure=failures.append)
    if code != 0:
        reason = failures[0] if failures else f"exit code {code}"
        raise JobFailed(
            f"the job stopped: {reason.splitlines()[0]} (its logs: {config.run_dir}/logs)",
            code,
            config.run_dir,
            reason,
        )
    return json.loads((Path(config.run_dir) / "summary.json").read_text())


def compare(
    job: JobConfig,
    modes: Sequence[str] | None = None,
    *,
    out: str | Path | None = None,
    target: float = 0.97,
    devices: Sequence[str] = ("cpu",),
    memory_budget: str = "",
    lr_scaling: str = "linear",
    slow_device: str = "",
    quiet: bool = False,
) -> dict[str, dict]:
    """``job`` in several modes side by side, as ``wavelet compare`` does (``report.md`` and the
    runs in ``out``); per mode its figures (``run_dir``, ``samples_per_s``, ``time_to_target_s``,
    ``final_score``, ``score_curve``, memory peaks, ``staleness``; with ``memory_budget`` also the
    ``batch`` per task and ``lr`` it chose) or ``{"error": why}``. The memory timelines stay in
    ``out`` (``metrics.json``, ``memory.png``). ``slow_device`` (``"D:PCT"``) caps one device's
    processes alike for every mode (a slow or shared device); ``quiet``: no line per mode, as
    ``launch(quiet=True)``::

        figures = wavelet.compare(job, ["ticktock", "allreduce"], target=0.9)
        print(figures["ticktock"]["time_to_target_s"], figures["allreduce"]["time_to_target_s"])
    """
    from wavelet.scripts.budget import parse_budget
    from wavelet.scripts.compare import compare as compare_modes
    from wavelet.scripts.compare import default_modes, plan_budget
    from wavelet.scripts.modes import check_modes

    plan = None
    if memory_budget:
        plan = plan_budget(job, parse_budget(memory_budget), devices[0], lr_scaling)
    modes = check_modes(list(modes or default_modes(job, list(devices), plan is not None)))
    out = Path(out) if out else new_run_dir("compare")  # once nothing more can be refused
    try:
        settings = {"slow_device": slow_device} if slow_device else None
        results = compare_modes(
            job, list(devices), modes, out, target, settings, budget=plan, quiet=quiet
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return {r.name: _mode_figures(r, budget=plan is not None) for r in results}


def _mode_figures(result, budget: bool) -> dict:
    if not result.figures:
        return {"error": result.error}
    figures = result.figures.to_json()
    del figures["memory_traces"]  # thousands of points per wave: a plot's data, not a figure
    if budget:
        figures.update(batch=result.batch, lr=result.lr)
    return figures


def load_model(run_dir: str | Path, job: JobConfig | None = None, device: str = "cpu"):
    """The model a run trained, in eval mode: the job's model (from ``RUN_DIR/job.json``, which
    ``launch`` writes, unless ``job`` is given) with the weights in ``RUN_DIR/model.pt`` (a
    plain state_dict, written when training ends: ``torch.load`` reads it too)::

        model = wavelet.load_model("runs/mine")
        print(model(torch.zeros(1, 1, 8, 8)).argmax())
    """
    return load_trained_model(run_dir, job, device)
