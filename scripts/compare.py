"""``wavelet compare``: one job in several modes (``modes.py``), one after another, side by
side. Writes ``report.md`` (one table, a row per mode), ``accuracy.png``, ``memory.png``,
``metrics.json`` and each mode's full run directory with the raw records behind every number.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Callable
from pathlib import Path

from wavelet.common.config import GROUPED_UPDATES, JobConfig, async_only_defaults, launch_updates
from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.evaluation import format_target
from wavelet.common.figures import RunFigures, run_figures
from wavelet.scripts.budget import (
    ActivationProbe,
    Budget,
    BudgetError,
    largest_batch,
    scaled_lr,
)
from wavelet.scripts.forkserver import ForkServer
from wavelet.scripts.launch import launch, threads_per_process
from wavelet.scripts.modes import BUDGET_MODES, DEFAULT_MODES, MODES, Mode, check_modes
from wavelet.scripts.plots import accuracy_vs_time, memory_timelines
from wavelet.scripts.signals import INTERRUPTED
from wavelet.scripts.supervisor import shared_fork_server
from wavelet.worker.threads import ThreadChoice, computes_one_at_a_time, probe_threads


def default_modes(job: JobConfig, devices: list[str], budget: bool) -> list[str]:
    """The modes ``wavelet compare`` runs unless told: where ``ticktock`` (the job's own update
    rule) comes out as wave turns, as ``updates = auto`` does on CPUs, ``ticktock-async`` takes
    the place of ``ticktock-turns``, so that both rules are still compared."""
    modes = BUDGET_MODES if budget else DEFAULT_MODES
    ticktock = mode_job(MODES["ticktock"], job, devices, None)[0]
    if ticktock.updates != "wave-turns":
        return list(modes)
    return ["ticktock-async" if m == "ticktock-turns" else m for m in modes]


@dataclasses.dataclass
class ModeResult:
    name: str
    ok: bool
    figures: RunFigures | None = None
    error: str = ""
    batch: int = 0  # per task (wave or rank), when a memory budget chose it
    predicted_peak: int = 0  # the device peak the budget search measured at that batch
    lr: float = 0.0
    interrupted: bool = False  # Ctrl-C stopped it, and the comparison with it


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The equal-memory settings of a comparison."""

    budget: Budget
    budget_bytes: int
    lr_rule: str = "linear"


def plan_budget(job: JobConfig, budget: Budget, device: str, lr_rule: str) -> BudgetPlan:
    """Resolve a relative budget against one wave's measured peak at the job's batch."""
    if budget.relative:
        one_wave = ActivationProbe(job, False, device).peak(job.batch_size)
        return BudgetPlan(budget, int(budget.relative * one_wave), lr_rule)
    return BudgetPlan(budget, budget.bytes, lr_rule)


def mode_job(
    mode: Mode,
    job: JobConfig,
    devices: list[str],
    plan: BudgetPlan | None,
    threads: int = 0,
    layouts: dict | None = None,
) -> tuple[JobConfig, int, int, int]:
    """The job a mode runs: its own settings over the job's, and at a memory budget the largest
    batch per task that fits, with the learning rate scaled to it. ``threads``: the torch threads
    the run is given (0: the worker probes). Returns (job, batch, peak, threads), the last the
    threads the budget assumed, which the run must keep (0: any). ``layouts`` keeps the thread
    probes of one comparison, so modes with the same model, batch and cores probe once."""
    run_job = _concrete(mode, _with_mode_settings(job, mode), devices)
    if plan is None:
        return run_job, 0, 0, 0
    device = devices[0]
    probe = ActivationProbe(job, bool(mode.job.get("activation_checkpointing")), device)
    processes = len(devices) * mode.launch.get("processes_per_device", 1)
    tasks = processes if mode.allreduce else processes * run_job.waves
    limit = probe.dataset.num_train // tasks  # a task needs a full batch of its data part
    layout = _layout(mode, run_job, devices, probe.dataset, threads, layouts)
    one_at_a_time = layout is not None and computes_one_at_a_time(device, layout)
    batch, peak = largest_batch(
        probe, mode.at_once(run_job, one_at_a_time), plan.budget_bytes, limit
    )
    # all-reduce: launch gives each rank batch_size x waves / processes_per_device
    per_device = mode.launch.get("processes_per_device", 1)
    waves = per_device if mode.allreduce else run_job.waves
    lr = scaled_lr(job, batch * _gradients_per_lr(mode, run_job, processes), plan.lr_rule)
    optimizer = dataclasses.replace(run_job.optimizer, lr=lr)
    # the batch that fits is the most a wave may take: balanced batches only shrink the slower
    run_job = dataclasses.replace(
        run_job, batch_size=batch, waves=waves, optimizer=optimizer, balance_max_factor=1.0
    )
    return run_job, batch, peak, layout.threads if layout is not None else 0


def _with_mode_settings(job: JobConfig, mode: Mode) -> JobConfig:
    """``job`` with ``mode``'s own settings; a mode of grouped updates leaves out the job's
    staleness bound and stale policy, which only the asynchronous modes use."""
    settings = dict(mode.job)
    if settings.get("updates", job.updates) in GROUPED_UPDATES:
        settings.update(async_only_defaults())
    return dataclasses.replace(job, **settings)


def _concrete(mode: Mode, job: JobConfig, devices: list[str]) -> JobConfig:
    """``job`` with its update rule decided as ``launch`` will decide it for ``mode``."""
    settings = {k: v for k, v in mode.launch.items() if k in ("schedule", "processes_per_device")}
    return launch_updates(job, devices, "allreduce" if mode.allreduce else "ps", **settings)


def _layout(
    mode: Mode, job: JobConfig, devices: list[str], dataset, threads: int, layouts: dict | None
) -> ThreadChoice | None:
    """The thread layout a worker of a baton mode will run, as the daemon decides it (the same
    probe of the job's model on the same share of the cores); None for other modes."""
    if mode.allreduce or mode.tasks_at_once is not None:
        return None
    cores = threads_per_process(devices, mode.launch.get("processes_per_device", 1))
    probed = {} if layouts is None else layouts
    key = (_probed_settings(job), devices[0], cores, threads)
    if key not in probed:
        probed[key] = probe_threads(job, devices[0], cores, dataset, fixed=threads)
    return probed[key]


def _probed_settings(job: JobConfig) -> str:
    """What of ``job`` the thread probe reads: two modes that agree here get the same layout."""
    fields = ("model", "model_kwargs", "dataset", "dataset_kwargs", "seed", "batch_size")
    fields += ("waves", "step", "precision", "updates")
    return json.dumps({f: getattr(job, f) for f in fields}, sort_keys=True, default=str)


def _gradients_per_lr(mode: Mode, job: JobConfig, processes: int) -> int:
    """How many tasks' batches the optimizer's lr is meant for in ``mode``: all-reduce and
    bulk-synchronous updates average every task's (the ranks', or all waves'), a wave group its
    workers' waves, an asynchronous push one wave's; with update_lr = by-samples the shards scale
    each update by its share of all waves, so the lr is the one for every wave's batch."""
    if mode.allreduce:
        return processes
    tasks = processes * job.waves
    if job.update_lr == "by-samples" or job.staleness == 0:
        return tasks
    if job.updates in GROUPED_UPDATES:
        return processes
    return 1


def compare(
    job: JobConfig,
    devices: list[str],
    modes: list[str],
    out: Path,
    target: float,
    settings: dict | None = None,
    budget: BudgetPlan | None = None,
    fork_server: ForkServer | None = None,
    quiet: bool = False,
) -> list[ModeResult]:
    """Run ``job`` in each mode; ``settings`` are launch settings every mode shares (e.g. a
    CUDA memory cap); with ``budget``, each mode at the largest batch that fits it. Every
    mode's daemons fork from ``fork_server`` (the caller's), else from one started here.
    ``quiet``: no line per mode (the results and the report say it all)."""
    check_modes(modes)
    out.mkdir(parents=True, exist_ok=True)
    say = _silent if quiet else print
    with shared_fork_server((settings or {}).get("spawn", "fork"), fork_server) as server:
        return _compare(job, devices, modes, out, target, settings, budget, server, say)


def _silent(*args, **kwargs) -> None:
    pass


def _compare(
    job: JobConfig,
    devices: list[str],
    modes: list[str],
    out: Path,
    target: float,
    settings: dict | None,
    budget: BudgetPlan | None,
    server: ForkServer | None,
    say: Callable[..., None] = print,
) -> list[ModeResult]:
    results = []
    layouts: dict = {}  # thread probes, one per model, batch and cores
    for name in modes:
        mode = MODES[name]
        run_dir = out / name
        say(f"== {name}: {mode.description}", flush=True)
        batch = peak = 0
        try:
            launch_settings = {**(settings or {}), **mode.launch}
            run_job, batch, peak, threads = mode_job(
                mode, job, devices, budget, launch_settings.get("threads", 0), layouts
            )
            if threads:  # the budget counted on this layout (and probed it once already)
                launch_settings["threads"] = threads
            if budget:
                say(
                    f"   batch {batch} per task, lr {run_job.optimizer.lr:g}: measured device "
                    f"peak {peak / 1e6:.2f} MB of {budget.budget_bytes / 1e6:.2f} MB",
                    flush=True,
                )
            config = LaunchConfig(
                job=run_job,
                devices=devices,
                run_dir=str(run_dir),
                **launch_settings,
            )
            code = launch(config, quiet=True, fork_server=server)
            if code == INTERRUPTED:
                raise KeyboardInterrupt
            if code != 0:
                results.append(
                    ModeResult(
                        name,
                        False,
                        error=f"launch exited with {code}; see {run_dir}/logs",
                        batch=batch,
                        predicted_peak=peak,
                    )
                )
                continue
            results.append(
                ModeResult(
                    name,
                    True,
                    run_figures(run_dir, target),
                    batch=batch,
                    predicted_peak=peak,
                    lr=run_job.optimizer.lr,
                )
            )
            say(f"   {results[-1].figures.one_line()}", flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops the comparison, not only this mode
            why = "interrupted (Ctrl-C); the modes after it did not run"
            results.append(ModeResult(name, False, error=why, batch=batch, interrupted=True))
            say(f"   {why}", flush=True)
            break
        except BudgetError as e:
            results.append(ModeResult(name, False, error=str(e)))
        except Exception as e:  # one broken mode must not lose the others' results
            (out / f"{name}.error.txt").write_text(traceback.format_exc())
            results.append(ModeResult(name, False, error=f"{type(e).__name__}: {e}"))
    write_report(results, out, target, budget)
    return results


COLUMNS = [
    "mode",
    "samples/s",
    "time to {target} (s)",
    "final {metric}",
    "peak activations / device",
    "vs one wave",
    "wire KB / sample",
    "staleness mean / p99 per wave",
]
BUDGET_COLUMNS = ["batch / task", "lr", "within budget"]


def table_rows(
    results: list[ModeResult], target: float, budget: BudgetPlan | None = None
) -> list[list[str]]:
    width = len(COLUMNS) + (len(BUDGET_COLUMNS) if budget else 0)
    rows = []
    for r in results:
        if not r.ok or r.figures is None:
            rows.append([r.name, "failed", r.error] + [""] * (width - 3))
            continue
        m = r.figures
        worst = max(m.peak_bytes_per_device.values(), default=0)
        ratio = m.memory_ratio
        stale = ", ".join(f"{w} {s['mean']:.2f}/{s['p99']}" for w, s in m.staleness.items())
        row = [
            r.name,
            f"{m.samples_per_s:.0f}",
            f"{m.time_to_target_s:.1f}" if m.time_to_target_s is not None else "not reached",
            m.final_text,
            f"{worst / 1e6:.2f} MB",
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            f"{m.wire_bytes_per_sample / 1e3:.1f}",
            stale or "n/a (no PS)",
        ]
        if budget:
            within = "yes" if worst <= budget.budget_bytes else "**no: exceeded**"
            row += [str(r.batch), f"{r.lr:g}", within]
        rows.append(row)
    return rows


def format_table(results: list[ModeResult], target: float, budget: BudgetPlan | None = None) -> str:
    metric = _metric(results)
    header = [c.format(target=format_target(metric, target), metric=metric) for c in COLUMNS]
    header += BUDGET_COLUMNS if budget else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results, target, budget)]
    return "\n".join(lines)


def _metric(results: list[ModeResult]) -> str:
    """The job's headline metric, as the runs recorded it (all modes run the same job)."""
    return next((r.figures.metric for r in results if r.figures), "accuracy")


def _why(name: str, m: RunFigures) -> str:
    """Where a mode's step time goes, from its records (means per step and wave or rank)."""
    t = dict(m.step_means)
    if not t:
        return ""
    held = t.pop("bound_wait_s", 0.0)  # inside push+pull: not a part of its own
    parts = []
    for k, v in t.items():
        part = f"{k.removesuffix('_s').replace('_', ' ')} {1000 * v:.1f} ms"
        if k == "push_pull_s" and held >= 0.0005:
            # under wave turns most of it is the other waves' turn, not the parameter server
            part += (
                f" ({1000 * held:.1f} of them held at the shards until other waves' updates "
                "were in: the turn order or the staleness bound)"
            )
        parts.append(part)
    return f"`{name}` per step: " + ", ".join(parts)


def verdict(results: list[ModeResult], target: float, budget: BudgetPlan | None) -> list[str]:
    """The report's first lines: who won on throughput and on time to accuracy, by how much,
    and why, in words, from the records."""
    ok = [r for r in results if r.ok and r.figures]
    if not ok:
        return ["No mode finished."]
    lines = []
    at = ""
    if budget:
        at = (
            f" at {budget.budget.describe()} ({budget.budget_bytes / 1e6:.2f} MB) of activations "
            "per device"
        )
    fast = sorted(ok, key=lambda r: -r.figures.samples_per_s)
    best = fast[0]
    if len(fast) > 1:
        second = fast[1]
        lines.append(
            f"Throughput{at}: `{best.name}` won with {best.figures.samples_per_s:.0f} samples/s, "
            f"{best.figures.samples_per_s / max(second.figures.samples_per_s, 1e-9):.2f}x "
            f"`{second.name}` ({second.figures.samples_per_s:.0f})."
        )
    reached = sorted(
        (r for r in ok if r.figures.time_to_target_s is not None),
        key=lambda r: r.figures.time_to_target_s,
    )
    goal = format_target(_metric(results), target)
    if reached:
        first = reached[0]
        line = f"Time to {goal}: `{first.name}` first, after {first.figures.time_to_target_s:.1f} s"
        if len(reached) > 1:
            line += (
                f"; `{reached[1].name}` after {reached[1].figures.time_to_target_s:.1f} s "
                f"({reached[1].figures.time_to_target_s / first.figures.time_to_target_s:.2f}x)"
            )
        missed = [r.name for r in ok if r.figures.time_to_target_s is None]
        lines.append(line + (f"; not reached by {', '.join(missed)}." if missed else "."))
    else:
        lines.append(f"No mode reached {goal} on the test set.")
    by_name = {r.name: r for r in ok}
    allreduce = [r for r in ok if MODES[r.name].allreduce]
    if "ticktock" in by_name and allreduce:
        rival = max(allreduce, key=lambda r: r.figures.samples_per_s)
        tt = by_name["ticktock"]
        lines.append(
            f"Tick-tock against the best all-reduce variant (`{rival.name}`): "
            f"{tt.figures.samples_per_s / max(rival.figures.samples_per_s, 1e-9):.2f}x its "
            "samples/s."
        )
    if line := _tick_tock_to_target(ok, goal):
        lines.append(line)
    why = [_why(r.name, r.figures) for r in fast[:3]]
    lines += ["Why: " + "; ".join(w for w in why if w) + "."] if any(why) else []
    failed = [r for r in results if not r.ok]
    for r in failed:
        lines.append(f"`{r.name}` did not run: {r.error}")
    return lines


def _tick_tock_to_target(ok: list[ModeResult], goal: str) -> str:
    """The earliest tick-tock mode (two waves taking turns, any update rule) against the
    earliest all-reduce variant, in time to the target; "" unless both kinds ran."""

    def earliest(runs: list[ModeResult]) -> ModeResult | None:
        done = [r for r in runs if r.figures.time_to_target_s is not None]
        return min(done, key=lambda r: r.figures.time_to_target_s, default=None)

    ticktock = [
        r
        for r in ok
        if not MODES[r.name].allreduce
        and MODES[r.name].launch.get("schedule") == "ticktock"
        and MODES[r.name].job.get("waves") == 2
    ]
    allreduce = [r for r in ok if MODES[r.name].allreduce]
    if not ticktock or not allreduce:
        return ""
    tt, ar = earliest(ticktock), earliest(allreduce)
    if tt is None:
        return f"Time to {goal}: no tick-tock mode reached it."
    if ar is None:
        return f"Time to {goal}: `{tt.name}` reached it, no all-reduce variant did."
    tt_s, ar_s = tt.figures.time_to_target_s, ar.figures.time_to_target_s
    return (
        f"Time to {goal}, tick-tock against all-reduce: `{tt.name}` after {tt_s:.1f} s, "
        f"`{ar.name}` after {ar_s:.1f} s ({tt_s / ar_s:.2f}x)."
    )


def write_report(
    results: list[ModeResult], out: Path, target: float, budget: BudgetPlan | None = None
) -> None:
    ok = {r.name: r.figures for r in results if r.ok and r.figures}
    accuracy_vs_time(ok, out / "accuracy.png", target)
    memory_timelines(
        {n: m for n, m in ok.items() if n in ("ticktock", "together")}, out / "memory.png"
    )
    (out / "metrics.json").write_text(
        json.dumps(
            {
                r.name: (
                    {**r.figures.to_json(), "batch": r.batch, "lr": r.lr}
                    if r.figures
                    else {"error": r.error}
                )
                for r in results
            },
            indent=1,
        )
    )
    modes = "\n".join(f"- `{r.name}`: {MODES[r.name].description}" for r in results)
    budget_note = ""
    if budget:
        budget_note = (
            f"Memory budget: {budget.budget.describe()}, {budget.budget_bytes / 1e6:.2f} MB of "
            "saved activations per device. Each mode ran at the largest batch per task (wave or "
            "rank) whose device peak, measured by probe forwards times the tasks a device holds "
            "at once, fits it; the learning rate follows the samples per update "
            f"({budget.lr_rule} scaling, scripts/budget.py). *within budget* compares the peak "
            "the run really reached with the budget.\n\n"
        )
    (out / "report.md").write_text(
        "# wavelet compare\n\n"
        + "\n".join(verdict(results, target, budget))
        + f"\n\n{format_table(results, target, budget)}\n\n{modes}\n\n{budget_note}"
        "Peak activations: saved-activation bytes of all waves (or ranks) of a device summed on "
        "one clock; *vs one wave*: that peak over the largest single wave's peak. Wire bytes: "
        "tensor bytes put on the network per training sample (PS: push and pull; all-reduce: "
        "what a ring all-reduce sends). Raw records: `<mode>/records/`; numbers: metrics.json.\n\n"
        "![accuracy](accuracy.png)\n\n![memory](memory.png)\n"
    )
