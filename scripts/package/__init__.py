"""The top-level ``wavelet`` package (setup.cfg maps it to this folder): the Python API of
scripts/api.py, ``wavelet.JobConfig``, ``wavelet.launch``, ``wavelet.compare`` and
``wavelet.load_model``; the layers
are its subpackages ``wavelet.common``, ``wavelet.ps``, ``wavelet.worker`` and
``wavelet.scripts``.

The API is imported on first use, not here: every shard and worker process imports this
package, and the API pulls in the launcher, reports and matplotlib, which they never need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "ConfigError",
    "Dataset",
    "JobConfig",
    "JobFailed",
    "LaunchConfig",
    "OptimizerConfig",
    "compare",
    "launch",
    "load_model",
]

if TYPE_CHECKING:
    from wavelet.scripts.api import (
        ConfigError,
        Dataset,
        JobConfig,
        JobFailed,
        LaunchConfig,
        OptimizerConfig,
        compare,
        launch,
        load_model,
    )


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("wavelet.scripts.api"), name)
    raise AttributeError(f"module 'wavelet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)  # the public names, not this module's own imports
