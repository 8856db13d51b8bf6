"""All-reduce mode, ``wavelet compare`` and the memory arithmetic behind its report."""

import json
import signal

import matplotlib.image
import pytest
from conftest import ONE_SHARD, forked, run_wavelet, wait_for
from helpers import processes_mentioning

from wavelet.common.figures import RunFigures, combined_timeline, peak, run_figures
from wavelet.common.records import read_records
from wavelet.scripts.compare import COLUMNS, ModeResult, _why, verdict
from wavelet.scripts.modes import DEFAULT_MODES


def test_combined_timeline_known_answer():
    # wave a: 0 -> 10 at t=1, 4 at t=3, 0 at t=5; wave b: 6 at t=2, 12 at t=4, 0 at t=6
    a = [(1.0, 10), (3.0, 4), (5.0, 0)]
    b = [(2.0, 6), (4.0, 12), (6.0, 0)]
    both = combined_timeline([a, b])
    assert both == [(1.0, 10), (2.0, 16), (3.0, 10), (4.0, 16), (5.0, 12), (6.0, 0)]
    assert peak(both) == 16
    # perfectly interleaved waves never stack; waves started together do
    tick = [(0, 5), (1, 10), (2, 5), (3, 0)]
    tock = [(2, 5), (3, 10), (4, 5), (5, 0)]
    assert peak(combined_timeline([tick, tock])) == 10
    assert peak(combined_timeline([tick, tick])) == 20
    assert combined_timeline([]) == []


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_whole_comparison_and_reports_what_ran(tmp_path):
    out = tmp_path / "cmp"
    modes = "ticktock,allreduce"
    args = ["compare", "--epochs", "500", "--modes", modes, "--out", str(out)]
    with forked(args, tmp_path / "compare.log") as proc:
        steps = out / "ticktock" / "records" / "worker-0-wave-0.jsonl"
        wait_for(lambda: steps.exists() and steps.stat().st_size > 5000, 120, "no training")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, (tmp_path / "compare.log").read_text()[-3000:]
    report = (out / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| ticktock |"))
    assert "interrupted (Ctrl-C)" in row
    # the next mode never started, and nothing of the first is left running
    assert not (out / "allreduce").exists() and "| allreduce |" not in report
    wait_for(lambda: not processes_mentioning(str(out)), 15, "daemons left behind")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_allreduce_mode_trains_digits_with_two_ranks(tmp_path):
    run_dir = tmp_path / "ar"
    done = run_wavelet(
        "launch",
        "--mode",
        "allreduce",
        "--processes-per-device",
        "2",
        "--run-dir",
        str(run_dir),
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "allreduce" and summary["test_accuracy"] >= 0.97
    starts = [next(read_records(p)) for p in sorted((run_dir / "records").glob("*.jsonl"))]
    assert [s["world_size"] for s in starts] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compare_report_is_complete_and_matches_the_records(tmp_path):
    out = tmp_path / "cmp"
    # every kind of mode once (PS schedules, groups, worker processes, all-reduce), not all
    # twelve: a 16-bit all-reduce wire runs end to end in test_mixed_precision
    modes = ["ticktock", "ticktock-groups", "single", "procs", "allreduce"]
    done = run_wavelet(
        "compare", *ONE_SHARD, "--epochs", "1", "--out", str(out), "--target-acc", "0.5",
        "--modes", ",".join(modes), timeout=290,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(modes)
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == [c.format(target="50%", metric="accuracy") for c in COLUMNS]
    assert "final accuracy" in header
    rows = {
        r.strip("|").split("|")[0].strip(): [c.strip() for c in r.strip("|").split("|")]
        for r in table[2:]
    }
    assert set(rows) == set(modes) and set(modes) <= set(DEFAULT_MODES)
    assert report.splitlines()[2].startswith("Throughput: `")  # the verdict comes first
    for name, cells in rows.items():
        assert len(cells) == len(COLUMNS) and all(cells), (name, cells)
        assert "failed" not in cells, (name, cells)
    for png in ("accuracy.png", "memory.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(out / png).shape[0] > 100
    assert f"plots: {out / 'accuracy.png'}, {out / 'memory.png'}" in done.stdout  # named
    # the table's numbers come from the raw records beside it
    for name in ("ticktock", "allreduce"):
        m = run_figures(out / name, 0.5)
        assert rows[name][1] == f"{m.samples_per_s:.0f}"
        samples = sum(
            r["samples"]
            for p in (out / name / "records").glob("worker-*.jsonl")
            for r in read_records(p)
            if r["kind"] == "step"
        )
        assert samples == round(m.samples_per_s * m.train_seconds)
    stale = rows["ticktock"][7]
    assert "w0/0" in stale and "w0/1" in stale
    assert rows["single"][5] == "1.00x"  # one wave is its own peak


def test_the_verdict_sets_the_earliest_tick_tock_mode_against_the_earliest_all_reduce():
    def run(name, samples_per_s, to_target):
        figures = RunFigures(f"runs/{name}", samples_per_s, 30.0, time_to_target_s=to_target)
        return ModeResult(name, True, figures)

    results = [
        run("ticktock", 800, 20.0),
        run("bsp", 780, 12.0),
        run("single", 500, 9.0),  # one wave: not tick-tock
        run("allreduce", 810, 10.0),
        run("allreduce2", 700, None),
    ]
    lines = verdict(results, 0.6, None)
    assert lines[1].startswith("Time to 60%: `single` first, after 9.0 s")
    assert "Tick-tock against the best all-reduce variant (`allreduce`): 0.99x" in lines[2]
    assert lines[3] == (
        "Time to 60%, tick-tock against all-reduce: `bsp` after 12.0 s, `allreduce` after "
        "10.0 s (1.20x)."
    )
    late = [run("ticktock", 800, None), run("allreduce", 810, 10.0)]
    assert "Time to 60%: no tick-tock mode reached it." in verdict(late, 0.6, None)


def test_the_step_breakdown_says_how_much_of_push_pull_was_held_at_the_shards():
    # wave turns: most of a wave's push+pull is the other wave's turn, not the server
    held = RunFigures("runs/t", 100.0, 1.0, step_means={"forward_s": 0.001, "push_pull_s": 0.0119})
    held.step_means["bound_wait_s"] = 0.0102
    assert _why("ticktock", held) == (
        "`ticktock` per step: forward 1.0 ms, push pull 11.9 ms (10.2 of them held at the "
        "shards until other waves' updates were in: the turn order or the staleness bound)"
    )
    free = RunFigures("runs/s", 100.0, 1.0, step_means={"push_pull_s": 0.002, "bound_wait_s": 0})
    assert _why("single", free) == "`single` per step: push pull 2.0 ms"
