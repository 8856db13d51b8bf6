"""A shard taken over while its open step holds a late push folded into it (k of n, patience).
Handed over (SIGTERM, or moving off a slow node), the open step goes with the shard: nothing is
lost. Lost (SIGKILL), the clocks its copy holds put the wave back at its folded push, not at
its last one, and the wave, which keeps only its last push to give again, counts the folded one
as lost and says so, instead of the take-over dropping it silently."""

import json
import signal
import threading

import msgpack
import pytest
import torch
from conftest import wait_for
from helpers import TIMEOUT_S, ServiceWave, client_for, service_for, tiny_model

from wavelet.common.protocol import ErrorCode, Op, ProtocolError
from wavelet.common.records import read_records
from wavelet.ps.replication import state_from_wire, state_to_wire
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


def _open_groups() -> SyncGroups:
    """k = 2 of 3: step 0 closed with a and c; b's push for it folded into step 1 (4 samples,
    1.0 everywhere) beside a's push for step 1 (12 samples, 0.5): the sum weighs by samples."""
    groups = SyncGroups(by_wave_index=False, quorum=lambda live: 2)
    groups.add(("a", 0), 0, {0: torch.ones(3)}, 1.0, 4)
    groups.add(("c", 0), 0, {0: torch.ones(3)}, 1.0, 4)
    groups.complete(_Clocks({("a", 0): 1, ("b", 0): 0, ("c", 0): 1}))  # closes: b is late...
    return groups


class _Clocks:
    def __init__(self, clocks):
        self.clocks, self.live = clocks, set(clocks)


def test_the_open_steps_a_hand_over_passes_on_close_as_they_would_have(monkeypatch):
    """open_state -> the wire -> read_open -> take_open: the standby's sum is the primary's
    (the same mean, the same pushes unapplied, the same late pushes)."""
    monkeypatch.setattr(SyncGroups, "MIN_GRACE_S", 0.0)
    monkeypatch.setattr(SyncGroups, "LATE_FACTOR", 0.0)
    primary = _open_groups()
    assert primary.closed_clock == {"all": 0}
    assert primary.add(("b", 0), 0, {0: torch.ones(3)}, 1.0, 4) == "folded"
    assert primary.add(("a", 0), 1, {0: torch.full((3,), 0.5)}, 1.0, 12) == "accumulated"
    skeleton, tensors = state_to_wire(primary.open_state())
    state = state_from_wire(msgpack.unpackb(msgpack.packb(skeleton)), tensors)
    standby = SyncGroups(by_wave_index=False, quorum=lambda live: 2)
    standby.take_open(SyncGroups.read_open(state, {0: (torch.Size([3]), torch.float32)}))
    for groups in (primary, standby):
        assert groups.first_unapplied(("b", 0)) == 0 and groups.first_unapplied(("a", 0)) == 1
        assert groups.is_late(("c", 0), 0) and not groups.is_late(("c", 0), 1)
    clocks = _Clocks({("a", 0): 2, ("b", 0): 2, ("c", 0): 2})  # every wave past step 1
    [(mean, lr, count)], [(mean2, lr2, count2)] = primary.complete(clocks), standby.complete(clocks)
    torch.testing.assert_close(mean2, mean)
    torch.testing.assert_close(mean[0], torch.full((3,), (4 * 1.0 + 12 * 0.5) / 16))
    assert (lr2, count2) == (lr, count) == (1.0, 2)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda s: s["open"][0][1].update(sum={0: torch.ones(4)}),  # another shape
        lambda s: s["open"][0][1].update(sum={7: torch.ones(3)}),  # a chunk not trained here
        lambda s: s["open"][0][1].update(sum={0: torch.ones(3, dtype=torch.float64)}),
        lambda s: s["open"][0][1].update(count=-1),
        lambda s: s["open"][0][1].update(clock=True),
        lambda s: s["open"][0][1].pop("weights"),
        lambda s: s["open"][0][1].update(first_push=[["b", 0]]),
        lambda s: s["open"].append([True, {}]),
        lambda s: s.update(closed=[["all", "0"]]),
        lambda s: s.pop("step_s"),
    ],
)
def test_malformed_open_steps_are_refused_whole(spoil):
    groups = _open_groups()
    groups.add(("b", 0), 0, {0: torch.ones(3)}, 1.0, 4)
    state = groups.open_state()
    spoil(state)
    standby = SyncGroups(by_wave_index=False, quorum=lambda live: 2)
    with pytest.raises(ProtocolError) as e:
        SyncGroups.read_open(state, {0: (torch.Size([3]), torch.float32)})
    assert e.value.code == ErrorCode.MALFORMED and "open steps handed over" in str(e.value)
    assert standby.sums == {} and standby.closed_clock == {}


def _pushed(daemons, shard: int, worker: str, clock: int) -> bool:
    path = daemons.tmp / "records" / f"ps-{shard}-pushes.jsonl"
    return path.exists() and any(
        r["worker"] == worker and r["clock"] == clock for r in read_records(path)
    )


class FoldThenStop:
    """Three waves, k = 2 of 3, on two shards with standbys: a and c close step 0; b's push for
    it comes late and is folded into step 1, whose pushes carry 0.01 everywhere but this folded
    one (1.0: whether it is in an update shows in the weights); b's push for step 1 joins it
    there and b waits, step 1 having one on-time push. Then shard 1's process is stopped."""

    def __init__(self, shard_daemons, job_args: list[str]):
        self.daemons = shard_daemons(job_args, count=2, expect_waves=3, standbys=True)
        self.models = {w: tiny_model() for w in ("w0", "w1", "w2")}
        self.clients = {
            w: client_for(m, self.daemons.addresses, worker=w) for w, m in self.models.items()
        }
        self.results: dict[str, object] = {}

    def step(self, worker: str, clock: int, versions, grad: float = 0.01) -> threading.Thread:
        def run():
            for p in self.models[worker].parameters():
                p.grad = torch.full_like(p, grad)
            try:
                self.results[worker] = self.clients[worker].push_pull(clock, versions)
            except Exception as e:  # for the assertion below to show
                self.results[worker] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def fold_then_stop(self, sig: signal.Signals) -> threading.Thread:
        """Up to b waiting in step 1, then ``sig`` to shard 1; b's thread, still waiting."""
        for c in self.clients.values():
            c.register(0)
        versions = {w: c.pull(0).versions for w, c in self.clients.items()}
        for t in [self.step("w0", 0, versions["w0"]), self.step("w2", 0, versions["w2"])]:
            t.join(TIMEOUT_S)  # step 0 closes with a and c
        self.check()
        self.weights_at_1 = [p.detach().clone() for p in self.models["w0"].parameters()]
        self.step("w1", 0, versions["w1"], grad=1.0).join(TIMEOUT_S)  # late: folded into 1
        self.check()
        late = self.step("w1", 1, self.results["w1"].versions)
        wait_for(lambda: _pushed(self.daemons, 1, "w1", 1), 30, "b's push for step 1 never came")
        self.daemons.procs[1].send_signal(sig)
        self.daemons.procs[1].wait(30)
        return late

    def check(self) -> None:
        failed = {w: r for w, r in self.results.items() if isinstance(r, Exception)}
        assert not failed, failed

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


@pytest.mark.timeout(180)
def test_a_hand_over_passes_the_open_step_on_with_its_folded_push(shard_daemons):
    """SIGTERM (a preemption notice, or a shard moving off a slow node): shard 1 hands its open
    step 1 to its standby with both of b's pushes in it. Nobody gives a push again or loses
    one; a's push closes step 1 on both shards, c's comes late for it and is folded into step
    2; and step 1 is the same update on both shards, the folded push in it: every weight moved
    by the same amount from version 1 to 2 (had shard 1 lost the folded push, its weights would
    have moved by a 34th of shard 0's)."""
    run = FoldThenStop(shard_daemons, KOFN)
    try:
        late = run.fold_then_stop(signal.SIGTERM)
        assert run.daemons.procs[1].returncode == 0
        run.step("w0", 1, run.results["w0"].versions).join(2 * TIMEOUT_S)
        run.step("w2", 1, run.results["w2"].versions).join(2 * TIMEOUT_S)
        late.join(2 * TIMEOUT_S)
        run.check()
        assert all(c.lost_pushes == 0 for c in run.clients.values())
        assert run.results["w0"].versions == run.results["w1"].versions == [2, 2]
        moved = [
            p.detach() - w
            for p, w in zip(run.models["w0"].parameters(), run.weights_at_1, strict=True)
        ]
        deltas = torch.cat([d.flatten() for d in moved])
        assert deltas.abs().min() > 0
        torch.testing.assert_close(deltas, torch.full_like(deltas, deltas[0].item()))
        log = (run.daemons.tmp / "ps-1.log").read_text()
        assert "handed itself to its standby" in log, log[-2000:]
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_take_over_after_a_fold_counts_the_folded_push_as_lost(shard_daemons):
    """SIGKILL, with every update mirrored to the standby (shard_replicas = 2): the open step
    dies with shard 1's process. b comes back on the standby one push short (its folded one),
    gives its last push again, and counts the other as lost; the others lose nothing, and step
    1 is applied on the standby with them."""
    run = FoldThenStop(shard_daemons, [*KOFN, "--set", "shard_replicas=2"])
    try:
        late = run.fold_then_stop(signal.SIGKILL)
        others = [run.step(w, 1, run.results[w].versions) for w in ("w0", "w2")]
        for t in [late, *others]:
            t.join(2 * TIMEOUT_S)
        run.check()
        assert run.clients["w1"].lost_pushes == 1
        assert run.clients["w0"].lost_pushes == run.clients["w2"].lost_pushes == 0
        assert all(r.versions == [2, 2] for r in run.results.values()), run.results
    finally:
        run.close()


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
