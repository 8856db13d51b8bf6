"""A shard's work over all of a push's tensors at once (ps/shard.py): the finite check finds the
same tensor the one-by-one check would, and the served buffers are each buffer's own mean over
the waves, as one buffer at a time gives them. And the benchmark that measures it runs."""

import pytest
import torch
from conftest import run_benchmark
from helpers import ServiceWave, service_for

from wavelet.ps.finite import first_non_finite


def _tensors():
    return [
        torch.ones(5),
        torch.arange(4),  # an integer buffer: never checked
        torch.full((3,), 2.0, dtype=torch.bfloat16),
        torch.zeros(0),
        torch.ones(7, dtype=torch.float16),
    ]


@pytest.mark.parametrize("bad", [0, 2, 4])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_the_first_non_finite_tensor_is_found_whatever_its_dtype(bad, value):
    tensors = _tensors()
    assert first_non_finite(tensors) is None
    tensors[bad][1] = value
    assert first_non_finite(tensors) == bad
    later = _tensors()
    later[bad][0] = value
    later[4][2] = float("nan")  # a second one further on: the first is named
    assert first_non_finite(later) == bad


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((4,), 3e38)  # each finite, their sum is not
    assert first_non_finite([big, torch.ones(2)]) is None
    half = torch.full((4,), 60000.0, dtype=torch.float16)  # beyond float16's range summed
    assert first_non_finite([torch.ones(2), half]) is None
    half[3] = float("inf")
    assert first_non_finite([torch.ones(2), half]) == 1
    assert first_non_finite([]) is None


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 3),
        torch.nn.BatchNorm1d(3),
    )


@pytest.mark.parametrize("samples", [(32, 32, 32), (6, 26, 13), (0, 26, 13)])
def test_served_buffers_are_each_buffers_own_mean_over_the_waves(tmp_path, samples):
    """Three waves upload their own BatchNorm statistics, with equal, unequal or untold samples:
    the values a pull serves (all buffers at once) are those of one buffer at a time (the mean
    a synchronous rule serves; asynchronous waves' uploads move the statistics in turn)."""
    service = service_for(tmp_path, shm=False, job={"staleness": 0})
    try:
        wave = ServiceWave(service, model=_bn_model())
        wave.join()
        shard = service.shard
        buffers = [s for s in shard.specs if not s.trainable]
        assert sum(s.desc.torch_dtype.is_floating_point for s in buffers) >= 2
        assert sum(not s.desc.torch_dtype.is_floating_point for s in buffers) >= 2
        g = torch.Generator().manual_seed(1)
        for i, n in enumerate(samples):
            values = [  # every chunk's, in plan order, as a push carries them
                torch.randn(s.desc.numel, generator=g)
                if s.desc.torch_dtype.is_floating_point
                else torch.randint(0, 50, (s.desc.numel,), generator=g)
                for s in shard.specs
            ]
            shard.store_buffers(("w", i), values, samples=n)
        served = dict(zip(shard.keys, shard.values(), strict=True))
        for s in buffers:
            one = shard.buffer_value(s.key)
            assert served[s.key].dtype == one.dtype and served[s.key].shape == one.shape
            torch.testing.assert_close(served[s.key], one, rtol=0, atol=1e-6)
        # a wave that uploaded only some buffers: each buffer's mean over those that have it
        shard.wave_buffers[("w", 0)].pop(buffers[0].key)
        served = dict(zip(shard.keys, shard.values(), strict=True))
        for s in buffers:
            torch.testing.assert_close(served[s.key], shard.buffer_value(s.key), rtol=0, atol=0)
    finally:
        service.close()


def test_the_shard_cpu_benchmark_runs():
    args = ["--rounds", "1", "--pushes", "3", "--warmup", "1", "--width", "4"]
    out = run_benchmark("bench_shard_cpu.py", *args, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU ms per push in ShardService.handle" in out.stdout
    for part in ("finite check", "buffers' mean"):
        assert f"| {part} |" in out.stdout, out.stdout
