"""``wavelet tune``: sweep staleness bounds, stale-gradient policies and update rules on one job.

Every setting runs as a real job under the same budget, optionally with one wave slowed down to
play a straggler. Writes ``report.md`` (a table and a recommendation), ``accuracy.png``,
``metrics.json`` and every setting's run directory with its raw records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from pathlib import Path

from wavelet.common.config import (
    GROUPED_UPDATES,
    STALE_POLICIES,
    UPDATES,
    JobConfig,
    async_only_defaults,
)
from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.evaluation import format_target
from wavelet.common.figures import RunFigures, run_figures
from wavelet.common.settings import INF, ConfigError
from wavelet.scripts.forkserver import ForkServer
from wavelet.scripts.launch import launch
from wavelet.scripts.plots import accuracy_vs_time
from wavelet.scripts.signals import INTERRUPTED
from wavelet.scripts.supervisor import shared_fork_server


@dataclasses.dataclass
class Setting:
    bound: float
    policy: str
    updates: str = "async"

    @property
    def name(self) -> str:
        if self.updates in GROUPED_UPDATES:
            return self.updates  # its own turn order, no bound, no policy
        return f"s={_bound(self.bound)} {self.policy}"


@dataclasses.dataclass
class SettingResult:
    setting: Setting
    figures: RunFigures | None = None
    error: str = ""
    interrupted: bool = False  # Ctrl-C stopped it, and the sweep with it


def parse_bounds(text: str) -> list[float]:
    """``0,1,inf`` -> [0, 1, inf]; anything else is a ConfigError naming the bad part."""
    bounds = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        try:
            value = INF if part in ("inf", "infinity") else float(part)
        except ValueError:
            value = math.nan
        if not (value >= 0 and (value == INF or value.is_integer())):
            raise ConfigError(f"staleness bound {part!r} must be a whole number >= 0 or inf")
        bounds.append(value)
    if not bounds:
        raise ConfigError(f"--bounds {text!r} names no bound; e.g. --bounds 0,1,4,inf")
    return bounds


def parse_policies(text: str) -> list[str]:
    """``apply,drop`` -> ["apply", "drop"]; unknown or no policy is a ConfigError."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    for p in policies:
        if p not in STALE_POLICIES:
            raise ConfigError(f"unknown policy {p!r}; choose from {', '.join(STALE_POLICIES)}")
    if not policies:
        raise ConfigError(
            f"--policies {text!r} names no policy; choose from {', '.join(STALE_POLICIES)}"
        )
    return policies


def parse_updates(text: str) -> list[str]:
    """``async,wave-turns`` -> ["async", "wave-turns"]; unknown or none is a ConfigError."""
    rules = [u.strip() for u in text.split(",") if u.strip()]
    if not rules or any(u not in UPDATES for u in rules):
        raise ConfigError(f"--update-rules {text!r}: choose from {', '.join(UPDATES)}")
    return rules


def settings_for(
    bounds: list[float], policies: list[str], updates: tuple[str, ...] = ("async",)
) -> list[Setting]:
    """Every (bound, policy) pair for asynchronous updates (under s = 0 every policy is the same,
    so it runs once), and each grouped rule once (their turn order is their bound, and they
    apply a group's mean without a policy)."""
    out = []
    unused = async_only_defaults()  # what a grouped rule leaves at its default
    if "async" in updates:
        for b in bounds:
            for p in [policies[0]] if b == 0 else policies:
                out.append(Setting(b, p))
    for rule in GROUPED_UPDATES:
        if rule in updates:
            out.append(Setting(unused["staleness"], unused["stale_policy"], rule))
    return out


def tune(
    job: JobConfig,
    devices: list[str],
    settings: list[Setting],
    out: Path,
    target: float,
    fork_server: ForkServer | None = None,
) -> list[SettingResult]:
    """Run ``job`` with each setting; every run's daemons fork from ``fork_server`` (the
    caller's), else from one started here."""
    out.mkdir(parents=True, exist_ok=True)
    with shared_fork_server("fork", fork_server) as server:
        return _tune(job, devices, settings, out, target, server)


def _tune(
    job: JobConfig,
    devices: list[str],
    settings: list[Setting],
    out: Path,
    target: float,
    server: ForkServer | None,
) -> list[SettingResult]:
    results = []
    for i, setting in enumerate(settings):
        label = setting.name.replace("=", "").replace(" ", "-")
        run_dir = out / f"{i:02d}-{label}"
        print(f"== {setting.name}", flush=True)
        try:
            cfg = dataclasses.replace(
                job,
                staleness=setting.bound,
                stale_policy=setting.policy,
                updates=setting.updates,
            )
            config = LaunchConfig(job=cfg, devices=devices, run_dir=str(run_dir))
            code = launch(config, quiet=True, fork_server=server)
            if code == INTERRUPTED:
                raise KeyboardInterrupt
            if code != 0:
                results.append(
                    SettingResult(setting, error=f"exited with {code}; see {run_dir}/logs")
                )
                continue
            results.append(SettingResult(setting, run_figures(run_dir, target)))
            print(f"   {results[-1].figures.one_line()}", flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops the sweep, not only this setting
            why = "interrupted (Ctrl-C); the settings after it did not run"
            results.append(SettingResult(setting, error=why, interrupted=True))
            print(f"   {why}", flush=True)
            break
        except Exception as e:  # a failed setting is a row, not a lost sweep
            (out / f"{run_dir.name}.error.txt").write_text(traceback.format_exc())
            results.append(SettingResult(setting, error=f"{type(e).__name__}: {e}"))
    write_report(results, out, target, job)
    return results


def recommend(results: list[SettingResult]) -> tuple[SettingResult, SettingResult | None, str]:
    """Best time to the target of the headline metric; if no setting reached it, the best final
    value (higher or lower, as the job's target_mode says)."""
    ok = [r for r in results if r.figures is not None]
    if not ok:
        raise ValueError("no setting finished")
    reached = [r for r in ok if r.figures.time_to_target_s is not None]
    if reached:
        ranked = sorted(reached, key=lambda r: r.figures.time_to_target_s)
        best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        if second is None:
            return best, None, "the only setting that reached the target"
        margin = second.figures.time_to_target_s - best.figures.time_to_target_s
        return best, second, f"{margin:.2f}s sooner to the target than the runner-up"
    ranked = sorted(ok, key=_final_rank)
    best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    if second is None:
        return best, None, "no setting reached the target; the only one that finished"
    metric = best.figures.metric
    diff = abs((best.figures.final_score or 0) - (second.figures.final_score or 0))
    if diff == 0:  # the faster of the two, where speed tells them apart
        why = f"no setting reached the target and the best ones tie on final {metric}"
        fast, slow = best.figures.samples_per_s, second.figures.samples_per_s
        if fast > slow:
            why += f"; this one trained faster ({fast:.0f} against {slow:.0f} samples/s)"
        return best, second, why
    better = (
        f"{100 * diff:.2f} points more final accuracy"
        if metric == "accuracy"
        else f"a final {metric} better by {diff:.4g}"
    )
    return best, second, f"no setting reached the target; {better} than the runner-up"


def _final_rank(r: SettingResult) -> tuple[float, float]:
    """Sort key: the best final value first (a run without one last), then the most samples/s."""
    m = r.figures
    if m is None or m.final_score is None:
        return float("inf"), 0.0
    return (-m.final_score if m.metric_mode == "max" else m.final_score), -m.samples_per_s


def format_table(results: list[SettingResult], target: float) -> str:
    metric = next((r.figures.metric for r in results if r.figures), "accuracy")
    head = [
        "bound",
        "policy",
        "samples/s",
        f"time to {format_target(metric, target)} (s)",
        f"final {metric}",
        "staleness mean",
        "staleness p99",
        "dropped",
        "bound wait (s)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s, m = r.setting, r.figures
        # a grouped rule has no bound and no policy of its own: its name stands in their place
        grouped = s.updates in GROUPED_UPDATES
        bound, policy = ("-", s.updates) if grouped else (_bound(s.bound), s.policy)
        if m is None:
            lines.append(f"| {bound} | {policy} | failed: {r.error} |" + " |" * 6)
            continue
        waves = m.staleness.values()
        mean = sum(w["mean"] for w in waves) / len(waves) if waves else 0.0
        p99 = max((w["p99"] for w in waves), default=0)
        dropped = sum(w["dropped"] for w in waves)
        ttt = f"{m.time_to_target_s:.2f}" if m.time_to_target_s is not None else "not reached"
        lines.append(
            f"| {bound} | {policy} | {m.samples_per_s:.0f} | {ttt} | {m.final_text} "
            f"| {mean:.2f} | {p99} | {dropped} | {m.bound_wait_s:.2f} |"
        )
    return "\n".join(lines)


def format_recommendation(results: list[SettingResult]) -> str:
    try:
        best, second, why = recommend(results)
    except ValueError:
        return "No recommendation: no setting finished."
    text = f"Recommended: **{best.setting.name}** ({why})"
    if second is not None:
        text += f"; runner-up: {second.setting.name}"
    return text + "."


def write_report(results: list[SettingResult], out: Path, target: float, job: JobConfig) -> None:
    ok = {r.setting.name: r.figures for r in results if r.figures is not None}
    accuracy_vs_time(ok, out / "accuracy.png", target)
    (out / "metrics.json").write_text(
        json.dumps(
            [
                {
                    "bound": _bound(r.setting.bound),
                    "policy": r.setting.policy,
                    "updates": r.setting.updates,
                    **(r.figures.to_json() if r.figures else {"error": r.error}),
                }
                for r in results
            ],
            indent=1,
        )
    )
    straggler = (
        f"wave {job.slow_wave} slowed {job.slow_factor:g}x"
        if job.slow_wave >= 0
        else "no straggler"
    )
    budget = f"{job.epochs} epochs" if job.epochs else f"{job.max_seconds:g} s"
    (out / "report.md").write_text(
        f"# wavelet tune\n\n{job.model} on {job.dataset}, {budget}, {straggler}.\n\n"
        f"{format_table(results, target)}\n\n{format_recommendation(results)}\n\n"
        "Under s = 0 every policy is the same (all gradients have staleness 0), so it runs once; "
        "wave groups run once (their turn order is their bound, and they apply each group's "
        "mean). "
        "Raw records: each setting's `records/`; numbers: metrics.json.\n\n"
        "![accuracy](accuracy.png)\n"
    )


def _bound(b: float) -> str:
    return "inf" if math.isinf(b) else str(int(b))
