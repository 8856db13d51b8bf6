"""Small failures a new user met: each ends in one clear line, never a traceback or a wrong
action. Token files, a busy metrics port, odd budgets, odd run dirs, leftovers of a killed job,
a second shard of the same run dir, and the fixtures' own cleanup."""

import os
import socket
import stat
import subprocess
import urllib.error
import urllib.request

import conftest
import pytest
import torch
from conftest import ShardDaemons, run_wavelet, wait_for
from helpers import free_port

from wavelet.common.records import read_records
from wavelet.common.security import load_admin_token, write_private
from wavelet.common.settings import ConfigError
from wavelet.common.shm import SHM_DIR, run_prefix


def _one_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- the admin token ---------------------------------------------------------------------------


def test_a_token_file_others_can_read_is_refused(tmp_path):
    token = write_private(tmp_path / "admin.token", "0123")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_admin_token(token, create=False)
    line = _one_line(
        run_wavelet(
            "admin", "shutdown", "tcp://127.0.0.1:1", "--token-file", str(token), timeout=60
        )
    )
    assert "chmod 600" in line


def test_a_new_token_is_made_private_in_a_folder_not_made_yet(tmp_path):
    token = load_admin_token(tmp_path / "new" / "run" / "admin.token")
    path = tmp_path / "new" / "run" / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == token
    assert load_admin_token(path) == token  # made once, then read


def test_private_files_never_follow_a_link_or_keep_a_loose_mode(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "admin.token"
    link.symlink_to(victim)
    write_private(link, "secret")  # replaces the link itself
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and stat.S_IMODE(link.stat().st_mode) == 0o600
    loose = tmp_path / "loose"
    loose.write_text("old")
    loose.chmod(0o666)
    write_private(loose, "new")
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600 and loose.read_text() == "new\n"


# --- a launch whose daemon cannot start ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_busy_metrics_port_stops_the_launch_at_once_with_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_wavelet(
            "launch", "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port), timeout=100
        )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not start" in lines[0] and str(port) in lines[0], lines
    assert "checkpoint" not in done.stderr  # no resume hint: nothing ran
    assert "metrics:" not in done.stdout  # no empty list of addresses first


@pytest.mark.timeout(120)
def test_metrics_are_served_at_their_path_only(tmp_path, shard_daemons):
    daemons = shard_daemons(["--metrics-port", "0"], count=1)
    log = daemons.tmp / "ps-0.log"
    wait_for(lambda: "metrics at http" in log.read_text(), 60, "no metrics address logged")
    url = log.read_text().split("metrics at ")[1].split()[0]
    assert urllib.request.urlopen(url, timeout=10).status == 200
    for other in ("/", "/metric", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url.replace("/metrics", other), timeout=10)
        assert e.value.code == 404


# --- odd values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["1e999", "1e999x", "5000x", "2e16GiB"])
def test_an_absurd_memory_budget_is_out_of_range(budget, tmp_path):
    line = _one_line(
        run_wavelet("compare", "--memory-budget", budget, "--out", str(tmp_path), timeout=60)
    )
    assert "out of range" in line


def test_stats_of_odd_run_dirs_is_one_line(tmp_path):
    line = _one_line(run_wavelet("stats", str(tmp_path / "missing"), timeout=60))
    assert "no such directory" in line
    (tmp_path / "ps-0.addr").write_bytes(b"\xff\xfe\x00garbage")
    line = _one_line(run_wavelet("stats", str(tmp_path), timeout=60))
    assert "ps-0.addr" in line


# --- leftovers of a killed job ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_clean_removes_a_killed_jobs_segments_and_refuses_while_it_runs(tmp_path):
    from helpers import client_for, tiny_model

    daemons = ShardDaemons(tmp_path, ["--staleness", "inf"], count=1).__enter__()
    prefix = run_prefix(daemons.tmp)
    try:
        wave = client_for(tiny_model(), daemons.addresses)
        wave.register(0)  # attaches: two segments, and the shard makes its 3 weight slots
        assert len(list(SHM_DIR.glob(prefix + "*"))) == 5
        line = _one_line(run_wavelet("clean", str(daemons.tmp), timeout=60))
        assert "still running" in line
        assert len(list(SHM_DIR.glob(prefix + "*"))) == 5
        wave.close()
        os.kill(daemons.procs[0].pid, 9)
        daemons.procs[0].wait(10)
        assert len(list(SHM_DIR.glob(prefix + "*"))) == 5  # a kill -9 leaves them
        done = run_wavelet("clean", str(daemons.tmp), timeout=60)
        assert done.returncode == 0 and "removed 5" in done.stdout, done.stderr
        assert not list(SHM_DIR.glob(prefix + "*"))
    finally:
        daemons.__exit__(None, None, None)


@pytest.mark.timeout(120)
def test_a_second_shard_of_the_same_run_dir_leaves_the_live_ones_segments(shard_daemons):
    from helpers import client_for, tiny_model

    daemons = shard_daemons(["--staleness", "inf"], count=1)
    wave = client_for(tiny_model(), daemons.addresses)
    try:
        wave.register(0)
        prefix = run_prefix(daemons.tmp)
        before = sorted(SHM_DIR.glob(prefix + "*"))
        assert len(before) == 2 + 3  # the wave's segments, the shard's weight slots
        line = _one_line(
            run_wavelet(
                "ps", "--run-dir", str(daemons.tmp), "--bind", "tcp://127.0.0.1:0", timeout=60
            )
        )
        assert "already running" in line
        assert sorted(SHM_DIR.glob(prefix + "*")) == before
        wave.pull(0)  # and the live wave still reads through them
    finally:
        wave.close()


# --- the fixtures -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by_hand", [False, True], ids=["forked", "by-hand"])
def test_shard_fixtures_stop_the_shards_that_started_when_a_later_one_fails(
    tmp_path, monkeypatch, by_hand
):
    name = "started" if by_hand else "forked"
    real_start = getattr(conftest, name)
    calls = []

    def second_fails(cmd, log, **kwargs):
        calls.append(cmd)
        if len(calls) == 2:  # a shard that refuses its settings
            cmd = [*cmd[: cmd.index("ps") + 1], "--staleness", "-3"]
        return real_start(cmd, log, **kwargs)

    monkeypatch.setattr(conftest, name, second_fails)
    daemons = ShardDaemons(tmp_path, [], count=2, by_hand=by_hand)
    with pytest.raises(RuntimeError, match="staleness"):
        daemons.__enter__()
    assert daemons.procs[0].poll() is not None, "the first shard was left running"


# --- all-reduce and wavelet run -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_failing_allreduce_rank_reports_its_error_not_a_final_score(tmp_path):
    (tmp_path / "breaks.py").write_text(
        "import torch.nn as nn\n\n"
        "class Breaks(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc, self.calls = nn.Linear(64, 10), 0\n\n"
        "    def forward(self, x):\n"
        "        self.calls += 1\n"
        "        if self.calls > 3:\n"
        "            raise RuntimeError('the model broke at its 4th forward')\n"
        "        return self.fc(x.flatten(1))\n\n"
        "def make(input_shape, num_classes):\n"
        "    return Breaks()\n"
    )
    run_dir = tmp_path / "run"
    env = {
        **conftest.CHILD_ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    done = subprocess.run(
        conftest.wavelet_cmd(
            "worker", "--mode", "allreduce", "--model", "breaks:make", "--run-dir", str(run_dir)
        ),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode != 0
    assert "the model broke at its 4th forward" in done.stderr
    kinds = [r["kind"] for r in read_records(run_dir / "records" / "worker-0-wave-0.jsonl")]
    assert "step" in kinds and "final" not in kinds


def test_wavelet_run_waits_for_a_straggler_past_the_store_timeout():
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from wavelet.scripts.run_end import wait_for_workers

    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=1), wait_for_workers=False
    )
    store.set("done/0", "0")
    notes = []
    noted = threading.Event()

    def say(text):
        notes.append(text)
        noted.set()

    def late_worker():
        noted.wait(30)  # done only after worker 0 said it still waits: past the store's timeout
        store.set("done/1", "0")

    straggler = threading.Thread(target=late_worker, daemon=True)
    straggler.start()
    wait_for_workers(store, {0: "done/0", 1: "done/1"}, note_every_s=1.5, say=say)
    straggler.join(10)
    assert notes and notes[0] == "wavelet run: still waiting for worker(s) 1"


def test_an_unreadable_reply_is_one_of_the_clients_errors():
    import threading

    import zmq

    from wavelet.common.protocol import BadReply, Op, ShardError
    from wavelet.worker.connection import call_shard

    ctx = zmq.Context.instance()
    liar = ctx.socket(zmq.ROUTER)
    liar.setsockopt(zmq.LINGER, 0)
    port = liar.bind_to_random_port("tcp://127.0.0.1")

    def answer_garbage():
        if liar.poll(20_000):
            peer, *_ = liar.recv_multipart()
            liar.send_multipart([peer, b"\xc1 not msgpack"])

    replier = threading.Thread(target=answer_garbage, daemon=True)
    replier.start()
    try:
        with pytest.raises(ShardError) as e:
            call_shard(f"tcp://127.0.0.1:{port}", Op.STATS, timeout_s=20)
        assert isinstance(e.value, BadReply) and "unreadable reply" in str(e.value)
    finally:
        replier.join(25)
        liar.close()


@pytest.mark.timeout(120)
def test_a_shard_the_plan_gives_no_chunk_still_serves_the_job(shard_daemons):
    """More shards than chunks (a one-tensor model on 2 shards): the empty shard builds no
    optimizer, takes its pushes as versions, and the other trains (bench_ps.py met this)."""
    from helpers import client_for

    model = torch.nn.Linear(4, 1, bias=False)
    daemons = shard_daemons([], count=2)
    c = client_for(model, daemons.addresses)
    try:
        c.register(0)
        assert [len(chunks) for chunks in c.chunks] == [1, 0]
        before = model.weight.detach().clone()
        pulled = c.pull(0)
        for clock in range(3):
            model.weight.grad = torch.ones_like(model.weight)
            pulled = c.push_pull(clock, pulled.versions)
        assert pulled.versions == [3, 3]
        assert not torch.equal(model.weight, before)
    finally:
        c.close()
