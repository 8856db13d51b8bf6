"""Update rules that do not wait for the slowest: balanced batches keep a step the mean over all
its samples (one process on the concatenated batch, to 1e-5); k of n with every wave on time is
bulk-synchronous; a late push is folded or dropped as the policy says. The CPU caps that emulate
slow nodes are tested in test_cpu_caps.py, moving shards off them in test_placement.py."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ServiceWave, reply_of, service_for, tiny_model

from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import Op
from wavelet.common.sharding import chunk_view
from wavelet.ps.synchronous import SyncGroups


def _batch(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _gradients(wave: ServiceWave, batch) -> list[torch.Tensor]:
    """The mean cross-entropy's gradients on ``batch``, chunk by chunk, as a wave pushes them."""
    model = tiny_model()
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    params = dict(model.named_parameters())
    return [chunk_view(params[c.name].grad, c).clone() for c in wave.chunks]


def _push(wave: ServiceWave, clock: int, grads, samples: int):
    return wave.send(
        Op.PUSH,
        grads,
        clock=clock,
        read_version=0,
        keys=wave.keys,
        body={"samples": samples, "compute_s": 0.0},
    )


def _shard_values(service) -> list[torch.Tensor]:
    return [v.clone() for v in service.shard.values()]


def test_a_balanced_step_equals_one_process_on_the_concatenated_batch(tmp_path):
    """Two waves of a bulk-synchronous step with batches of 8 and 24 samples: the update is one
    optimizer step on the mean loss over all 32, as one process on the whole batch takes."""
    service = service_for(tmp_path, job={"staleness": 0, "balance_batches": "on"})
    try:
        a, b = ServiceWave(service, "w0"), ServiceWave(service, "w1")
        a.join(), b.join()
        small, large = _batch(1, 8), _batch(2, 24)
        _push(a, 0, _gradients(a, small), 8)
        _push(b, 0, _gradients(b, large), 24)
        assert service.shard.version == 1
        got = _shard_values(service)
    finally:
        service.close()
    model = tiny_model()
    opt = OptimizerConfig().build(list(model.parameters()))
    x = torch.cat([small[0], large[0]])
    y = torch.cat([small[1], large[1]])
    F.cross_entropy(model(x), y).backward()
    opt.step()
    params = dict(model.named_parameters())
    want = [chunk_view(params[c.name].detach(), c) for c in a.chunks]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def test_a_balanced_steps_batchnorm_statistics_are_one_process_on_the_concatenated_batch(
    tmp_path,
):
    """Batches of 6 and 26 samples: the running mean the shard serves after their step is the
    one a single process's step on all 32 leaves (each wave's upload weighed by its samples;
    unweighed, the 6 samples counted as much as the 26)."""
    service = service_for(tmp_path, job={"staleness": 0, "balance_batches": "on"})
    try:
        waves = [ServiceWave(service, f"w{i}", model=_bn_model()) for i in range(2)]
        for w in waves:
            w.join()
        batches = [_batch(1, 6), _batch(2, 26)]
        for w, (x, y) in zip(waves, batches, strict=True):
            F.cross_entropy(w.model(x), y).backward()  # its running statistics move too
            values = dict(w.model.named_parameters())
            tensors = [
                chunk_view(values[c.name].grad if c.trainable else w.tensors[c.name], c)
                for c in w.chunks
            ]
            _push(w, 0, tensors, len(y))
        assert service.shard.version == 1
        reference = _bn_model()
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        F.cross_entropy(reference(x), y).backward()
        buffers = dict(reference.named_buffers())
        served = [c for c in waves[0].chunks if not c.trainable]
        assert {c.name for c in served} >= {"1.running_mean", "1.num_batches_tracked"}
        for c in served:
            got = service.shard.buffer_value(c.key)
            if c.name == "1.running_mean":
                torch.testing.assert_close(got, chunk_view(buffers[c.name], c), rtol=0, atol=1e-5)
            elif c.name == "1.num_batches_tracked":
                assert int(got) == 1
    finally:
        service.close()


def _step_and_push(wave: ServiceWave, service, clock: int, read, batch) -> None:
    """``wave`` loads what it ``read`` (version, values: weights and served statistics), takes
    a training step on ``batch`` (its running statistics move) and pushes its gradients and
    statistics."""
    version, values = read
    for c, value in zip(wave.chunks, values, strict=True):
        chunk_view(wave.tensors[c.name], c).data.copy_(value)
    wave.model.zero_grad()
    F.cross_entropy(wave.model(batch[0]), batch[1]).backward()
    params = dict(wave.model.named_parameters())
    tensors = [
        chunk_view(params[c.name].grad if c.trainable else wave.tensors[c.name], c)
        for c in wave.chunks
    ]
    wave.send(
        Op.PUSH, tensors, clock=clock, read_version=version, keys=wave.keys,
        body={"samples": len(batch[1]), "compute_s": 0.0},
    )  # fmt: skip


def test_wave_turns_serve_each_steps_statistics_as_one_process_on_its_batch(tmp_path):
    """Wave turns, two workers of two waves: the tick waves' step, then the tock waves' on the
    weights and statistics it made. After each, the served running mean is the one a single
    process leaves after the same steps on each step's concatenated batch; a mean over all four
    waves' uploads mixed the other group's statistics of the step before into it, and followed
    the model about 1.5x more slowly."""
    service = service_for(
        tmp_path, job={"updates": "wave-turns", "staleness": 1, "balance_batches": "off"}
    )
    try:
        waves = {
            (w, i): ServiceWave(service, f"w{w}", wave=i, model=_bn_model())
            for i in (0, 1)
            for w in (0, 1)
        }
        for wave in waves.values():
            wave.join()
        batches = {key: _batch(10 + 2 * key[1] + key[0], 8) for key in waves}
        mean = next(c for c in waves[0, 0].chunks if c.name == "1.running_mean")
        for group in (0, 1):
            # the group's waves read the same version before either pushes, as in a turn
            read = (service.shard.version, [v.clone() for v in service.shard.values()])
            for w in (0, 1):
                _step_and_push(waves[w, group], service, 0, read, batches[w, group])
            assert service.shard.version == group + 1
            # one process's BatchNorm step on the group's concatenated batch, from the weights
            # and statistics the group read
            with torch.no_grad():
                layer = waves[0, group].model[0]  # the weights read (a push changes none)
                x = torch.cat([batches[w, group][0] for w in (0, 1)])
                want = 0.9 * read[1][mean.key] + 0.1 * layer(x).mean(0)
            got = service.shard.buffer_value(mean.key)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    finally:
        service.close()


def test_async_waves_move_the_statistics_as_one_process_does_batch_by_batch(tmp_path):
    """Asynchronous waves, two of one worker, each reading the newest version before its step
    and one reading a version behind: after each push the served running mean is one process's
    BatchNorm steps on the batches in the order they came, where a wave that read the latest
    statistics; one that read older ones moves them by what its own step changed. A mean over
    the waves' latest uploads moved the statistics once per round of both waves."""
    service = service_for(tmp_path, job={"updates": "async", "staleness": 4})
    try:
        waves = [ServiceWave(service, "w0", wave=i, model=_bn_model()) for i in (0, 1)]
        for wave in waves:
            wave.join()
        mean = next(c for c in waves[0].chunks if c.name == "1.running_mean")

        def read():
            return service.shard.version, [v.clone() for v in service.shard.values()]

        def batch_mean(wave, reading, x):
            with torch.no_grad():  # the layer as the wave had it: the weights it read
                for c, value in zip(wave.chunks, reading[1], strict=True):
                    chunk_view(wave.tensors[c.name], c).data.copy_(value)
                return wave.model[0](x).mean(0)

        want = service.shard.buffer_value(mean.key).clone()
        for clock in range(3):  # each wave in turn on the newest version: one process's steps
            for i, wave in enumerate(waves):
                reading, batch = read(), _batch(20 + 2 * clock + i, 8)
                want = 0.9 * want + 0.1 * batch_mean(wave, reading, batch[0])
                _step_and_push(wave, service, clock, reading, batch)
                got = service.shard.buffer_value(mean.key)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # both read the same version; wave 1 pushes second, one version stale: its step's
        # change to the statistics it read is added to what wave 0's step left
        reading = read()
        batches = [_batch(40 + i, 8) for i in (0, 1)]
        moves = []
        for wave, batch in zip(waves, batches, strict=True):
            m = batch_mean(wave, reading, batch[0])
            moves.append(0.1 * (m - reading[1][mean.key]))
        for wave, batch in zip(waves, batches, strict=True):
            _step_and_push(wave, service, 3, reading, batch)
        got = service.shard.buffer_value(mean.key)
        torch.testing.assert_close(got, want + moves[0] + moves[1], rtol=0, atol=1e-6)
    finally:
        service.close()


def test_an_async_push_the_policy_drops_leaves_the_statistics_as_they_were(tmp_path):
    """A push too stale for the drop policy changes nothing: its gradients and its BatchNorm
    statistics alike (which moved without a version, a wave that read that version afterwards
    counted their change twice)."""
    job = {"updates": "async", "staleness": 4, "stale_policy": "drop", "drop_limit": 0}
    service = service_for(tmp_path, job=job)
    try:
        waves = [ServiceWave(service, "w0", wave=i, model=_bn_model()) for i in (0, 1)]
        for wave in waves:
            wave.join()
        reading = (service.shard.version, _shard_values(service))
        statistics = [c.key for c in waves[0].chunks if not c.trainable]

        def served():
            values = _shard_values(service)
            return values + [service.shard.buffer_value(k).clone() for k in statistics]

        _step_and_push(waves[0], service, 0, reading, _batch(1, 8))  # fresh: applied
        applied = served()
        assert service.shard.version == reading[0] + 1
        _step_and_push(waves[1], service, 0, reading, _batch(2, 8))  # one behind: dropped
        assert service.stats[("w0", 1)].dropped == 1
        assert service.shard.version == reading[0] + 1
        for before, now in zip(applied, served(), strict=True):
            torch.testing.assert_close(now, before, rtol=0, atol=0)
    finally:
        service.close()


def test_a_waves_speed_is_the_batch_its_compute_time_measured(tmp_path):
    """A push says how long the wave's previous batch took (this one's push may leave during
    backward): where balancing cut the batch from 32 to 8, the speed is 32 samples over that
    time, not 8; and a negative count is refused, with nothing applied."""
    from wavelet.ps.balance import WARMUP

    service = service_for(tmp_path, job={"staleness": 0, "balance_batches": "on"})
    try:
        a = ServiceWave(service, "w0")
        a.join()
        grads = _gradients(a, _batch(1, 8))
        measured = {"samples": 8, "compute_s": 0.1, "compute_samples": 32}
        for clock in range(WARMUP + 1):
            a.send(Op.PUSH, grads, clock=clock, read_version=clock, keys=a.keys, body=measured)
        assert service.shard.version == WARMUP + 1
        assert service.updates.balancer.speed[("w0", 0)] == pytest.approx(320)
        bad = {**measured, "compute_samples": -1}
        clock = WARMUP + 1
        out = a.send(Op.PUSH, grads, clock=clock, read_version=clock, keys=a.keys, body=bad)
        assert reply_of(out[0]).op == Op.ERROR and service.shard.version == clock
    finally:
        service.close()


KOFN = {"updates": "k-of-n", "staleness": 1}  # the default bound: k of n has none of its own


@pytest.mark.parametrize("rule", [{**KOFN, "sync_quorum": 1}, {"staleness": 0}])
def test_with_every_wave_on_time_k_of_n_and_balanced_equal_bulk_synchronous(
    tmp_path, monkeypatch, rule
):
    """Three waves, every one on time (the grace after the quorum is long here): k of n with a
    quorum of 1, and balanced batches of equal size, give bulk-synchronous training's weights."""
    monkeypatch.setattr(SyncGroups, "MIN_GRACE_S", 3600.0)
    batches = [[_batch(10 * w + s, 8) for s in range(3)] for w in range(3)]

    def train(job: dict) -> list[torch.Tensor]:
        service = service_for(tmp_path / str(len(list(tmp_path.iterdir()))), job=job)
        try:
            waves = [ServiceWave(service, f"w{i}") for i in range(3)]
            for w in waves:
                w.join()
            for step in range(3):
                for i, w in enumerate(waves):
                    _push(w, step, _gradients(w, batches[i][step]), 8)
                for w in waves:
                    w.request(Op.PULL, clock=step + 1)  # read before the next step
            assert service.shard.version == 3
            return _shard_values(service)
        finally:
            service.close()

    bsp = train({"staleness": 0, "balance_batches": "off"})
    other = train({**rule, "balance_batches": "on"})
    for a, b in zip(bsp, other, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("late", ["fold", "drop"])
def test_a_late_push_under_k_of_n_is_folded_or_dropped(tmp_path, monkeypatch, late):
    """Quorum 1 and no grace: wave a's push closes step 0 alone. Wave b's push for step 0 comes
    late: folded, it counts in step 1's mean beside a's push for step 1; dropped, it changes
    nothing and is counted as dropped."""
    monkeypatch.setattr(SyncGroups, "MIN_GRACE_S", 0.0)
    # and no grace after a recent step's time either: under load the step before could take
    # long enough that a quarter of it had not passed when the test looks (seen with -n 3)
    monkeypatch.setattr(SyncGroups, "LATE_FACTOR", 0.0)
    job = {**KOFN, "sync_quorum": 1, "late_pushes": late, "balance_batches": "off"}
    service = service_for(tmp_path, job=job)
    try:
        a, b = ServiceWave(service, "w0"), ServiceWave(service, "w1")
        a.join(), b.join()
        _push(a, 0, a_grads := [torch.full_like(t, 1.0) for t in _gradients(a, _batch(1, 4))], 4)
        service.tick()
        assert service.shard.version == 1  # closed by a alone
        after_a = _shard_values(service)
        out = _push(b, 0, [torch.full_like(t, 3.0) for t in a_grads], 4)
        assert out == [] or all(o.header.op != Op.ERROR for o in out)
        assert service.shard.version == 1  # b's late push applies nothing by itself
        a.request(Op.PULL, clock=1)
        _push(a, 1, [torch.full_like(t, 1.0) for t in a_grads], 4)
        service.tick()
        assert service.shard.version == 2
        pushes = [r for r in _push_log(tmp_path) if r["worker"] == "w1"]
        assert pushes[-1]["action"] == ("folded" if late == "fold" else "dropped")
        waves = service.members.table()
        assert waves["w1/0"]["dropped"] == (1 if late == "drop" else 0)
        # step 1's mean: (1 + 3) / 2 = 2 folded, or 1 alone with b's dropped: the second
        # update moved the weights as far as a gradient of 2 (or 1) would have
        moved = [
            (x - y).abs().max().item() for x, y in zip(after_a, _shard_values(service), strict=True)
        ]
    finally:
        service.close()
    reference = service_for(tmp_path / "ref", job={**job, "sync_quorum": 1})
    try:
        r = ServiceWave(reference, "w0")
        r.join()
        _push(r, 0, [torch.full_like(t, 1.0) for t in a_grads], 4)
        reference.tick()
        before = _shard_values(reference)
        r.request(Op.PULL, clock=1)
        value = 2.0 if late == "fold" else 1.0
        _push(r, 1, [torch.full_like(t, value) for t in a_grads], 4)
        reference.tick()
        want = [
            (x - y).abs().max().item()
            for x, y in zip(before, _shard_values(reference), strict=True)
        ]
    finally:
        reference.close()
    assert moved == pytest.approx(want, rel=1e-5)


class _Clock:
    """time.monotonic for ps/synchronous.py, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_wave_turns_with_patience_go_on_without_a_late_wave_and_fold_its_push(
    tmp_path, monkeypatch
):
    """Two waves of one group under wave turns, patience 1: five steps with both on time, a
    turn each second, are the mean of both (as without patience); at step 5 wave b is late:
    the update waits one turn for it (not 0.6 of one), then goes ahead with a's gradient
    alone; b's push, when it comes, is folded into step 6 beside both waves' pushes for it.
    The weights equal one wave's steps on those means, to 1e-5."""
    import wavelet.ps.synchronous as synchronous

    clock = _Clock()
    monkeypatch.setattr(synchronous, "time", clock)
    job = {"updates": "wave-turns", "staleness": 1, "turn_patience": 1.0, "balance_batches": "off"}
    service = service_for(tmp_path, job=job)
    try:
        a, b = ServiceWave(service, "w0"), ServiceWave(service, "w1")
        a.join(), b.join()
        grads = _gradients(a, _batch(1, 4))
        one = [torch.full_like(t, 1.0) for t in grads]
        three = [torch.full_like(t, 3.0) for t in grads]
        for step in range(5):
            for w, g in ((a, one), (b, three)):
                w.request(Op.PULL, clock=step)
                _push(w, step, g, 4)
            assert service.shard.version == step + 1  # closed by both
            clock.now += 1.0
        a.request(Op.PULL, clock=5)
        _push(a, 5, one, 4)
        clock.now += 0.6
        service.tick()
        assert service.shard.version == 5  # b is late by less than a turn: waited for
        clock.now += 0.5
        service.tick()
        assert service.shard.version == 6  # by more: a's gradient alone
        out = _push(b, 5, three, 4)
        assert out == [] or all(o.header.op != Op.ERROR for o in out)
        assert service.shard.version == 6  # the late push applies nothing by itself
        for w, g in ((a, one), (b, three)):
            w.request(Op.PULL, clock=6)
            _push(w, 6, g, 4)
        assert service.shard.version == 7
        assert [r["action"] for r in _push_log(tmp_path) if r["worker"] == "w1"][-2] == "folded"
        assert "1 without a late wave" in service.updates.describe()
        got = _shard_values(service)
    finally:
        service.close()
    reference = service_for(tmp_path / "ref", job={"staleness": 0, "balance_batches": "off"})
    try:
        r = ServiceWave(reference, "w0")
        r.join()
        for step, value in enumerate([2.0] * 5 + [1.0, 7.0 / 3.0]):
            r.request(Op.PULL, clock=step)
            _push(r, step, [torch.full_like(t, value) for t in grads], 4)
        assert reference.shard.version == 7
        want = _shard_values(reference)
    finally:
        reference.close()
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def _push_log(run_dir: Path) -> list[dict]:
    from wavelet.common.records import read_records

    return list(read_records(run_dir / "records" / "ps-0-pushes.jsonl"))
