"""A shard taken over while its open step holds a late push folded into it (k of n, patience):
the clocks the primary hands on put the wave back at its folded push, not at its last one, and
the wave, which keeps only its last push to give again, counts the folded one as lost and says
so, instead of the take-over dropping it silently."""

import json
import signal
import threading

import pytest
import torch
from conftest import wait_for
from helpers import TIMEOUT_S, ServiceWave, client_for, service_for, tiny_model

from wavelet.common.protocol import Op
from wavelet.common.records import read_records
from wavelet.ps.synchronous import SyncGroups

KOFN = ["--updates", "k-of-n", "--set", "sync_quorum=2", "--set", "balance_batches=off"]


def _clocks(service) -> dict[str, int]:
    return {f"{w}/{i}": clock for w, i, clock, _ in service.replicated_clocks()}


def test_a_folded_push_keeps_its_waves_handed_on_clock_back_until_applied(tmp_path, monkeypatch):
    """k = 2 of 3: waves a and c close step 0; b's push for step 0 comes late and is folded
    into step 1, and b pushes step 1 into it too. Until step 1 is applied the clocks a copy
    stands for put b at 0 (neither of its pushes is in an update yet), then at 2; c, late for
    step 1 in turn, stays at 1 with its push folded into step 2."""
    monkeypatch.setattr(SyncGroups, "MIN_GRACE_S", 0.0)
    monkeypatch.setattr(SyncGroups, "LATE_FACTOR", 0.0)  # a step closes once k pushed
    job = {"updates": "k-of-n", "staleness": 1, "sync_quorum": 2, "balance_batches": "off"}
    service = service_for(tmp_path, job=job)
    try:
        a, b, c = (ServiceWave(service, w) for w in ("w0", "w1", "w2"))
        a.join(), b.join(), c.join()
        grads = [torch.ones(chunk.numel) for chunk in a.chunks]

        def push(wave, clock):
            body = {"samples": 4, "compute_s": 0.0}
            wave.send(Op.PUSH, grads, clock=clock, read_version=clock, keys=wave.keys, body=body)

        push(a, 0), push(c, 0)
        service.tick()
        assert service.shard.version == 1
        assert _clocks(service) == {"w0/0": 1, "w1/0": 0, "w2/0": 1}
        push(b, 0)
        assert _clocks(service) == {"w0/0": 1, "w1/0": 0, "w2/0": 1}  # folded: not applied
        b.request(Op.PULL, clock=1)
        push(b, 1)
        service.tick()
        assert service.shard.version == 1  # one on-time push of step 1: k is 2
        assert _clocks(service) == {"w0/0": 1, "w1/0": 0, "w2/0": 1}  # not 1: its fold is open
        a.request(Op.PULL, clock=1)
        push(a, 1)
        service.tick()
        assert service.shard.version == 2  # b's two pushes and a's applied
        assert _clocks(service) == {"w0/0": 2, "w1/0": 2, "w2/0": 1}
        c.request(Op.PULL, clock=1)
        push(c, 1)  # late now: folded into step 2, so c stays at 1 until it is applied
        assert _clocks(service) == {"w0/0": 2, "w1/0": 2, "w2/0": 1}
    finally:
        service.close()


def _pushed(daemons, shard: int, worker: str, clock: int) -> bool:
    path = daemons.tmp / "records" / f"ps-{shard}-pushes.jsonl"
    return path.exists() and any(
        r["worker"] == worker and r["clock"] == clock for r in read_records(path)
    )


@pytest.mark.timeout(180)
def test_a_take_over_after_a_fold_counts_the_folded_push_as_lost(shard_daemons):
    """Three waves, k = 2 of 3: a and c close step 0; b's push for it is folded into step 1,
    and b's push for step 1 joins it there. Shard 1 is stopped (SIGTERM: handed to its standby)
    while step 1 waits for a second on-time push. b comes back on the standby one push short
    (its folded one), gives its last push again, and counts the other as lost; the others lose
    nothing, and step 1 is applied on the standby with them."""
    daemons = shard_daemons(KOFN, count=2, expect_waves=3, standbys=True)
    models = {w: tiny_model() for w in ("w0", "w1", "w2")}
    clients = {w: client_for(m, daemons.addresses, worker=w) for w, m in models.items()}
    results: dict[str, object] = {}

    def step(worker: str, clock: int, versions) -> threading.Thread:
        def run():
            for p in models[worker].parameters():
                p.grad = torch.full_like(p, 0.01)
            try:
                results[worker] = clients[worker].push_pull(clock, versions)
            except Exception as e:  # for the assertion below to show
                results[worker] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    try:
        for c in clients.values():
            c.register(0)
        versions = {w: c.pull(0).versions for w, c in clients.items()}
        for t in [step("w0", 0, versions["w0"]), step("w2", 0, versions["w2"])]:
            t.join(TIMEOUT_S)  # step 0 closes with a and c
        assert all(not isinstance(results[w], Exception) for w in ("w0", "w2")), results
        step("w1", 0, versions["w1"]).join(TIMEOUT_S)  # late: folded into step 1
        assert not isinstance(results["w1"], Exception), results["w1"]
        late = step("w1", 1, results["w1"].versions)  # waits: step 1 has one on-time push
        wait_for(lambda: _pushed(daemons, 1, "w1", 1), 30, "b's push for step 1 never came")
        daemons.procs[1].send_signal(signal.SIGTERM)
        assert daemons.procs[1].wait(30) == 0
        others = [step(w, 1, results[w].versions) for w in ("w0", "w2")]
        for t in [late, *others]:
            t.join(2 * TIMEOUT_S)
        failed = {w: r for w, r in results.items() if isinstance(r, Exception)}
        assert not failed, failed
        assert clients["w1"].lost_pushes == 1
        assert clients["w0"].lost_pushes == clients["w2"].lost_pushes == 0
        assert all(r.versions == [2, 2] for r in results.values()), results
    finally:
        for c in clients.values():
            c.close()


def test_lost_pushes_reach_the_summary_from_each_waves_records(tmp_path):
    """Each wave's records carry its running count; the summary adds the waves' last counts."""
    from wavelet.scripts.report import Progress, format_summary

    records = tmp_path / "records"
    records.mkdir()
    for wave, counts in ((0, [0, 1, 1]), (1, [0, 0, 2])):
        steps = [
            {"kind": "step", "t": 100.0 + i, "samples": 8, "epoch": 0, "loss": 1.0, "clock": i}
            | {"lost_pushes": n}
            for i, n in enumerate(counts)
        ]
        text = "".join(json.dumps(r) + "\n" for r in steps)
        (records / f"worker-0-wave-{wave}.jsonl").write_text(text)
    progress = Progress(tmp_path, epochs=1)
    progress.read()
    assert sum(progress.lost_pushes.values()) == 3
    summary = {
        "run_dir": str(tmp_path),
        "test_accuracy": 0.9,
        "samples": 48,
        "train_seconds": 2.0,
        "samples_per_s": 24.0,
        "precision": "fp32",
        "wire_dtype": "fp32",
        "wire_bytes": 0,
        "waves": {},
        "lost_pushes": 3,
    }
    assert "shards taken over lost 3 push(es)" in format_summary(summary)
