"""Learning-rate schedules as a factor of training progress (0 at the start, 1 at the end).

Progress, not step count, so that every mode shares one schedule: a wave sends its factor with
each push and the shard scales that update's learning rate; the all-reduce mode scales its own.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "warmup-cosine")
WARMUP = 0.1  # warmup-cosine: the share of the budget the factor climbs from 0 to 1 over


def lr_factor(schedule: str, progress: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "warmup-cosine":
        # a linear start (Goyal et al. 2017): the first, largest gradients are also the ones
        # stale updates overshoot on; the floor keeps the very first step from being no step
        if progress < WARMUP:
            return max(progress / WARMUP, 0.01)
        return 0.5 * (1.0 + math.cos(math.pi * (progress - WARMUP) / (1.0 - WARMUP)))
    raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def progress(iteration: int, total_iterations: int, elapsed_s: float, budget_s: float) -> float:
    """How far through its budget (epochs, seconds, or whichever ends first) a task is."""
    done = iteration / total_iterations if total_iterations else 0.0
    if budget_s:
        done = max(done, elapsed_s / budget_s)
    return done
