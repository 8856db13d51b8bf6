"""``wavelet tune``: sweep staleness bounds, stale-gradient policies and update rules on one job.

Every setting runs as a real job under the same budget, optionally with one wave slowed down to
play a straggler. Writes ``report.md`` (a table and a recommendation), ``accuracy.png``,
``metrics.json`` and every setting's run directory with its raw records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
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
    mode: str = "ps"  # allreduce: all-reduce, the reference every sweep runs

    @property
    def name(self) -> str:
        if self.mode == "allreduce":
            return "all-reduce"
        if self.updates == "auto":
            return "default (auto)"
        if self.updates in GROUPED_UPDATES:
            return self.updates  # its own turn order, no bound, no policy
        return f"s={_bound(self.bound)} {self.policy}"

    @property
    def flags(self) -> str:
        """The flags that ask for this setting (to copy into a command line)."""
        if self.mode == "allreduce":
            return "--mode allreduce"
        if self.updates == "auto":
            return "(none: the default, --updates auto)"
        if self.updates in GROUPED_UPDATES:
            return f"--updates {self.updates}"
        return f"--updates async --staleness {_bound(self.bound)} --stale-policy {self.policy}"

    @property
    def reference(self) -> bool:
        return self.mode == "allreduce" or self.updates == "auto"


DEFAULT = Setting(1, "scale", "auto")  # the job's default rule, as launch decides it
ALLREDUCE = Setting(1, "scale", "async", "allreduce")


@dataclasses.dataclass
class SettingResult:
    setting: Setting
    figures: RunFigures | None = None
    error: str = ""
    interrupted: bool = False  # Ctrl-C stopped it, and the sweep with it
    seed: int = 0


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


def parse_seeds(text: str) -> list[int]:
    """``0,1`` -> [0, 1]; anything else is a ConfigError."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds):
        raise ConfigError(f"--seeds {text!r}: give seeds >= 0, comma-separated, e.g. 0,1")
    return seeds


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


def with_references(settings: list[Setting]) -> list[Setting]:
    """``settings`` with the default rule and all-reduce beside them (once each)."""
    names = {s.name for s in settings}
    return [*settings, *(r for r in (DEFAULT, ALLREDUCE) if r.name not in names)]


def tune(
    job: JobConfig,
    devices: list[str],
    settings: list[Setting],
    out: Path,
    target: float,
    fork_server: ForkServer | None = None,
    seeds: list[int] | None = None,
) -> list[SettingResult]:
    """Run ``job`` with each setting, once per seed (rounds of every setting, so that the
    machine's drift hits all alike); every run's daemons fork from ``fork_server`` (the
    caller's), else from one started here."""
    out.mkdir(parents=True, exist_ok=True)
    with shared_fork_server("fork", fork_server) as server:
        return _tune(job, devices, settings, out, target, server, seeds or [job.seed])


def _tune(
    job: JobConfig,
    devices: list[str],
    settings: list[Setting],
    out: Path,
    target: float,
    server: ForkServer | None,
    seeds: list[int],
) -> list[SettingResult]:
    results = []
    runs = [(seed, i, s) for seed in seeds for i, s in enumerate(settings)]
    for seed, i, setting in runs:
        label = setting.name.replace("=", "").replace(" ", "-").replace("(", "").replace(")", "")
        run_dir = out / f"{i:02d}-{label}" / f"seed{seed}"
        print(f"== {setting.name}, seed {seed}", flush=True)
        try:
            result = _run(job, devices, setting, seed, run_dir, target, server)
            results.append(result)
            if result.figures is not None:
                print(f"   {result.figures.one_line()}", flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops the sweep, not only this setting
            why = "interrupted (Ctrl-C); the settings after it did not run"
            results.append(SettingResult(setting, error=why, interrupted=True, seed=seed))
            print(f"   {why}", flush=True)
            break
        except Exception as e:  # a failed setting is a row, not a lost sweep
            (out / f"{i:02d}-seed{seed}.error.txt").write_text(traceback.format_exc())
            results.append(SettingResult(setting, error=f"{type(e).__name__}: {e}", seed=seed))
    write_report(results, out, target, job)
    return results


def _run(job, devices, setting: Setting, seed: int, run_dir: Path, target: float, server):
    if setting.mode == "allreduce" or setting.updates == "auto":
        cfg = dataclasses.replace(job, seed=seed)  # the job as its user wrote it
    else:
        cfg = dataclasses.replace(
            job,
            staleness=setting.bound,
            stale_policy=setting.policy,
            updates=setting.updates,
            seed=seed,
        )
    config = LaunchConfig(job=cfg, devices=devices, run_dir=str(run_dir), mode=setting.mode)
    code = launch(config, quiet=True, fork_server=server)
    if code == INTERRUPTED:
        raise KeyboardInterrupt
    if code != 0:
        why = f"exited with {code}; see {run_dir}/logs"
        return SettingResult(setting, error=why, seed=seed)
    return SettingResult(setting, run_figures(run_dir, target), seed=seed)


@dataclasses.dataclass
class Aggregate:
    """One setting over its seeds."""

    setting: Setting
    runs: list[SettingResult]

    @property
    def figures(self) -> list[RunFigures]:
        return [r.figures for r in self.runs if r.figures is not None]

    @property
    def reached_all(self) -> bool:
        f = self.figures
        return bool(f) and len(f) == len(self.runs) and all(x.time_to_target_s for x in f)

    def times(self) -> list[float]:
        return [x.time_to_target_s for x in self.figures if x.time_to_target_s is not None]

    def finals(self) -> list[float]:
        return [x.final_score for x in self.figures if x.final_score is not None]

    def speeds(self) -> list[float]:
        return [x.samples_per_s for x in self.figures]


def aggregate(results: list[SettingResult]) -> list[Aggregate]:
    """The runs of each setting together, in the order the settings first ran."""
    out: dict[str, Aggregate] = {}
    for r in results:
        out.setdefault(r.setting.name, Aggregate(r.setting, [])).runs.append(r)
    return list(out.values())


def recommend(results: list[SettingResult]) -> tuple[Aggregate, Aggregate | None, str, bool]:
    """The setting to use (all-reduce is a reference, not a pick), its runner-up, why, and
    whether the two tie: best median time to the target among settings that reached it in every
    seed, else the best median final value (higher or lower, as the job's target_mode says). A
    difference no larger than the spread between seeds is a tie."""
    candidates = [a for a in aggregate(results) if a.figures and a.setting.mode != "allreduce"]
    if not candidates:
        raise ValueError("no setting finished")
    reached = [a for a in candidates if a.reached_all]
    if reached:
        ranked = sorted(reached, key=lambda a: statistics.median(a.times()))
        best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        if second is None:
            return best, None, "the only setting that reached the target in every seed", False
        gap = statistics.median(second.times()) - statistics.median(best.times())
        spread = max(_spread(best.times()), _spread(second.times()))
        if gap <= spread:
            return best, second, _tie(f"{gap:.2f} s apart at the median", spread, "s"), True
        why = f"{gap:.2f} s sooner to the target at the median than the runner-up"
        return best, second, why + _beyond(spread, "s"), False
    sign = 1 if candidates[0].figures[0].metric_mode == "max" else -1
    ranked = sorted(
        candidates,
        key=lambda a: (-sign * statistics.median(a.finals()) if a.finals() else math.inf,
                       -statistics.median(a.speeds())),
    )  # fmt: skip
    best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    if second is None:
        return best, None, "no setting reached the target; the only one that finished", False
    metric = best.figures[0].metric
    gap = abs(statistics.median(best.finals() or [0]) - statistics.median(second.finals() or [0]))
    spread = max(_spread(best.finals()), _spread(second.finals()))
    if gap <= spread:
        why = f"no setting reached the target and the best ones tie on final {metric}"
        why = _tie(why, spread, "", metric == "accuracy")
        fast, slow = statistics.median(best.speeds()), statistics.median(second.speeds())
        if fast > slow:
            why += f"; this one trained faster ({fast:.0f} against {slow:.0f} samples/s)"
        return best, second, why, True
    better = (
        f"{100 * gap:.2f} points more final accuracy"
        if metric == "accuracy"
        else f"a final {metric} better by {gap:.4g}"
    )
    why = f"no setting reached the target; {better} at the median than the runner-up"
    return best, second, why + _beyond(spread, "points" if metric == "accuracy" else ""), False


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if len(values) > 1 else 0.0


def _tie(why: str, spread: float, unit: str, percent: bool = False) -> str:
    if spread == 0:
        return f"{why} (a tie)"
    shown = f"{100 * spread:.2f} points" if percent else f"{spread:.2f} {unit}".strip()
    return f"{why}, within the spread between seeds ({shown}): a tie"


def _beyond(spread: float, unit: str) -> str:
    return f", more than the spread between seeds ({spread:.2f} {unit})".rstrip() if spread else ""


def _median_range(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mid = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return mid
    return f"{mid} ({min(values):.{digits}f}-{max(values):.{digits}f})"


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
    for a in aggregate(results):
        s, figures = a.setting, a.figures
        # a grouped rule, the default and all-reduce have no bound and policy of their own:
        # their name stands in their place
        named = s.updates in GROUPED_UPDATES or s.reference
        bound, policy = ("-", s.name) if named else (_bound(s.bound), s.policy)
        if not figures:
            lines.append(f"| {bound} | {policy} | failed: {a.runs[0].error} |" + " |" * 6)
            continue
        times = a.times()
        ttt = _median_range(times, 2)
        if len(times) < len(a.runs):
            ttt = f"{ttt}; reached {len(times)}/{len(a.runs)}" if times else "not reached"
        waves = [w for f in figures for w in f.staleness.values()]
        mean = sum(w["mean"] for w in waves) / len(waves) if waves else 0.0
        p99 = max((w["p99"] for w in waves), default=0)
        dropped = sum(w["dropped"] for w in waves)
        wait = statistics.median(f.bound_wait_s for f in figures)
        finals = [f.final_text for f in figures]
        final = finals[0] if len(set(finals)) == 1 else _median_range(a.finals(), 3)
        lines.append(
            f"| {bound} | {policy} | {_median_range(a.speeds(), 0)} | {ttt} | {final} "
            f"| {mean:.2f} | {p99} | {dropped} | {wait:.2f} |"
        )
    return "\n".join(lines)


def format_recommendation(results: list[SettingResult]) -> str:
    try:
        best, second, why, tie = recommend(results)
    except ValueError:
        return "No recommendation: no setting finished."
    if tie:
        text = (
            f"Tie: **{best.setting.name}** and **{second.setting.name}** ({why}); either will "
            f"do: `{best.setting.flags}` or `{second.setting.flags}`"
        )
    else:
        text = f"Recommended: **{best.setting.name}** ({why}): `{best.setting.flags}`"
        if second is not None:
            text += f"; runner-up: {second.setting.name}"
    reference = next((a for a in aggregate(results) if a.setting.mode == "allreduce"), None)
    if reference is not None and reference.times():
        text += (
            f". All-reduce (the reference) reached the target after "
            f"{statistics.median(reference.times()):.2f} s at the median"
        )
    return text + "."


def write_report(results: list[SettingResult], out: Path, target: float, job: JobConfig) -> None:
    aggs = aggregate(results)
    # the plot: each setting's first seed (the others are in metrics.json)
    firsts = {a.setting.name: a.figures[0] for a in aggs if a.figures}
    accuracy_vs_time(firsts, out / "accuracy.png", target)
    (out / "metrics.json").write_text(
        json.dumps(
            [
                {
                    "setting": r.setting.name,
                    "flags": r.setting.flags,
                    "seed": r.seed,
                    "bound": _bound(r.setting.bound),
                    "policy": r.setting.policy,
                    "updates": r.setting.updates,
                    "mode": r.setting.mode,
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
    seeds = sorted({r.seed for r in results})
    plots = ["![accuracy](accuracy.png)", ""]
    for a in aggs:  # every setting's staleness histograms, where its run drew them
        for r in a.runs:
            path = _staleness_plot(out, r)
            if path:
                plots.append(f"- {a.setting.name}, seed {r.seed}: [staleness]({path})")
    (out / "report.md").write_text(
        f"# wavelet tune\n\n{job.model} on {job.dataset}, {budget}, {straggler}, seeds "
        f"{', '.join(map(str, seeds))}.\n\n"
        f"{format_table(results, target)}\n\n{format_recommendation(results)}\n\n"
        "Each cell is the median over the seeds (the range in brackets); a difference within "
        "the spread between seeds is a tie. The default rule (`--updates auto`) and all-reduce "
        "always run as references; all-reduce is no pick. Under s = 0 every policy is the same "
        "(all gradients have staleness 0), so it runs once; wave groups and turns run once "
        "(their turn order is their bound). Raw records: each setting's `records/`; numbers: "
        "metrics.json.\n\n" + "\n".join(plots) + "\n"
    )


def _staleness_plot(out: Path, r: SettingResult) -> str:
    if r.figures is None:
        return ""
    path = Path(r.figures.run_dir) / "staleness.png"
    return str(path.relative_to(out)) if path.exists() and out in path.parents else ""


def _bound(b: float) -> str:
    return "inf" if math.isinf(b) else str(int(b))
