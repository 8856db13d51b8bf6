"""benchmarks/cluster.py keeps working: two emulated nodes (network namespaces it makes and
removes, a shaped link), a PS mode and all-reduce, a few seconds each, one report. Needs root and
`ip`/`tc`; skipped otherwise. No traffic leaves the namespaces."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_benchmark


def _namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_two_emulated_nodes_run_every_mode_and_report(tmp_path):
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs root, ip and tc")
    before = _namespaces()
    out = tmp_path / "cluster"
    done = run_benchmark(
        "cluster.py",
        *[
            "--config",
            "",
            "--rates",
            "100mbit",
            "--modes",
            "ticktock,allreduce",
            "--seconds",
            "4",
            "--target-acc",
            "0.5",
            "--grace-s",
            "150",
            "--out",
            str(out),
            # a busy machine can make one node look slow: its shard would move, and the
            # transports checked below with it
            "--",
            "--move-slow-shards",
            "false",
        ],  # fmt: skip
        timeout=270,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _namespaces() == before  # removed what it made
    results = {r["mode"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(results) == {"ticktock", "allreduce"}
    for mode, r in results.items():
        assert "error" not in r, (mode, r)
        assert r["samples_per_s"] > 0 and r["final_score"] is not None, (mode, r)
        assert r["link_bytes_per_sample"] > 0, (mode, r)  # they talked over the link
    # each node reached its own shard through its own /dev/shm, the other's over TCP
    summary = json.loads(
        (out / "100mbit" / "ticktock" / "seed0" / "node0" / "summary.json").read_text()
    )
    assert all(w["transport"] == "shm+tcp" for w in summary["waves"].values()), summary["waves"]
    assert results["ticktock"]["shard_apply_ms"] > 0
    report = (out / "report.md").read_text()
    assert "| ticktock |" in report and "| allreduce |" in report and "## 100mbit" in report
    # the records of a real run hold what benchmarks/turn_waits.py reads
    run = out / "100mbit" / "ticktock" / "seed0"
    waits = run_benchmark("turn_waits.py", str(run), timeout=60)
    assert waits.returncode == 0, waits.stderr
    rows = [line.split("|") for line in waits.stdout.splitlines() if re.match(r"\| w\d", line)]
    assert [r[1].strip() for r in rows] == ["w0", "w1"], waits.stdout
    assert all(int(r[4]) > 0 for r in rows), waits.stdout  # turns both nodes pushed
    assert all(float(r[5]) > 0 for r in rows), waits.stdout  # hand-overs from real records


def _benchmark(name: str):
    """A module of benchmarks/ (not a package), imported by name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_modes_that_average_more_samples_scale_the_jobs_learning_rate():
    cluster = _benchmark("cluster_modes")
    config = str(ROOT / "configs" / "narrow_resnet.toml")
    assert cluster.job_lr(config, []) == 0.05  # the config file's
    assert cluster.job_lr(config, ["--staleness", "0", "--lr", "0.3"]) == 0.3  # the flag wins
    assert cluster.job_lr(None, []) == 0.05  # the default job's
    # bsp averages the 4 waves of two nodes: twice all-reduce's samples per update
    assert cluster.MODES["bsp"].lr_factor == 2.0
    assert cluster.MODES["allreduce"].lr_factor == 1.0


def test_a_seed_that_missed_the_target_counts_as_later_than_those_that_reached_it():
    cluster_report = _benchmark("cluster_report")

    def runs(*times):
        return [{"time_to_target_s": t} for t in times]

    median = cluster_report.time_to_target_median
    assert median(runs(17.1, None, 30.3)) == 30.3  # not 23.7, the reached two's
    assert median(runs(17.1, None, None)) == float("inf")  # the median run missed it
    assert median(runs(20.3, 24.9, 17.3)) == 20.3
    assert median([]) is None


def test_turn_waits_are_what_each_push_waited_for_the_last_of_its_turn(tmp_path):
    """Two workers' pushes to two shards: w1 is 0.05 s later in one turn, w0 0.02 s in the
    other; a folded push and a turn one worker missed count for nothing. Each worker's compute
    share is its waves' forward and backward seconds over the span of their steps."""
    turn_waits = _benchmark("turn_waits")

    def push(worker, clock, t, action="accumulated"):
        return {"worker": worker, "wave": 0, "clock": clock, "t": t, "action": action}

    pushes = [
        push("w0", 0, 10.0),
        push("w1", 0, 10.05),
        push("w1", 1, 11.0),
        push("w0", 1, 11.02),
        push("w1", 1, 11.5, "folded"),  # a late push into a later step: no turn of its own
        push("w0", 2, 12.0),  # w1 never pushed clock 2 here
    ]
    _write(tmp_path / "ps-0-pushes.jsonl", pushes)
    _write(tmp_path / "ps-1-takeover-pushes.jsonl", pushes[:2])
    waits = turn_waits.turn_waits(tmp_path)
    assert sorted(waits) == ["w0", "w1"]
    assert waits["w0"] == pytest.approx([0.05, 0.0, 0.05])
    assert waits["w1"] == pytest.approx([0.0, 0.02, 0.0])

    steps = [
        {"kind": "step", "t": float(t), "forward_s": 0.1, "backward_s": 0.2} for t in range(10)
    ]
    _write(tmp_path / "worker-1-wave-0.jsonl", [{"kind": "start", "t": 0.0}, *steps])
    _write(tmp_path / "worker-1-wave-1.jsonl", steps)
    # after the first SKIP_STEPS steps: 4 steps of 0.3 s in the 4 s their ends span, per wave
    assert turn_waits.compute_share(tmp_path) == pytest.approx({"w1": 2 * 4 * 0.3 / 4})


def test_a_hand_over_runs_from_the_push_that_made_the_weights_to_the_forward_that_read_them(
    tmp_path,
):
    """Two shards at version 4: w0 and w1 push a turn to both (the later push, on shard 1 by a
    standby that took it over, at 10.2); the step that read version 5 of both started its
    forward at 10.25: 0.05 s. A step that read a version no push in the records made (the
    initial weights, or one of the first SKIP_STEPS) counts for nothing."""
    turn_waits = _benchmark("turn_waits")

    def push(worker, t, version=4):
        return {"worker": worker, "wave": 0, "clock": 3, "t": t, "version": version}

    _write(tmp_path / "ps-0-pushes.jsonl", [push("w0", 10.0), push("w1", 10.1)])
    _write(tmp_path / "ps-1-takeover-pushes.jsonl", [push("w0", 10.05), push("w1", 10.2)])
    skipped = [
        {"kind": "step", "versions_read": [5, 5], "t_forward_start": 99.0}
    ] * turn_waits.SKIP_STEPS
    steps = [
        {"kind": "step", "versions_read": [5, 5], "t_forward_start": 10.25},
        {"kind": "step", "versions_read": [0, 5], "t_forward_start": 10.3},  # 0: no push made it
    ]
    _write(tmp_path / "worker-1-wave-1.jsonl", [{"kind": "start", "t": 0.0}, *skipped, *steps])
    assert turn_waits.hand_overs(tmp_path) == {"w1": pytest.approx([0.05])}


def test_cap_response_counts_each_nodes_samples_in_the_seconds_after_a_cap_comes_and_goes(
    tmp_path,
):
    """Two nodes' step records and one cap, on at t=10 and off at t=20, then another on at t=30
    that lasts past the last step: samples in the 3 s after each, summed over the nodes; the
    window that training did not outlast counts for nothing."""
    cap_response = _benchmark("cap_response")
    for node, steps in (
        (0, [(10.5, 40), (12.9, 40), (13.1, 40), (21.0, 32), (24.0, 32)]),
        (1, [(11, 8)]),
    ):
        records = tmp_path / f"node{node}" / "records"
        records.mkdir(parents=True)
        lines = [{"kind": "step", "t": t, "samples": n} for t, n in steps]
        lines.append({"kind": "eval", "t": 11.5, "score": 0.5})
        (records / "worker-0-wave-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    caps = [[1, 10.0, 20.0, 30.0], [1, 30.0, float("inf"), 30.0]]
    result = {"mode": "ticktock", "run_dir": str(tmp_path), "timeline": {"caps": caps}}
    summary = cap_response.summarize([result, {"mode": "allreduce", "error": "x"}], 3.0)
    assert summary == {"ticktock": {"on": [88], "off": [32]}}  # 40 + 8 + 40; 32; none after 30
    assert "| ticktock | 88 (88-88) | 32 (32-32) | 1 / 1 |" in cap_response.table(summary, 3.0)


def _capped_allreduce_run(run_dir, reached_at=25.0):
    """All-reduce's records on two nodes at 20 samples per node a step, a step a second while
    both are free and one every 2 s while node 1 is capped at 50% (t 10 to 20); a test
    reached the target at ``reached_at``. Returns its entry of results.json."""
    steps = [*range(1, 10), 10, 12, 14, 16, 18, *range(20, 31)]
    for node in (0, 1):
        records = run_dir / f"node{node}" / "records"
        records.mkdir(parents=True)
        lines = [{"kind": "start", "t": 0.0}]
        lines += [{"kind": "step", "t": float(t), "samples": 20} for t in steps]
        if node == 0:
            lines += [{"kind": "eval", "t": reached_at - 1, "score": 0.5}]
            lines += [{"kind": "eval", "t": reached_at, "score": 0.61}]
        _write(records / "worker-0-wave-0.jsonl", lines)
    caps = {"caps": [[1, 10.0, 20.0, 50.0]]}
    return {"mode": "allreduce", "seed": 0, "run_dir": str(run_dir), "timeline": caps}


def test_the_ideal_bound_reads_each_folder_of_runs_on_its_own(tmp_path, capsys):
    """Two cluster.py folders, each with a seed 0: each gets its own table, its all-reduce
    beside its own ticktock (they are other runs of the same seed)."""
    ideal_bound = _benchmark("ideal_bound")
    folders = []
    for name, reached, ticktock_s in (("slow", 25.0, 24.0), ("noisy", 22.0, 11.0)):
        folder = tmp_path / name
        allreduce = _capped_allreduce_run(folder / "ar", reached)
        ticktock = {"mode": "ticktock", "seed": 0, "time_to_target_s": ticktock_s}
        ticktock["run_dir"] = str(folder)
        (folder / "results.json").write_text(json.dumps([allreduce, ticktock]))
        folders.append(str(folder))
    assert ideal_bound.main(folders) == 0
    out = capsys.readouterr().out
    slow, noisy = out.split(f"## {folders[1]}")
    assert f"## {folders[0]}" in slow
    assert "| 25.0 | 23.5 | 0.94x | 24.0 | 0.96x |" in slow
    assert "| 22.0 |" in noisy and "| 11.0 | 0.50x |" in noisy and "| 25.0 |" not in noisy


def test_the_ideal_rule_trains_all_reduces_samples_at_each_nodes_free_share(tmp_path):
    """All-reduce on two nodes at 20 samples per node a step, a step a second while both are
    free and one every 2 s while node 1 is capped at 50% (t 10 to 20); a test reached the
    target at t=25, when 800 samples were in. The free pace is 20 samples/s per node (the
    capped span and the second after it left out). The ideal rule trains 40 samples/s while
    both are free and 30 while node 1 has half its core: 360 by t=10, 660 by t=20, 800 at
    t=23.5 (one second of start-up, all-reduce's, before its first step at t=1)."""
    ideal_bound = _benchmark("ideal_bound")
    allreduce = _capped_allreduce_run(tmp_path / "ar")
    ticktock = {"mode": "ticktock", "seed": 0, "time_to_target_s": 24.0, "run_dir": str(tmp_path)}
    assert ideal_bound.free_pace(allreduce, 2) == pytest.approx(20.0)
    rows, pace = ideal_bound.bounds([allreduce, ticktock], [], 0.6, 2)
    assert pace == pytest.approx(20.0)
    assert rows == [
        {"seed": 0, "samples": 800, "allreduce": 25.0, "ideal": pytest.approx(23.5, abs=0.02),
         "ticktock": (24.0, None)}
    ]  # fmt: skip
    assert "| 0 | 800 | 25.0 | 23.5 | 0.94x | 24.0 | 0.96x | - |" in ideal_bound.table(
        rows, pace, 0.6
    )
    with pytest.raises(SystemExit, match="no all-reduce run"):
        ideal_bound.bounds([ticktock], [], 0.6, 2)
    assert ideal_bound.bounds([allreduce], [], 0.9, 2)[0] == []  # never reached: no row
    allreduce["time_to_target_s"] = 25.0
    assert "| allreduce | 0 | 25.0 | 800 |" in ideal_bound.samples_table([allreduce], 0.6)
