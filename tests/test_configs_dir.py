"""The job files shipped in configs/ load and validate."""

from pathlib import Path

import pytest

from wavelet.common.config import JobConfig
from wavelet.common.settings import from_dict, load_toml

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_is_valid(path):
    job = from_dict(JobConfig, load_toml(path))
    assert job.batch_size > 0


def test_digits_config_is_the_default_job():
    job = from_dict(JobConfig, load_toml(CONFIGS[0].parent / "digits.toml"))
    default = JobConfig()
    assert job.optimizer.effective_kwargs == default.optimizer.effective_kwargs
    job.optimizer = default.optimizer
    assert job == default
