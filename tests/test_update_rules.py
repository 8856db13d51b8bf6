"""Update rules in-process on a ShardService: wave groups (the synchronous tick and tock groups
of the MLSys 2021 design), the step size per update, and momentum corrected for asynchrony."""

import numpy as np
import pytest
import torch
from helpers import ServiceWave, push_header, reply_of, service_for

from wavelet.common.config import JobConfig, concrete_updates, launch_updates
from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import Header, Op, encode
from wavelet.common.settings import ConfigError
from wavelet.ps.update_rules import corrected_momentum, update_lr_factor
from wavelet.scripts.compare import default_modes, mode_job
from wavelet.scripts.modes import DEFAULT_MODES, MODES
from wavelet.scripts.tune import settings_for

LR = 0.1


def _service(tmp_path, waves=4, **job):
    settings = dict(optimizer=OptimizerConfig(lr=LR, kwargs={"momentum": 0}), staleness=1)
    return service_for(tmp_path, job={**settings, **job}, expect_waves=waves, shm=False)


def _grads(wave, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.numel, generator=g) for c in wave.chunks]


def _push(wave, clock, read, grads) -> list:
    """Push and pull (as a wave does): every message the shard answers with."""
    h = push_header(
        wave.plan.fingerprint, wave.chunks, wave.worker, wave.wave, clock=clock, read_version=read
    )
    h.op = Op.PUSH_PULL
    return wave.service.handle(wave.peer, [bytes(f) for f in encode(h, grads)])


def _weights(service):
    return [v.numpy().copy() for v in service.shard.values()]


def _grid(service):
    """Two workers with a tick (0) and a tock (1) wave each, registered, all at version 0."""
    waves = {(w, i): ServiceWave(service, worker=w, wave=i) for w in ("a", "b") for i in (0, 1)}
    for wave in waves.values():
        wave.join()
    return waves


def test_a_wave_group_averages_its_gradients_into_one_update(tmp_path):
    service = _service(tmp_path, updates="wave-groups")
    try:
        waves = _grid(service)
        w0 = _weights(service)
        ga, gb = _grads(waves["a", 0], 1), _grads(waves["b", 0], 2)
        assert _push(waves["a", 0], 0, 0, ga) == []  # its pull waits for the group's update
        assert service.shard.version == 0
        out = _push(waves["b", 0], 0, 0, gb)  # the group is complete: one update
        assert service.shard.version == 1
        replies = sorted(reply_of(m).body["version"] for m in out)
        assert replies == [1, 1]  # both tick waves read the same version, their group's update
        for w, a, b, got in zip(w0, ga, gb, _weights(service), strict=True):
            np.testing.assert_allclose(got, w - LR * (a.numpy() + b.numpy()) / 2, atol=1e-6)
        # the tock group pushes from version 0 too: one more update, one group-step stale
        _push(waves["a", 1], 0, 0, _grads(waves["a", 1], 3))
        _push(waves["b", 1], 0, 0, _grads(waves["b", 1], 4))
        assert service.shard.version == 2
        for wave in ("a", "b"):
            assert service.stats[wave, 1].staleness == {1: 1}
    finally:
        service.close()


def _alternate(service, waves, clocks: int = 6) -> list[tuple[int, set]]:
    """Tick's waves push clock c, then tock's, for every c < ``clocks``, each from the version its
    last released pull read: (group, the waves whose pulls that group's pushes released) per
    group step."""
    read = {key: 0 for key in waves}
    steps = []
    for clock in range(clocks):
        for group in (0, 1):  # tick, then tock: half a cycle apart
            released = set()
            for worker in ("a", "b"):
                wave = waves[worker, group]
                for m in _push(wave, clock, read[worker, group], _grads(wave, clock)):
                    h = reply_of(m)
                    assert h.op == "reply", h.body
                    owner = next(k for k, w in waves.items() if w.peer == m.peer)
                    read[owner] = h.body["version"]
                    released.add(owner)
            steps.append((group, released))
    return steps


def test_wave_groups_alternate_and_every_update_is_one_step_stale(tmp_path):
    service = _service(tmp_path, updates="wave-groups")
    try:
        steps = _alternate(service, _grid(service))
        # a group's update releases its own waves' pulls: they need the other group one behind
        assert all(any(k[1] == group for k in released) for group, released in steps)
        assert service.shard.version == 12  # one update per group and clock
        for key, st in service.stats.items():
            # the first tick update is fresh; every other one had exactly one update of the
            # other group applied between its read and its push
            expected = {0: 1, 1: 5} if key[1] == 0 else {1: 6}
            assert dict(st.staleness) == expected, (key, st.staleness)
    finally:
        service.close()


def test_wave_turns_read_the_other_groups_latest_update(tmp_path):
    service = _service(tmp_path, updates="wave-turns")
    try:
        steps = _alternate(service, _grid(service))
        # a group's waves read only once the other group's update of the same turn is in
        assert all(k[1] != group for group, released in steps for k in released)
        assert service.shard.version == 12
        for key, st in service.stats.items():
            # tock's first push read the version it registered at, before tick's first update;
            # every other update was made from the weights the update before it left
            expected = {0: 6} if key[1] == 0 else {1: 1, 0: 5}
            assert dict(st.staleness) == expected, (key, st.staleness)
    finally:
        service.close()


def test_a_group_waits_its_turn(tmp_path):
    service = _service(tmp_path, updates="wave-groups")
    try:
        waves = _grid(service)
        tick = [waves["a", 0], waves["b", 0]]
        tock = [waves["a", 1], waves["b", 1]]
        for group, version in ((tick, 1), (tock, 2)):  # clock 0, in turn
            assert _push(group[0], 0, 0, _grads(group[0], 0)) == []  # its group's sum is open
            out = _push(group[1], 0, 0, _grads(group[1], 0))
            assert [reply_of(m).body["version"] for m in out] == [version, version]
        # tock pushes clock 1 before tick: its update lands, but its pulls of clock 2 wait for
        # tick's push of clock 1 (a plain staleness bound of 1 would let them read now)
        _push(tock[0], 1, 2, _grads(tock[0], 1))
        assert _push(tock[1], 1, 2, _grads(tock[1], 1)) == []
        assert service.shard.version == 3 and len(service.parked) == 2
        _push(tick[0], 1, 1, _grads(tick[0], 1))
        out = _push(tick[1], 1, 1, _grads(tick[1], 1))
        assert len(out) == 4 and len(service.parked) == 0  # both groups read clock 2
        assert {reply_of(m).body["version"] for m in out} == {4}
    finally:
        service.close()


def test_wave_groups_need_a_staleness_bound_of_at_least_one():
    with pytest.raises(ConfigError, match="staleness 0 asks for one bulk-synchronous update"):
        JobConfig(updates="wave-groups", staleness=0)


@pytest.mark.parametrize("rule", ["wave-groups", "wave-turns"])
@pytest.mark.parametrize(
    "unused, named",
    [
        ({"staleness": 2}, "staleness = 2"),
        ({"staleness": float("inf")}, "staleness = inf"),
        ({"stale_policy": "apply"}, "stale_policy = apply"),
    ],
)
def test_grouped_updates_refuse_a_bound_or_policy_they_would_ignore(rule, unused, named):
    with pytest.raises(ConfigError, match=f"so {named} would do nothing.*--updates async"):
        JobConfig(updates=rule, **unused)


@pytest.mark.parametrize(
    "job, said",
    [
        ({"updates": "wave-turns"}, "wave turns"),
        ({"updates": "wave-groups"}, "wave groups"),
        ({"updates": "async", "staleness": 0}, "bulk-synchronous (staleness bound 0)"),
        ({"updates": "async", "staleness": float("inf")}, "staleness bound inf"),
        ({"updates": "auto", "staleness": 3}, "staleness bound 3"),  # by hand: async
    ],
)
def test_wavelet_stats_names_each_shards_update_rule(tmp_path, job, said):
    service = _service(tmp_path, **job)
    try:
        assert service.updates.describe() == said
    finally:
        service.close()


def test_the_summary_says_a_rule_once_and_names_shards_only_where_they_differ():
    from wavelet.scripts.report import describe_rules

    same = [{"shard": i, "update_rule": "wave turns"} for i in range(2)]
    assert describe_rules(same) == "wave turns"
    # k of n counts the late pushes each shard saw
    apart = [
        {"shard": 1, "update_rule": "k of n (2 late pushes, fold them)"},
        {"shard": 0, "update_rule": "k of n (0 late pushes, fold them)"},
    ]
    assert describe_rules(apart) == (
        "shard 0: k of n (0 late pushes, fold them); shard 1: k of n (2 late pushes, fold them)"
    )
    assert describe_rules([{"shard": 0, "update_rule": ""}]) == ""
    # the waves take their batch from shard 0's replies: what another shard's balancer
    # measured sized nothing (it said "balanced" where shard 0 had kept the job's batch)
    measured = [
        {"shard": 0, "update_rule": "wave turns", "batches": ""},
        {"shard": 1, "update_rule": "wave turns", "batches": "balanced batches (waves 1.3x apart)"},
    ]
    assert describe_rules(measured) == "wave turns"
    measured[0]["batches"], measured[1]["batches"] = "balanced batches (waves 2.0x apart)", ""
    assert describe_rules(measured) == "wave turns, balanced batches (waves 2.0x apart)"
    apart[1]["batches"] = "balanced batches"
    assert describe_rules(apart).endswith(
        "shard 1: k of n (2 late pushes, fold them); balanced batches"
    )


def test_compare_modes_keep_their_own_rule_whatever_the_jobs():
    def run(mode, **job):
        return mode_job(MODES[mode], JobConfig(**job), ["cpu"], None)[0]

    # bsp is bulk-synchronous under a job that asks for wave turns (it was refused)
    bsp = run("bsp", updates="wave-turns")
    assert (bsp.updates, bsp.staleness) == ("async", 0)
    # a job's bound is for the asynchronous modes; the grouped ones run without it
    turns = run("ticktock-turns", staleness=3, stale_policy="drop")
    assert (turns.updates, turns.staleness, turns.stale_policy) == ("wave-turns", 1, "scale")
    bounded = run("ticktock-async", staleness=3, stale_policy="drop")
    assert (bounded.staleness, bounded.stale_policy) == (3, "drop")
    assert run("ticktock", staleness=3).updates == "async"  # auto with a bound of the user's


def test_tune_runs_a_grouped_rule_once_with_nothing_it_ignores():
    settings = settings_for([0, 1], ["apply", "scale"], ("async", "wave-turns"))
    assert [s.name for s in settings] == ["s=0 apply", "s=1 apply", "s=1 scale", "wave-turns"]
    turns = settings[-1]
    JobConfig(updates=turns.updates, staleness=turns.bound, stale_policy=turns.policy)


@pytest.mark.parametrize("rule,factor", [("full", 1.0), ("by-samples", 0.25)])
def test_by_samples_gives_a_push_its_share_of_the_job_step(tmp_path, rule, factor):
    service = _service(tmp_path, update_lr=rule, staleness=float("inf"))
    try:
        waves = _grid(service)
        w0 = _weights(service)
        g = _grads(waves["a", 0], 7)
        assert reply_of(_push(waves["a", 0], 0, 0, g)[0]).op == "reply"
        for w, x, got in zip(w0, g, _weights(service), strict=True):
            np.testing.assert_allclose(got, w - factor * LR * x.numpy(), atol=1e-6)
    finally:
        service.close()


def test_by_samples_in_wave_groups_is_the_group_share(tmp_path):
    service = _service(tmp_path, updates="wave-groups", update_lr="by-samples")
    try:
        waves = _grid(service)
        w0 = _weights(service)
        ga, gb = _grads(waves["a", 0], 1), _grads(waves["b", 0], 2)
        _push(waves["a", 0], 0, 0, ga)
        _push(waves["b", 0], 0, 0, gb)
        for w, a, b, got in zip(w0, ga, gb, _weights(service), strict=True):
            # two of four waves' samples: half the step all-reduce takes for all four
            np.testing.assert_allclose(got, w - 0.5 * LR * (a + b).numpy() / 2, atol=1e-6)
    finally:
        service.close()


def test_lr_factor_rules():
    assert update_lr_factor("full", 1, 8) == 1.0
    assert update_lr_factor("by-samples", 1, 8) == 0.125
    assert update_lr_factor("by-samples", 8, 8) == 1.0
    assert update_lr_factor("by-samples", 1, 0) == 1.0  # waves unknown: the full step


def test_momentum_correction_lowers_the_shards_momentum(tmp_path):
    assert corrected_momentum(0.9, 1) == pytest.approx(0.9)
    assert corrected_momentum(0.9, 2) == pytest.approx(0.8)
    assert corrected_momentum(0.9, 4) == pytest.approx(0.6)
    assert corrected_momentum(0.7, 4) == 0.0
    momentum = {"momentum": 0.9}
    cases = [
        (dict(staleness=float("inf")), 0.6),  # 4 asynchronous waves
        (dict(updates="wave-groups"), 0.8),  # 2 groups
        (dict(updates="wave-turns"), 0.9),  # groups in strict turns: one stream
        (dict(staleness=0), 0.9),  # one bulk-synchronous stream
    ]
    for n, (job, want) in enumerate(cases):
        service = _service(
            tmp_path / str(n),
            optimizer=OptimizerConfig(lr=LR, kwargs=momentum),
            momentum_correction=True,
            **job,
        )
        try:
            assert service.shard.optimizer_config.kwargs["momentum"] == pytest.approx(want)
        finally:
            service.close()


def test_learning_rate_schedules_over_progress():
    from wavelet.common.schedule import WARMUP, lr_factor

    assert lr_factor("constant", 0.7) == 1.0
    assert lr_factor("cosine", 0.0) == 1.0 and lr_factor("cosine", 1.0) < 1e-12
    warm = [lr_factor("warmup-cosine", p / 100) for p in range(101)]
    climb = int(WARMUP * 100)
    assert warm[0] > 0 and warm[: climb + 1] == sorted(warm[: climb + 1])  # a linear climb
    assert warm[climb // 2] == pytest.approx(0.5)
    assert warm[climb] == 1.0 and warm[climb:] == sorted(warm[climb:], reverse=True)
    assert warm[-1] < 1e-12
    with pytest.raises(ValueError, match="choose one of constant, cosine, warmup-cosine"):
        lr_factor("linear", 0.5)


@pytest.mark.parametrize(
    "cpu_workers, ticktock, job, rule",
    [
        (True, True, {}, "wave-turns"),  # a CPU computes one wave at a time: turns cost nothing
        (False, True, {}, "async"),  # a GPU's waves overlap
        (True, False, {}, "async"),  # waves started together, or one process per wave
        (True, True, {"waves": 1}, "async"),
        (True, True, {"staleness": 0}, "async"),  # a bound or a policy of the user's: async
        (True, True, {"staleness": 4}, "async"),
        (True, True, {"staleness": float("inf")}, "async"),
        (True, True, {"stale_policy": "dc-asgd"}, "async"),
        (True, True, {"updates": "async"}, "async"),  # a rule of the user's is kept
        (False, True, {"updates": "wave-turns"}, "wave-turns"),
        (True, True, {"updates": "wave-groups"}, "wave-groups"),
    ],
)
def test_auto_updates_are_wave_turns_only_where_waves_compute_one_at_a_time(
    cpu_workers, ticktock, job, rule
):
    assert JobConfig().updates == "auto"
    got = concrete_updates(JobConfig(**job), cpu_workers, ticktock)
    assert got.updates == rule
    assert got.staleness == JobConfig(**job).staleness  # nothing else changes


def test_the_launchers_decide_auto_from_their_devices_and_schedule():
    def rule(**launch):
        return LaunchConfig(**launch).concrete_job().updates

    assert rule(devices=["cpu", "cpu"]) == "wave-turns"
    assert launch_updates(JobConfig(), ["cuda:0", "cuda:1"]).updates == "async"
    assert launch_updates(JobConfig(), ["cpu", "cuda:0"]).updates == "async"
    assert rule(schedule="together") == "async"
    assert rule(processes_per_device=2) == "async"
    assert rule(mode="allreduce") == "async"


def test_compare_runs_both_rules_by_default_where_ticktock_is_wave_turns():
    cpu = default_modes(JobConfig(), ["cpu"], budget=False)
    assert "ticktock" in cpu and "ticktock-async" in cpu and "ticktock-turns" not in cpu
    assert default_modes(JobConfig(), ["cpu"], budget=True)[:3] == [
        "ticktock",
        "bsp",
        "ticktock-async",
    ]
    gpu = default_modes(JobConfig(), ["cuda:0"], budget=False)
    assert gpu == DEFAULT_MODES and "ticktock-turns" in gpu
    bounded = default_modes(JobConfig(staleness=4), ["cpu"], budget=False)
    assert bounded == DEFAULT_MODES


@pytest.mark.parametrize("index, says", [(0, "balanced batches"), (1, "")])
def test_only_shard_0_says_how_the_batches_are_sized(tmp_path, index, says):
    """The waves take their batch from shard 0's replies (worker/rounds.py); every shard's
    balancer measures, but another shard saying "balanced" sized nothing."""
    job = {"updates": "wave-turns", "balance_batches": "on", "shards": 2, "staleness": 1}
    service = service_for(tmp_path, job=job, expect_waves=2, shm=False, shard_index=index)
    try:
        (reply,) = service.handle(b"peer", [bytes(f) for f in encode(Header(op=Op.STATS))])
        body = reply_of(reply).body
        assert body["update_rule"] == "wave turns" and body["batches"] == says
    finally:
        service.close()
