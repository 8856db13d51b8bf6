"""The top-level ``wavelet`` package (setup.cfg maps it to this folder): the Python API of
scripts/api.py, ``wavelet.JobConfig``, ``wavelet.launch`` and ``wavelet.compare``; the layers
are its subpackages ``wavelet.common``, ``wavelet.ps``, ``wavelet.worker`` and
``wavelet.scripts``."""

from wavelet.scripts.api import ConfigError, JobConfig, JobFailed, LaunchConfig, compare, launch

__all__ = ["ConfigError", "JobConfig", "JobFailed", "LaunchConfig", "compare", "launch"]
