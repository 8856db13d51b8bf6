"""Joining a running job: ``wavelet worker --join ADDR`` takes the job, every shard's address and
a free worker slot from one shard, pulls the current weights and trains beside the others, who
never stop. A wrong token or a model that is not the job's is refused with one line, and the job
goes on."""

import signal

import pytest
from conftest import forked, run_wavelet, wait_for

from wavelet.common.records import read_records
from wavelet.scripts.stats import fetch_stats

JOB = ["--epochs", "500", "--waves", "1", "--staleness", "inf", "--set", "heartbeat_s=0.5"]


def _steps(path):
    return [r for r in read_records(path) if r["kind"] == "step"] if path.exists() else []


def _worker(daemons, run_dir, rank):
    args = ["worker", *JOB, "--rank", str(rank), "--num-workers", "2", "--threads", "1"]
    args += ["--run-dir", str(run_dir)]
    for a in daemons.addresses:
        args += ["--shard", a]
    return args


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_joins_a_running_job_in_the_slot_one_left(shard_daemons, tmp_path):
    daemons = shard_daemons(JOB, count=2, expect_waves=2)
    token = str(daemons.tmp / "admin.token")
    a_records = tmp_path / "a" / "records" / "worker-0-wave-0.jsonl"
    b_records = tmp_path / "b" / "records" / "worker-1-wave-0.jsonl"
    joined = tmp_path / "joined" / "records" / "worker-1-wave-0.jsonl"
    with forked(_worker(daemons, tmp_path / "a", 0), tmp_path / "a.log") as a:
        with forked(_worker(daemons, tmp_path / "b", 1), tmp_path / "b.log") as b:
            wait_for(lambda: len(_steps(b_records)) >= 10, 90, "training did not start")
            b.send_signal(signal.SIGKILL)
            b.wait(10)
        at_leave = len(_steps(a_records))
        # refused, with one line each, while a trains on
        wrong = run_wavelet(
            "worker", "--join", daemons.addresses[1], "--join-token-file", str(tmp_path / "x"),
            "--run-dir", str(tmp_path / "w"), timeout=60,
        )  # fmt: skip
        assert wrong.returncode == 2 and "admin token" in wrong.stderr, wrong.stderr
        (tmp_path / "bad.token").write_text("not-the-token")
        (tmp_path / "bad.token").chmod(0o600)
        bad = run_wavelet(
            "worker", "--join", daemons.addresses[1], "--join-token-file",
            str(tmp_path / "bad.token"), "--run-dir", str(tmp_path / "w"), timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "unauthorized" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        args = ["worker", "--join", daemons.addresses[0], "--join-token-file", token]
        args += ["--run-dir", str(tmp_path / "joined"), "--threads", "1"]
        with forked(args, tmp_path / "joined.log") as j:
            wait_for(lambda: len(_steps(joined)) >= 10, 90, "the joiner did not train")
            a_then, j_then = len(_steps(a_records)), len(_steps(joined))
            wait_for(
                lambda: len(_steps(a_records)) > a_then and len(_steps(joined)) > j_then,
                90,
                "a and the joiner did not both advance",
            )
            other_model = run_wavelet(
                "worker", "--join", daemons.addresses[0], "--join-token-file", token,
                "--run-dir", str(tmp_path / "m"), "--model", "mlp", "--threads", "1", timeout=90,
            )  # fmt: skip
            assert other_model.returncode == 1 and "plan" in other_model.stderr, other_model.stderr
            # the membership, as stats and the records show it
            members = fetch_stats(daemons.addresses[:1])[0]["members"]
            assert members["joins"] >= 3 and members["leaves"] >= 1, members
            assert members["epoch"] == members["joins"] + members["leaves"]
            j.send_signal(signal.SIGTERM)
            assert j.wait(30) == 0
        assert len(_steps(a_records)) > at_leave + 10  # a never stopped
        a.send_signal(signal.SIGTERM)
        assert a.wait(30) == 0
    events = list(read_records(daemons.tmp / "records" / "ps-0-members.jsonl"))
    assert {"event": "leave", "wave": "w1/0"} in [
        {k: e[k] for k in ("event", "wave")} for e in events
    ]
    text = (tmp_path / "joined.log").read_text()
    assert "as worker 1 of 2" in text  # the slot b left
    first = _steps(joined)[0]
    assert first["clock"] > 10 and min(first["versions_read"]) > 10  # the current weights
