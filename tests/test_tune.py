"""``wavelet tune`` on a tiny sweep: a complete table, a plot, and a consistent recommendation."""

import signal

import matplotlib.image
import pytest
from conftest import ONE_SHARD, forked, run_wavelet, wait_for
from helpers import processes_mentioning

from wavelet.common.figures import RunFigures
from wavelet.common.settings import ConfigError
from wavelet.scripts.tune import (
    Setting,
    SettingResult,
    format_recommendation,
    format_table,
    parse_updates,
    recommend,
    settings_for,
)


def test_settings_skip_policies_under_bulk_synchronous():
    got = [(s.bound, s.policy) for s in settings_for([0, 2], ["apply", "drop"])]
    assert got == [(0, "apply"), (2, "apply"), (2, "drop")]


def _result(name, ttt, acc, samples_per_s=100.0, seed=0, mode="ps"):
    figures = RunFigures("x", time_to_target_s=ttt, final_score=acc, samples_per_s=samples_per_s)
    return SettingResult(Setting(1, name, mode=mode), figures, seed=seed)


def test_recommendation_prefers_time_to_target_then_final_score():
    best, second, why, tie = recommend(
        [_result("a", 3.0, 0.98), _result("b", 2.0, 0.97), _result("c", None, 0.99)]
    )
    assert best.setting.policy == "b" and second.setting.policy == "a" and not tie
    assert "1.00 s sooner" in why
    best, second, why, _ = recommend([_result("a", None, 0.90), _result("b", None, 0.95)])
    assert best.setting.policy == "b" and "no setting reached" in why
    _, _, why, tie = recommend([_result("a", None, 0.90), _result("b", None, 0.90)])
    assert tie and "tie" in why and "faster" not in why
    # a tie on the final score goes to the faster setting
    best, _, why, _ = recommend([_result("a", None, 0.9, 1415.0), _result("b", None, 0.9, 1870.0)])
    assert best.setting.policy == "b" and "tie" in why and "1870 against 1415" in why


def test_a_difference_within_the_spread_between_seeds_is_a_tie():
    noisy = [_result("a", 1.0, 0.9, seed=0), _result("a", 3.0, 0.9, seed=1)]
    steady = [_result("b", 2.5, 0.9, seed=0), _result("b", 2.7, 0.9, seed=1)]
    best, second, why, tie = recommend(noisy + steady)
    assert tie and "within the spread between seeds (2.00 s)" in why
    assert "Tie: **s=1 a** and **s=1 b**" in format_recommendation(noisy + steady)
    fast = [_result("c", 1.0, 0.9, seed=0), _result("c", 1.1, 0.9, seed=1)]
    slow = [_result("d", 2.0, 0.9, seed=0), _result("d", 2.1, 0.9, seed=1)]
    best, _, why, tie = recommend(fast + slow)
    assert best.setting.policy == "c" and not tie and "more than the spread" in why
    text = format_recommendation(fast + slow)
    assert "`--updates async --staleness 1 --stale-policy c`" in text


def test_all_reduce_is_a_reference_never_the_pick():
    results = [_result("a", 2.0, 0.9), _result("x", 1.0, 0.9, mode="allreduce")]
    best, _, _, _ = recommend(results)
    assert best.setting.policy == "a"
    assert "All-reduce (the reference) reached the target after 1.00 s" in format_recommendation(
        results
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_sweep_produces_a_complete_report(tmp_path):
    out = tmp_path / "tune"
    done = run_wavelet(
        "tune",
        *ONE_SHARD,
        "--bounds",
        "0,inf",
        "--policies",
        "apply,drop",
        "--epochs",
        "2",
        "--set",
        "slow_wave=1",
        "--set",
        "slow_factor=2",
        "--target-acc",
        "0.6",
        "--seeds",
        "0",
        "--out",
        str(out),
        timeout=290,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    rows = [r for r in report.splitlines() if r.startswith("|")][2:]
    assert [r.split("|")[1:3] for r in rows] == [
        [" 0 ", " apply "],
        [" inf ", " apply "],
        [" inf ", " drop "],
        [" - ", " default (auto) "],  # the references, always
        [" - ", " all-reduce "],
    ]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len(cells) == 9 and all(cells) and "failed" not in r
    assert "wave 1 slowed 2x" in report
    # the recommendation names the row with the best time to target, all-reduce aside, with
    # the flags to copy
    times = {" ".join(c.strip() for c in r.split("|")[1:3]): r.split("|")[4].strip() for r in rows}
    reached = {
        k: float(v) for k, v in times.items() if v != "not reached" and "all-reduce" not in k
    }
    assert reached, times
    best = min(reached, key=reached.get)
    name = best.split(" ", 1)[1] if best.startswith("-") else f"s={best}"
    assert f"Recommended: **{name}**" in report or f"Tie: **{name}**" in report, report
    assert "`" in report.split("Recommended" if "Recommended" in report else "Tie")[1]
    assert matplotlib.image.imread(out / "accuracy.png").shape[0] > 100
    # the terminal names the plot; the report links it and every setting's staleness histograms
    assert f"plot: {out / 'accuracy.png'}" in done.stdout
    assert "![accuracy](accuracy.png)" in report and "[staleness](" in report


def test_wave_groups_run_once_beside_the_async_sweep():
    got = [s.name for s in settings_for([1, float("inf")], ["apply"], ("async", "wave-groups"))]
    assert got == ["s=1 apply", "s=inf apply", "wave-groups"]
    assert [s.name for s in settings_for([0], ["apply"], ("wave-groups",))] == ["wave-groups"]
    turns = settings_for([1], ["apply"], ("wave-turns", "wave-groups"))
    assert [s.name for s in turns] == ["wave-groups", "wave-turns"]
    with pytest.raises(ConfigError, match="update-rules"):
        parse_updates("async,sometimes")


def test_a_grouped_rule_names_itself_in_the_table_instead_of_a_bound_and_policy():
    rows = format_table(
        [
            SettingResult(Setting(1, "scale"), error="boom"),
            SettingResult(Setting(1, "apply", "wave-turns"), error="boom"),
        ],
        0.9,
    ).splitlines()[2:]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " scale "], [" - ", " wave-turns "]]


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_whole_sweep_and_reports_what_ran(tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--bounds", "1,2", "--epochs", "500", "--out", str(out)]
    with forked(args, tmp_path / "tune.log") as proc:
        first = "00-*/seed*/records/worker-0-wave-0.jsonl"  # the first setting's first seed
        wait_for(lambda: list(out.glob(first)), 120, "no training")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, (tmp_path / "tune.log").read_text()[-3000:]
    report = (out / "report.md").read_text()
    assert "interrupted (Ctrl-C)" in report
    assert not list(out.glob("01-*"))  # the next setting never started
    wait_for(lambda: not processes_mentioning(str(out)), 15, "daemons left behind")
