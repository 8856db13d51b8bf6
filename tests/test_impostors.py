"""Against live daemons: a process that merely names a running wave cannot break it, and a wave
that drops its segments while a pull is parked cannot stop the shard."""

import json

import pytest
from conftest import forked, wait_for
from helpers import TIMEOUT_S, RawClient, client_for, tiny_model

from wavelet.common.protocol import Header, Op, decode
from wavelet.common.records import read_records


def _steps(path) -> int:
    if not path.exists():
        return 0
    return sum(r["kind"] == "step" for r in read_records(path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_naming_a_running_wave_change_nothing_and_the_job_trains_on(tmp_path):
    run_dir = tmp_path / "run"
    with forked(["launch", "--run-dir", str(run_dir)], tmp_path / "launch.log") as launcher:
        records = run_dir / "records" / "worker-0-wave-0.jsonl"
        wait_for(lambda: _steps(records) >= 20, 120, "training did not start")
        addresses = [(run_dir / f"ps-{i}.addr").read_text().strip() for i in range(2)]
        raws = [RawClient(a) for a in addresses]
        try:
            answers = []
            for _ in range(5):  # while the job trains: each case, against every shard
                for raw in raws:
                    for wave, op, body in [
                        (0, Op.ATTACH, {"transport": "tcp"}),  # would drop its segments
                        (0, Op.LEAVE, {}),  # would free them
                        (1, Op.ATTACH, {}),  # would re-make them behind its back
                    ]:
                        h = raw.request(Header(op=op, worker="w0", wave=wave, body=body))
                        answers.append((h.op, h.body.get("code")))
                done = _steps(records)  # spread over the job: the next round a step later
                wait_for(lambda n=done: _steps(records) > n, 60, "the wave stopped training")
        finally:
            for raw in raws:
                raw.close()
        assert set(answers) == {("error", "wave_in_use")}, answers
        assert launcher.wait(240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.97, summary
    for w in (0, 1):
        steps = [
            r
            for r in read_records(run_dir / "records" / f"worker-0-wave-{w}.jsonl")
            if r["kind"] == "step"
        ]
        assert all(t == "shm" for r in steps for t in r["transport"]), "a wave lost its segments"


@pytest.mark.timeout(120)
def test_a_shard_survives_a_wave_that_detaches_with_a_pull_parked(shard_daemons):
    daemons = shard_daemons(["--staleness", "1"], count=1, expect_waves=3)
    seed = client_for(tiny_model(), daemons.addresses, worker="seed")  # seeds the weights
    raw = RawClient(daemons.addresses[0])
    late = client_for(tiny_model(), daemons.addresses, worker="late")
    try:
        seed.register(0)
        plan = seed.plan.fingerprint
        for op, body in [(Op.REGISTER, {}), (Op.ATTACH, {})]:
            h = raw.request(Header(op=op, worker="r", wave=0, plan=plan, body=body))
            assert h.op == "reply", h.body
        # a shared-memory pull parks at the start barrier (2 of 3 waves registered)...
        pull = Header(op=Op.PULL, worker="r", wave=0, clock=0, plan=plan, body={"shm": True})
        pull.request_id = 7
        raw.sock.send_multipart([pull.pack()])
        # ...and the wave drops its segments: the parked pull is answered at once
        detach = Header(op=Op.ATTACH, worker="r", wave=0, plan=plan, body={"transport": "tcp"})
        detach.request_id = 8
        raw.sock.send_multipart([detach.pack()])
        replies = {}
        while len(replies) < 2:
            assert raw.sock.poll(TIMEOUT_S * 1000), replies
            h, _ = decode(raw.sock.recv_multipart())
            replies[h.request_id] = h
        assert replies[7].op == "error" and replies[7].body["code"] == "not_attached"
        assert replies[8].op == "reply" and replies[8].body["transport"] == "tcp"
        late.register(0)  # the barrier opens: nothing is released into dropped segments
        assert late.pull(0).versions == [0]
        assert daemons.procs[0].poll() is None, "the shard died"
    finally:
        raw.close()
        late.close()
        seed.close()
