"""PNG plots for run reports (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wavelet.common.evaluation import format_target
from wavelet.common.figures import RunFigures, combined_timeline

if TYPE_CHECKING:
    import matplotlib.pyplot


def _pyplot() -> matplotlib.pyplot:
    """matplotlib on first use: the launcher and every daemon import this module, and only
    reports draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_vs_time(runs: dict[str, RunFigures], path: Path, target: float | None = None) -> None:
    """The headline metric of each run against wall time (test accuracy in %, unless the job
    names another metric)."""
    metric = next((m.metric for m in runs.values()), "accuracy")
    scale = 100 if metric == "accuracy" else 1
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, m in runs.items():
        points = [(t, v) for t, v in m.score_curve if v is not None]
        if points:
            t, a = zip(*points, strict=True)
            ax.plot(t, [scale * x for x in a], marker="o", markersize=3, label=name)
    if target is not None:
        label = f"target {format_target(metric, target)}"
        ax.axhline(scale * target, color="grey", linestyle=":", label=label)
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else f"test {metric}")
    ax.set_title(f"Test {metric} against wall time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_timelines(runs: dict[str, RunFigures], path: Path, device: str = "0") -> None:
    """Per-wave saved-activation bytes of one device, and their sum, one panel per run."""
    names = [n for n, m in runs.items() if device in m.memory_traces]
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(names) or 1, 1, figsize=(8, 2.6 * max(1, len(names))), squeeze=False
    )
    for ax, name in zip(axes[:, 0], names, strict=False):
        traces = runs[name].memory_traces[device]
        t0 = min(tr[0][0] for tr in traces.values() if tr)
        for wave, tr in sorted(traces.items()):
            ax.step(
                [t - t0 for t, _ in tr],
                [b / 1e6 for _, b in tr],
                where="post",
                label=f"wave {wave}",
                linewidth=1,
            )
        both = combined_timeline(list(traces.values()))
        ax.step(
            [t - t0 for t, _ in both],
            [b / 1e6 for _, b in both],
            where="post",
            label="combined",
            color="black",
            linewidth=1.2,
            alpha=0.6,
        )
        ax.set_title(f"{name}: saved activations on device {device}", fontsize=9)
        ax.set_ylabel("MB")
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("wall time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def staleness_histograms(staleness: dict[str, dict], path: Path) -> None:
    """One bar chart per wave: how many pushes had each staleness."""
    waves = sorted(staleness)
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, max(1, len(waves)), figsize=(3.2 * max(1, len(waves)), 3), squeeze=False
    )
    for ax, wave in zip(axes[0], waves, strict=False):
        hist = staleness[wave]["hist"]
        ax.bar([int(t) for t in hist], list(hist.values()), color="tab:blue")
        ax.set_title(f"wave {wave}: mean {staleness[wave]['mean']:.2f}", fontsize=9)
        ax.set_xlabel("staleness (updates)")
        ax.set_ylabel("pushes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
