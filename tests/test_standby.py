"""Standbys: each shard daemon hosts the previous shard's standby. A shard killed with SIGKILL
is taken over by its standby and its waves go on there: with shard_replicas = 2 with no update
lost (the weights equal a run without the kill), with 1 from the newest weights a wave holds.
A shard stopped with SIGTERM hands itself over first, losing nothing. A standby serves nobody
while its primary lives, and takes state only from a shard of the job."""

import signal
import threading

import pytest
import torch
from conftest import forked, wait_for
from helpers import TIMEOUT_S, RawClient, client_for, tiny_model

from wavelet.common.protocol import ErrorCode, Header, Op
from wavelet.common.records import read_records

STEPS = 12


def _train(addresses, clocks, model=None, worker="w0", before=None, transports=None, **client):
    """``clocks`` steps of one wave pushing gradients of ones from a fresh tiny model; calls
    ``before(clock)`` before each push. Returns the model (its weights: the last pull), the
    updates lost and the versions read; ``transports`` (a list) gets the links' at the end;
    ``client``: more arguments of its PSClient (helpers.client_for)."""
    model = model or tiny_model()
    c = client_for(model, addresses, worker=worker, **client)
    try:
        c.register(0)
        r = c.pull(0)
        for clock in range(clocks):
            if before is not None:
                before(clock)
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (clock + 1))
            r = c.push_pull(clock, r.versions)
        if transports is not None:
            transports += c.transports
        return model, c.lost_updates, r.versions
    finally:
        c.close()


def _weights(model):
    return [t.detach().clone() for t in model.state_dict().values()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [2, 1])
def test_a_killed_shard_is_taken_over_by_its_standby(shard_daemons, replicas):
    job = ["--staleness", "inf", "--set", f"shard_replicas={replicas}"]
    reference = shard_daemons(job, count=2)
    expected, _, _ = _train(reference.addresses, STEPS)
    daemons = shard_daemons(job, count=2, standbys=True)

    def kill_at(clock):
        if clock == STEPS // 2:
            daemons.procs[1].send_signal(signal.SIGKILL)
            daemons.procs[1].wait(10)

    transports = []
    model, lost, versions = _train(daemons.addresses, STEPS, before=kill_at, transports=transports)
    assert lost == 0
    host_log = (daemons.tmp / "ps-0.log").read_text()
    assert "standby of shard 1 takes the shard over" in host_log
    # a wave on the standby's host goes on through shared memory, as with its primary
    assert transports == ["shm", "shm"]
    # the standby's address is where shard 1 is looked up now
    assert daemons.current_addresses()[1] != daemons.addresses[1]
    if replicas == 2:
        # every update survived: the same weights, versions and optimizer steps as no kill
        assert versions == [STEPS, STEPS]
        for a, b in zip(_weights(expected), _weights(model), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    else:
        # taken over from the weights the wave held, and its push that the shard died with
        # given again: every update is there; only the momentum on that shard's part starts
        # afresh, so the weights differ a little from the reference's
        assert versions == [STEPS, STEPS]
        assert all(torch.isfinite(t).all() for t in _weights(model))


@pytest.mark.timeout(180)
def test_a_stopped_shard_hands_itself_over_and_bsp_loses_nothing(shard_daemons):
    """SIGTERM (a preemption notice) under bulk-synchronous updates with two waves: the shard
    gives its state to its standby, the waves follow it, and every update is as without it."""
    job = ["--staleness", "0", "--waves", "1"]

    def run(addresses, stop=None):
        models = [tiny_model(), tiny_model()]
        results = {}

        def wave(i):
            before = stop if i == 0 else None
            try:
                results[i] = _train(addresses, STEPS, models[i], worker=f"w{i}", before=before)
            except Exception as e:  # for the assertion below to show
                results[i] = e

        threads = [threading.Thread(target=wave, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * TIMEOUT_S)
        assert all(not t.is_alive() for t in threads), "a wave hung"
        failed = [r for r in results.values() if isinstance(r, Exception)]
        assert not failed, failed
        return models, results

    reference = shard_daemons(job, count=2, expect_waves=2)
    expected, _ = run(reference.addresses)
    daemons = shard_daemons(job, count=2, expect_waves=2, standbys=True)

    def stop_at(clock):
        if clock == STEPS // 2:
            daemons.procs[1].send_signal(signal.SIGTERM)

    models, results = run(daemons.addresses, stop_at)
    assert daemons.procs[1].wait(30) == 0
    assert all(results[i][1] == 0 for i in range(2)), "updates were lost"
    assert "handed itself to its standby" in (daemons.tmp / "ps-1.log").read_text()
    for a, b in zip(_weights(expected[0]), _weights(models[0]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.timeout(180)
def test_a_wave_pulling_in_parts_follows_a_shard_that_handed_itself_over(shard_daemons):
    """Weights asked for in parts (pull during forward, over TCP): the push the stopped shard
    never took is given again to its standby, whose answer completes the step."""
    daemons = shard_daemons(["--staleness", "inf"], count=2, standbys=True)

    def stop_at(clock):
        if clock == STEPS // 2:  # gone before the push: the standby must be given it again
            daemons.procs[1].send_signal(signal.SIGTERM)
            assert daemons.procs[1].wait(30) == 0

    model, lost, versions = _train(
        daemons.addresses, STEPS, before=stop_at, transport="tcp", part_bytes=1
    )
    assert "handed itself to its standby" in (daemons.tmp / "ps-1.log").read_text()
    assert lost == 0 and versions == [STEPS, STEPS]


@pytest.mark.timeout(120)
def test_a_standby_serves_nobody_while_its_primary_lives(shard_daemons):
    daemons = shard_daemons(["--staleness", "inf"], count=2, standbys=True)
    _train(daemons.addresses, 2)  # the shards are seeded, and so are their standbys
    standby = daemons.standby_file(1).read_text().strip()
    raw = RawClient(standby)
    try:
        h = raw.request(Header(op=Op.REGISTER, worker="w9", wave=0, clock=0, plan="x"))
        assert h.op == Op.ERROR and h.body["code"] == ErrorCode.NOT_PRIMARY
        # and takes no state from outside the job (no admin token)
        seed = Header(op=Op.SEED, body={"token": "guess", "state": {}, "clocks": []})
        h = raw.request(seed)
        assert h.op == Op.ERROR and h.body["code"] == ErrorCode.UNAUTHORIZED
    finally:
        raw.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [2, 1])
def test_a_primary_that_wakes_after_its_standby_took_over_serves_nobody(shard_daemons, replicas):
    """Shard 1's process stopped (SIGSTOP: a paused VM, a cut link) past the lost time: the
    wave goes on with the standby, which takes the shard over. When the process wakes, its
    standby refuses it (``moved``) and it steps aside: a wave that asks it is sent to the
    standby, and it does not seed the standby over and over. One owner per shard."""
    job = ["--staleness", "inf", "--set", f"shard_replicas={replicas}"]
    daemons = shard_daemons([*job, "--set", "shard_timeout_s=3"], count=2, standbys=True)
    stopped = daemons.procs[1]

    def stop_at(clock):
        if clock == 2:
            stopped.send_signal(signal.SIGSTOP)

    try:
        _train(daemons.addresses, 6, before=stop_at)
    finally:
        stopped.send_signal(signal.SIGCONT)
    assert "standby of shard 1 takes the shard over" in (daemons.tmp / "ps-0.log").read_text()
    standby = daemons.standby_file(1).read_text().strip()
    old_log = daemons.tmp / "ps-1.log"
    wait_for(
        lambda: "this shard serves nobody now" in old_log.read_text(),
        60,
        "the woken primary did not step aside",
    )
    raw = RawClient(daemons.addresses[1])
    try:
        h = raw.request(Header(op=Op.REGISTER, worker="w9", wave=0, clock=0, plan="x"))
    finally:
        raw.close()
    assert h.op == Op.ERROR and h.body["code"] == ErrorCode.MOVED, h
    assert standby in h.body["message"]
    assert "its standby refused" not in old_log.read_text()
    # the job goes on where the shard is now
    _, lost, versions = _train(daemons.current_addresses(), 2, worker="w1")
    assert lost == 0 and min(versions) >= 6


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_trains_on_through_a_killed_shard(shard_daemons, tmp_path):
    """A real worker of two waves, and shard 1 killed with SIGKILL mid-run: the worker finishes
    its epochs (exit 0), its waves moved to the standby, no update lost."""
    job = ["--epochs", "6", "--waves", "2", "--set", "shard_replicas=2", "--updates", "async"]
    _, records, _ = _worker_through_a_stop(shard_daemons, tmp_path, job, signal.SIGKILL)
    last = [r for r in read_records(records) if r["kind"] == "step"][-1]
    assert last["lost_updates"] == 0


def _worker_through_a_stop(shard_daemons, tmp_path, job, sig, *flags):
    """A real worker of two waves (``job``, and its own ``flags``) on two shards with standbys,
    shard 1 sent ``sig`` once wave 0 made 20 steps: the worker finishes (exit 0), its waves
    moved to the standby. Returns the worker's log, wave 0's records and the daemons."""
    daemons = shard_daemons(job, count=2, expect_waves=2, standbys=True)
    run = tmp_path / "run"
    records = run / "records" / "worker-0-wave-0.jsonl"
    args = ["worker", *job, "--threads", "1", "--run-dir", str(run), *flags]
    for a in daemons.addresses:
        args += ["--shard", a]
    with forked(args, tmp_path / "worker.log") as worker:
        wait_for(lambda: _steps(records) >= 20, 90, "training did not start")
        daemons.procs[1].send_signal(sig)
        code = worker.wait(180)
    text = (tmp_path / "worker.log").read_text()
    assert code == 0, text[-3000:]
    assert "moves to its standby" in text
    return text, records, daemons


def _steps(path):
    if not path.exists():
        return 0
    return sum(1 for r in read_records(path) if r["kind"] == "step")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_with_two_replicas_goes_on_through_a_killed_shard(tmp_path):
    """``wavelet launch --shard-replicas 2``: shard 0's process killed with SIGKILL mid-run; its
    standby (in shard 1's process) takes it over, the job finishes with its summary, no update
    lost, and nothing is restarted."""
    import json
    import os

    from test_launch import _assert_nothing_left, _one_process, _shard_marker

    run_dir = tmp_path / "run"
    records = run_dir / "records" / "worker-0-wave-0.jsonl"
    args = ["launch", "--run-dir", str(run_dir), "--epochs", "8", "--shard-replicas", "2"]
    with forked(args, tmp_path / "launch.log") as proc:
        wait_for(lambda: _steps(records) >= 40, 90, "training did not start")
        os.kill(_one_process(run_dir, _shard_marker(run_dir, 0)), signal.SIGKILL)
        code = proc.wait(200)
    log = (tmp_path / "launch.log").read_text()
    assert code == 0, log[-3000:]
    assert "ps-0 exited with status -9: its standby takes it over" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_updates"] == 0
    assert summary["test_accuracy"] >= 0.9, summary
    assert "standby of shard 0 takes the shard over" in (run_dir / "logs" / "ps-1.log").read_text()
    _assert_nothing_left(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_waves_pulling_during_forward_follow_a_shard_that_handed_itself_over(
    shard_daemons, tmp_path
):
    """Wave turns with pull during forward over TCP, shard 1 stopped with SIGTERM mid-run: a
    wave whose push the moved shard refused sees it while it waits for the baton, not only
    at its next forward, so the other wave's forward (waiting for that wave's update, baton
    in hand) is not held until the baton gives up on it."""
    job = ["--epochs", "4", "--waves", "2", "--updates", "wave-turns"]
    job += ["--pull-during-forward", "true", "--set", "baton_timeout_s=120"]
    text, _, daemons = _worker_through_a_stop(
        shard_daemons, tmp_path, job, signal.SIGTERM, "--transport", "tcp"
    )
    assert "skipped stalled wave" not in text
    assert "silent for over" not in (daemons.tmp / "ps-0.log").read_text()


def test_a_hand_over_whose_ack_the_primary_missed_is_withdrawn_by_its_next_seed(tmp_path):
    """A primary that handed itself over but saw no ack in time serves on and seeds its
    standby again: the standby withdraws the hand-over and serves nobody, or a wave asking it
    would make two owners of the shard. Once a standby took the shard over, its old primary's
    seed is answered ``moved`` (the primary then steps aside)."""
    from helpers import ServiceWave, service_for

    from wavelet.common.messages import Seed
    from wavelet.common.protocol import ProtocolError
    from wavelet.ps.owners import Peer
    from wavelet.ps.replication import state_to_wire
    from wavelet.ps.standby import StandbyRole

    primary, standby = service_for(tmp_path / "p"), service_for(tmp_path / "s")
    try:
        ServiceWave(primary).join()  # the primary holds a state to hand over
        role = StandbyRole(standby, lost_after_s=60.0, on_promoted=lambda: None)
        standby.standby = role
        peer, h = Peer(b"primary-0"), Header(op=Op.SEED)
        state, tensors = state_to_wire(primary.shard.state_dict())
        hand_over = Seed(token="secret", state=state, clocks=[], promote=True)
        hello = Seed(token="secret", state={}, clocks=[], hello=True)
        role.seed(peer, h, hand_over, tensors)
        assert role.handed_over
        role.seed(peer, h, hello, [])  # the primary serves on
        assert not role.handed_over
        with pytest.raises(ProtocolError) as refused:
            role.admit(Op.PUSH)
        assert refused.value.code == ErrorCode.NOT_PRIMARY
        role.seed(peer, h, hand_over, tensors)
        role.admit(Op.PUSH)  # a wave told ``moved`` comes: the standby takes over
        assert role.promoted
        with pytest.raises(ProtocolError) as refused:
            role.seed(peer, h, hello, [])
        assert refused.value.code == ErrorCode.MOVED
    finally:
        primary.close()
        standby.close()
