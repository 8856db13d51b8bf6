"""The modes ``wavelet compare`` runs a job in: tick-tock on the PS (over shared memory, over TCP,
with the thread pool sized for one wave, with asynchronous updates or wave groups, with a bf16
wire), one wave per device, two waves started together (no baton), two worker processes per
device, bulk-synchronous tick-tock, and all-reduce data parallel (one rank per device, two, one
with activation checkpointing, one with bf16 gradient buckets).

Apart from compare.py so that the command line can name them without importing what runs them:
every daemon parses its command line, and compare's imports cost a daemon about 0.2 s of CPU.
"""

from __future__ import annotations

import dataclasses

from wavelet.common.config import JobConfig
from wavelet.common.machine import usable_cores
from wavelet.common.settings import ConfigError


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to train the job: launch settings and job settings over the job's own."""

    description: str
    launch: dict
    job: dict
    # How many tasks' activations a device holds at once at most, for the equal-memory search:
    # the baton lets tick-tock's second wave start only once the first holds baton_handoff of
    # its peak (None: 1 + the job's baton_handoff, or 1 where the waves compute one at a time).
    tasks_at_once: float | None
    allreduce: bool = False

    def at_once(self, job: JobConfig, one_at_a_time: bool) -> float:
        """How many tasks' saved activations a device holds at once, in waves' peaks."""
        if self.tasks_at_once is not None:
            return self.tasks_at_once
        if job.updates == "wave-turns":  # a group reads, so starts its forward, after the
            return 1.0  # other group's backward and update
        return 1.0 if one_at_a_time else 1.0 + job.baton_handoff


MODES: dict[str, Mode] = {
    "ticktock": Mode(
        "PS, 2 waves per device taking turns at forward (shared memory to co-located shards)",
        {"schedule": "ticktock"},
        {"waves": 2},
        None,
    ),
    "ticktock-async": Mode(
        "PS, 2 waves tick-tock, every push an update on arrival (updates = async)",
        {"schedule": "ticktock"},
        {"waves": 2, "updates": "async"},
        None,
    ),
    "ticktock-groups": Mode(
        "PS, 2 waves tick-tock, synchronous wave groups: the tick waves of all devices average "
        "into one update, the tock waves into the next (updates = wave-groups)",
        {"schedule": "ticktock"},
        {"waves": 2, "updates": "wave-groups"},
        None,
    ),
    "ticktock-turns": Mode(
        "PS, 2 waves tick-tock, wave groups in strict turns: each group reads the other's "
        "latest update, so none is stale (updates = wave-turns)",
        {"schedule": "ticktock"},
        {"waves": 2, "updates": "wave-turns"},
        None,  # one wave's activations at a time, as at_once counts wave turns
    ),
    "ticktock-turns-pull": Mode(
        "PS, 2 waves in strict turns, each layer's forward starting as soon as its own weights "
        "are in (updates = wave-turns, pull_during_forward)",
        {"schedule": "ticktock"},
        {"waves": 2, "updates": "wave-turns", "pull_during_forward": True},
        None,
    ),
    "ticktock-tcp": Mode(
        "PS, 2 waves tick-tock, tensors over TCP (ZeroMQ frames) even to co-located shards",
        {"schedule": "ticktock", "transport": "tcp"},
        {"waves": 2},
        None,
    ),
    "ticktock-wide": Mode(
        "PS, 2 waves tick-tock, the worker's thread pool sized for one wave at a time",
        {"schedule": "ticktock", "threads": usable_cores()},
        {"waves": 2},
        None,
    ),
    "single": Mode("PS, 1 wave per device", {"schedule": "ticktock"}, {"waves": 1}, 1.0),
    "together": Mode(
        "PS, 2 waves per device started together (no baton)",
        {"schedule": "together"},
        {"waves": 2},
        2.0,
    ),
    "procs": Mode(
        "PS, 2 worker processes per device, 1 wave each (waves as processes, no baton)",
        {"schedule": "together", "processes_per_device": 2},
        {"waves": 1},
        2.0,
    ),
    "bsp": Mode(
        "PS, 2 waves tick-tock, bulk-synchronous (s = 0)",
        {"schedule": "ticktock"},
        {"waves": 2, "staleness": 0, "updates": "async"},
        None,
    ),
    "allreduce": Mode(
        "all-reduce DDP, 1 rank per device (batch x 2; at a memory budget, the batch that fits)",
        {"mode": "allreduce", "processes_per_device": 1},
        {"waves": 2},
        1.0,
        allreduce=True,
    ),
    "allreduce2": Mode(
        "all-reduce DDP, 2 ranks per device",
        {"mode": "allreduce", "processes_per_device": 2},
        {"waves": 2},
        2.0,
        allreduce=True,
    ),
    "allreduce-ckpt": Mode(
        "all-reduce DDP, 1 rank per device, activation checkpointing of the model's blocks",
        {"mode": "allreduce", "processes_per_device": 1},
        {"waves": 2, "activation_checkpointing": True},
        1.0,
        allreduce=True,
    ),
    "ticktock-bf16": Mode(
        "PS, 2 waves tick-tock, gradients and weights in bf16 on the wire (fp32 master weights)",
        {"schedule": "ticktock"},
        {"waves": 2, "wire_dtype": "bf16"},
        None,
    ),
    "allreduce-bf16": Mode(
        "all-reduce DDP, 1 rank per device, gradient buckets all-reduced in bf16 (torch's "
        "bf16_compress_hook on GPUs; the same cast on CPUs): the fair baseline of a 16-bit PS",
        {"mode": "allreduce", "processes_per_device": 1},
        {"waves": 2, "wire_dtype": "bf16"},
        1.0,
        allreduce=True,
    ),
}
# Asked for by name: allreduce-ckpt is for memory budgets, ticktock-async is ticktock where the
# job's rule comes out async (default_modes runs it where ticktock is wave turns),
# ticktock-turns-pull is an experiment (docs/design.md, "Pulling during forward"), and the
# 16-bit pair compares wire dtypes (--modes ticktock-bf16,allreduce-bf16)
DEFAULT_MODES = [
    m
    for m in MODES
    if m
    not in (
        "allreduce-ckpt",
        "ticktock-async",
        "ticktock-turns-pull",
        "ticktock-bf16",
        "allreduce-bf16",
    )
]
# At a memory budget: the choices of a user whose model does not fit (docs/design.md)
BUDGET_MODES = [
    "ticktock",
    "bsp",
    "ticktock-turns",
    "single",
    "together",
    "allreduce",
    "allreduce2",
    "allreduce-ckpt",
]


def check_modes(modes: list[str]) -> list[str]:
    """``modes`` if each names a mode; else a ConfigError, before anything is made or run."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    if not modes:
        raise ConfigError("no modes to compare; name one or more, e.g. ticktock,allreduce")
    return modes
