"""The job's configuration: the types a user writes, validated when they are made.

``JobConfig`` is what every process of a job must agree on (model, data, optimizer, staleness);
``OptimizerConfig`` is its ``[optimizer]`` table. Each daemon has one config type that wraps the
job (``common/daemon_config.py``); the machinery they share (flags, checks, TOML) is
``common/settings.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Any

import torch

from wavelet.common.imports import import_path_of
from wavelet.common.optimizer import OptimizerConfig, optimizer_of
from wavelet.common.schedule import SCHEDULES as LR_SCHEDULES
from wavelet.common.settings import (
    INF,
    ConfigError,
    MiB,
    check_settings,
    default_of,
    keyword_checked,
    non_negative,
    positive,
    setting,
)

# Names of ps/policy.py's policies (kept here so config has no dependency on the ps package).
STALE_POLICIES = ("apply", "scale", "drop", "dc-asgd")
# how a shard turns pushes into updates (ps/synchronous.py)
UPDATES = ("auto", "async", "wave-groups", "wave-turns", "k-of-n")
GROUPED_UPDATES = ("wave-groups", "wave-turns")  # a group per local wave index, taking turns
# rules with no staleness bound: their order (turns, a quorum) bounds each update's delay
BOUNDLESS_UPDATES = (*GROUPED_UPDATES, "k-of-n")
BALANCE_BATCHES = ("auto", "on", "off")
LATE_PUSHES = ("fold", "drop")
UPDATE_LRS = ("full", "by-samples")  # the step size of one update (docs/tuning.md)
PRECISIONS = ("fp32", "bf16", "fp16")  # of the forward (torch.autocast); parameters stay fp32
# dtype of gradients and weights between waves and shards; shards keep fp32 master weights;
# auto: bf16 where a parameter-server job spans several nodes, fp32 otherwise (concrete_wire)
WIRE_DTYPES = ("auto", "fp32", "bf16", "fp16")
PLACEMENTS = ("size", "layers")  # of chunks on shards (common/sharding.py)
# all-reduce: DDP's find_unused_parameters; auto has DDP look in the first step and go on
# looking only where that step left a trainable parameter without a gradient (worker/allreduce.py)
FIND_UNUSED = ("auto", "always", "never")
# common/models.py and common/datasets.py; a user's own is named package.module:function
BUILTIN_MODELS = ("mlp", "digits_cnn", "resnet18")
BUILTIN_DATASETS = ("digits", "synthetic", "patterns")


@keyword_checked
@dataclass
class JobConfig:
    """One training job, as every shard and worker sees it.

    From Python, the common case reads like the command line::

        job = wavelet.JobConfig(model="digits_cnn", lr=0.05, optimizer="adamw", waves=2,
                                staleness=1, epochs=3)

    ``optimizer`` takes a name, a table (``{"name": "sgd", "lr": 0.1, "kwargs": {...}}``) or an
    ``OptimizerConfig``; ``lr`` sets its learning rate. Every value is checked here, with the
    same one-line ``ConfigError`` as the command line gives."""

    model: str = setting(
        "digits_cnn",
        help="model: " + ", ".join(BUILTIN_MODELS) + ", or package.module:function",
    )
    model_kwargs: dict[str, Any] = setting(
        default_factory=dict, help="the model factory's keyword arguments", flag=""
    )
    dataset: str = setting(
        "digits",
        help="dataset: " + ", ".join(BUILTIN_DATASETS) + ", or package.module:function",
    )
    dataset_kwargs: dict[str, Any] = setting(
        default_factory=dict, help="the dataset factory's keyword arguments", flag=""
    )
    step: str = setting(
        "classification",
        help="the step of training: classification (cross-entropy of model(x) against y), or "
        "package.module:function taking (model, batch) and returning the loss or (loss, "
        "{name: float})",
    )
    evaluate: str = setting(
        "accuracy",
        help="the test-set evaluation: accuracy (top-1), or package.module:function taking "
        "(model, batches) and returning {metric: value}",
    )
    target_metric: str = setting(
        "accuracy",
        help="the evaluation's headline metric (progress, summary, time to target in compare "
        "and tune)",
    )
    target_mode: str = setting(
        "max",
        help="max: a higher target_metric is better; min: lower (a loss, a perplexity)",
        choices=("max", "min"),
    )
    precision: str = setting(
        "fp32",
        help="the forward's precision: fp32, or bf16 or fp16 under torch.autocast (parameters "
        "and gradients stay fp32; fp16 scales the loss per wave and skips overflowing steps)",
        choices=PRECISIONS,
    )
    wire_dtype: str = setting(
        "auto",
        help="dtype of gradients and weights between waves and shards (fp32, bf16, fp16); the "
        "shards keep fp32 master weights and optimizer state; all-reduce compresses the same "
        "way. auto: bf16 where a parameter-server job spans several nodes (wavelet run), whose "
        "pushes and pulls cross the network between steps; fp32 on one host and for all-reduce",
        choices=WIRE_DTYPES,
    )
    wire_error_feedback: bool = setting(
        False,
        help="16-bit wire: each wave keeps the rounding residual of its gradients and adds it "
        "to its next push",
    )
    loader_workers: int = setting(
        0,
        help="a dataset factory returning (train, test) torch Datasets: DataLoader worker "
        "processes per wave (0: read in the wave's thread)",
    )
    collate_fn: str = setting(
        "", help="such a dataset: the DataLoader's collate_fn as package.module:function"
    )
    batch_size: int = setting(32, help="samples per step, per wave")
    epochs: int = setting(15, help="passes over each wave's part of the data")
    max_seconds: float = setting(0.0, help="wall-clock budget per wave; 0: epochs alone decide")
    seed: int = setting(0, help="seed of the model, the data split and the batches")
    waves: int = setting(2, help="waves per device: 2 is tick-tock, 1 the single-wave baseline")
    shards: int = setting(2, help="parameter-server shards")
    chunk_mib: float = setting(4.0, help="large tensors are cut into chunks of at most this size")
    placement: str = setting(
        "size",
        help="chunks on shards: size (balanced, largest first) or layers (contiguous runs of the "
        "model, so the shard of the last layers can take its push while backward goes on)",
        choices=PLACEMENTS,
    )
    push_during_backward: bool = setting(
        True,
        help="push a shard's gradients as soon as backward has made all of them, not after "
        "backward (not with fp16 loss scaling, which needs every gradient to decide)",
    )
    push_part_kib: int = setting(
        0,
        help="push_during_backward over TCP: send a shard's gradients in parts of about this "
        "many KiB as backward makes them, so they cross the link while it goes on (0, the "
        "default: one message per shard, once all its gradients are made)",
    )
    pull_during_forward: bool = setting(
        False,
        help="start each layer's forward as soon as its own weights are in, while the shards' "
        "answers still arrive in parts (pull_part_kib, in the model's order); needs every "
        "parameter to be read by its own module before others read it (worker/pull_hooks.py)",
    )
    pull_part_kib: int = setting(
        256, help="pull_during_forward: KiB of weights per part of a shard's answer over TCP"
    )
    staleness: float = setting(
        1,
        help="staleness bound of asynchronous updates (setting it makes updates = auto async): "
        "0 bulk-synchronous, k stale-synchronous, inf unbounded",
        allow_inf=True,
    )
    optimizer: OptimizerConfig = setting(
        default_factory=OptimizerConfig, help="the shards' optimizer", flag=""
    )
    lr_schedule: str = setting(
        "cosine", help="learning-rate schedule over the job's budget", choices=LR_SCHEDULES
    )
    max_grad_norm: float = setting(
        0.0,
        help="clip each step's gradients to this L2 norm, over all of them (0: no clipping); "
        "a wave clips its own before it pushes, all-reduce the averaged ones",
    )
    # scale: measured first to the target at equal memory (docs/tuning.md, "Update rules")
    stale_policy: str = setting(
        "scale",
        help="what shards do with a stale gradient under asynchronous updates (see ps/policy.py)",
        choices=STALE_POLICIES,
    )
    # auto: measured first to the target on CPU devices (docs/tuning.md, "Which rule reaches
    # the target first"); async where a GPU's waves overlap (not measurable here)
    updates: str = setting(
        "auto",
        help="auto: wave-turns where every worker is a CPU device running two or more waves "
        "tick-tock and the staleness bound and stale policy are left at their defaults, async "
        "otherwise (the launchers decide; a daemon started by hand takes async); async: every "
        "push is an update (within the staleness bound); wave-groups: the "
        "tick waves of all devices average into one update, the tock waves into the next, in "
        "turns, each one update behind the other group (MLSys 2021; the turn order replaces the "
        "staleness bound); wave-turns: the same groups in strict turns, each reading the other's "
        "latest update (no staleness, and no overlap of one group's forward with the other's "
        "step: for devices that compute one wave at a time, such as a CPU)",
        choices=UPDATES,
    )
    balance_batches: str = setting(
        "auto",
        help="synchronous rules: each wave's batch follows its measured speed so that a step's "
        "waves finish together, the step still the mean over all its samples (on, off; auto: "
        "while the fastest wave of a step is over 1.3x the slowest)",
        choices=BALANCE_BATCHES,
    )
    balance_max_factor: float = setting(
        4.0,
        help="balanced batches: no wave's batch beyond this many times the job's, the other "
        "waves' shrinking to push with it (1: a faster wave keeps the job's batch and slower "
        "ones shrink, for a batch sized to the device's memory; wavelet compare at a memory "
        "budget runs 1)",
    )
    move_slow_shards: bool = setting(
        True,
        help="a shard whose node's workers compute over 1.3x slower than the fastest node's "
        "hands itself to its standby on a faster node (jobs over several nodes, wavelet run)",
    )
    sync_quorum: int = setting(
        0,
        help="updates = k-of-n: a step closes once this many waves pushed it and the others "
        "are late (0: half the live waves, rounded up)",
    )
    late_pushes: str = setting(
        "fold",
        help="updates = k-of-n: a push for a step that closed without it is folded into the "
        "open step (fold, counted in its mean) or dropped (drop)",
        choices=LATE_PUSHES,
    )
    turn_patience: float = setting(
        0.0,
        help="wave turns and wave groups: a group's update goes ahead without a wave that has "
        "not pushed within this many times the group's usual turn after half the group did "
        "(a node slowed all at once, before balanced batches follow); its push is folded into "
        "the group's next update (0: always wait for every wave)",
    )
    update_lr: str = setting(
        "full",
        help="full: every update takes the optimizer's lr; by-samples: lr times the share of "
        "the job's samples per step the update carries (one wave's push: 1 / all waves), the "
        "step size all-reduce takes per sample",
        choices=UPDATE_LRS,
    )
    momentum_correction: bool = setting(
        False,
        help="lower the shards' momentum by the implicit momentum of N asynchronous update "
        "streams (1 - 1/N, Mitliagkas et al. 2016), so the two together match the optimizer's",
    )
    drop_limit: int = setting(4, help="drop policy: gradients staler than this are dropped")
    dc_lambda: float = setting(0.04, help="dc-asgd: strength of the delay compensation")
    eval_every: int = setting(1, help="epochs between test-accuracy records (0: only at the end)")
    eval_every_s: float = setting(
        0.0,
        help="also copy the model every S seconds of training and test the copies after it, so "
        "that time to target is known to S rather than to an epoch, and no test stalls "
        "training (the epochs' tests are copies too; 0: by epochs only, tested inline)",
    )
    memory_trace_iters: int = setting(
        40, help="iterations per wave whose saved-activation timeline is kept"
    )
    request_timeout_s: float = setting(
        300.0, help="longest wait for a shard's reply, parking included"
    )
    baton_timeout_s: float = setting(30.0, help="a wave stalled this long loses its forward turn")
    # Workers heartbeat their live waves every heartbeat_s; a shard that hears nothing from a
    # wave for wave_timeout_s drops it from the membership, so it no longer holds others back.
    heartbeat_s: float = setting(1.0, help="seconds between a worker's heartbeats to the shards")
    # Leases (docs/faults.md): a wave's process that dies closes its connections and leaves at
    # once; these bound how long a silent one (a hung process, a vanished host) holds others.
    wave_timeout_s: float = setting(
        10.0,
        help="a shard drops a wave it has not heard from for this long (a wave whose connection "
        "closes, its process killed, is dropped at once)",
    )
    shard_replicas: int = setting(
        1,
        help="1: a shard's standby (where the deployment hosts one) starts from nothing and "
        "takes the newest weights a wave has when its primary is lost; 2: every update is "
        "mirrored to the standby first, so a lost primary loses no update (docs/faults.md)",
        choices=(1, 2),
    )
    shard_timeout_s: float = setting(
        10.0,
        help="a wave gives up on a shard whose connection has been down this long: the shard's "
        "standby takes it over where there is one (shard_replicas), else the job ends naming "
        "what was lost",
    )
    # The baton passes once the holder's backward has freed all but this fraction of its saved
    # activations; 1.0 passes it the moment the forward ends (see docs/design.md).
    baton_handoff: float = setting(
        0.3, help="pass the baton once backward freed all but this fraction of activations"
    )
    activation_checkpointing: bool = setting(
        False,
        help="recompute the model's blocks in backward instead of keeping their activations "
        "(torch.utils.checkpoint; see common/models.py)",
    )
    find_unused_parameters: str = setting(
        "auto",
        help="all-reduce: DDP's find_unused_parameters (auto: on after the first step only where "
        "it left a trainable parameter without a gradient; always: for models whose unused "
        "parameters change from step to step)",
        choices=FIND_UNUSED,
    )
    # A straggler by a sleep in one wave's loop: fenced off for experiments on update rules
    # alone. All-reduce never sees it, so no comparison with it is fair: a slow node is a CPU
    # cap (--slow-device, benchmarks/cluster.py --slow), the same for every mode.
    slow_wave: int = setting(
        -1,
        help="experiments only (a sleep all-reduce never sees; compare modes with "
        "--slow-device): this wave (job-wide index) sleeps",
    )
    slow_factor: float = setting(1.0, help="experiments only: slow_wave's slowdown factor")

    # the learning rate, given flat (``JobConfig(lr=0.05)``, a top-level ``lr`` in a file): it
    # is the optimizer's, where it is kept
    lr: InitVar[float | None] = None

    def __post_init__(self, lr: float | None = None) -> None:
        self.optimizer = optimizer_of(self.optimizer)
        if lr is not None:
            self.optimizer = dataclasses.replace(self.optimizer, lr=lr)
        # from Python, the job's parts may be the callables themselves (wavelet.JobConfig)
        for name in ("model", "dataset", "step", "evaluate"):
            value = getattr(self, name)
            if callable(value):
                try:
                    setattr(self, name, import_path_of(value, name))
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            elif not isinstance(value, str):
                raise ConfigError(f"{name} must be a name, an import path or a function")
        check_settings(self)
        for name in ("batch_size", "waves", "shards", "pull_part_kib"):
            positive(name, getattr(self, name))
        for name in (
            "epochs",
            "eval_every",
            "memory_trace_iters",
            "seed",
            "loader_workers",
            "push_part_kib",
        ):
            non_negative(name, getattr(self, name))
        for name in ("max_seconds", "eval_every_s", "max_grad_norm"):
            non_negative(name, getattr(self, name))
        for name in (
            "chunk_mib",
            "request_timeout_s",
            "baton_timeout_s",
            "heartbeat_s",
            "wave_timeout_s",
            "shard_timeout_s",
        ):
            positive(name, getattr(self, name))
        if not 0.0 <= self.baton_handoff <= 1.0:
            raise ConfigError(f"baton_handoff must be in [0, 1], got {self.baton_handoff!r}")
        if self.slow_factor < 1.0:
            raise ConfigError(f"slow_factor must be >= 1, got {self.slow_factor!r}")
        non_negative("drop_limit", self.drop_limit)
        non_negative("dc_lambda", self.dc_lambda)
        if self.epochs == 0 and self.max_seconds == 0:
            raise ConfigError("epochs and max_seconds are both 0: give the job a budget")
        s = self.staleness
        if not (s >= 0 and (s == INF or float(s).is_integer())):
            raise ConfigError(f"staleness must be a whole number >= 0 or inf, got {s!r}")
        if s != INF:
            self.staleness = int(s)
        if self.updates in GROUPED_UPDATES and self.staleness == 0:
            raise ConfigError(
                f"updates = {self.updates} averages the tick and the tock groups into updates "
                "of their own, but staleness 0 asks for one bulk-synchronous update of all "
                "waves: drop --staleness 0 (wave groups use no staleness bound: their turn "
                "order is the bound), or use updates = async with staleness 0"
            )
        if self.updates in BOUNDLESS_UPDATES:
            unused = _async_only_settings(self)
            if unused:
                order = "quorum" if self.updates == "k-of-n" else "turn order"
                raise ConfigError(
                    f"updates = {self.updates} has no staleness bound and no stale policy (its "
                    f"{order} fixes each update's delay), so {' and '.join(unused)} would do "
                    "nothing: drop it, or use --updates async to bound asynchronous waves"
                )
        if self.balance_max_factor < 1:
            raise ConfigError(
                f"balance_max_factor = {self.balance_max_factor}: a wave's balanced batch may "
                "not be held below the job's; give 1 or more"
            )
        non_negative("sync_quorum", self.sync_quorum)
        non_negative("turn_patience", self.turn_patience)
        if self.turn_patience and self.updates not in (*GROUPED_UPDATES, "auto"):
            raise ConfigError(
                f"turn_patience = {self.turn_patience} is for wave turns and wave groups (how "
                f"long a group's update waits for a late wave), not updates = {self.updates}: "
                "drop it, or use --updates wave-turns"
            )
        if self.sync_quorum and self.updates != "k-of-n":
            raise ConfigError(
                f"sync_quorum = {self.sync_quorum} is for updates = k-of-n (a step closes once "
                f"that many waves pushed it), not {self.updates}: add --updates k-of-n"
            )

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mib * MiB))

    @property
    def wire(self) -> str:
        """The dtype gradients and weights travel in: ``wire_dtype``, with ``auto`` as a process
        that no launcher decided it for takes it (fp32: a daemon started by hand)."""
        return "fp32" if self.wire_dtype == "auto" else self.wire_dtype


def launch_updates(
    job: JobConfig,
    devices: list[str],
    mode: str = "ps",
    schedule: str = "ticktock",
    processes_per_device: int = 1,
) -> JobConfig:
    """``concrete_updates`` and ``concrete_wire`` for a launch of ``job`` on ``devices`` of one
    host with these settings."""
    cpu_workers = all(torch.device(d).type == "cpu" for d in devices)
    ticktock = mode == "ps" and schedule == "ticktock" and processes_per_device == 1
    return concrete_wire(concrete_updates(job, cpu_workers, ticktock), nodes=1, mode=mode)


def concrete_wire(job: JobConfig, nodes: int, mode: str = "ps") -> JobConfig:
    """``job`` with ``wire_dtype = "auto"`` decided for a job over ``nodes`` hosts: bf16 where a
    parameter-server job spans two or more, fp32 otherwise. A wave's push and the weights it
    pulls cross the link between its steps, where no compute hides them (wave turns wait for
    them), and half the bytes is half that wait (measured on two emulated nodes:
    docs/performance.md, "A 16-bit wire between nodes"). On one host the tensors go through
    shared memory, where a cast only costs; all-reduce overlaps its buckets with backward."""
    if job.wire_dtype != "auto":
        return job
    return dataclasses.replace(job, wire_dtype="bf16" if mode == "ps" and nodes > 1 else "fp32")


def concrete_updates(job: JobConfig, cpu_workers: bool, ticktock: bool = True) -> JobConfig:
    """``job`` with ``updates = "auto"`` decided, for workers that all compute on CPUs
    (``cpu_workers``) and run their waves tick-tock (``ticktock``, one process per device):
    wave-turns where they do, run two or more waves and leave the staleness bound and stale
    policy at their defaults (a user who sets either asks for asynchronous updates); async
    otherwise. A CPU worker computes one wave at a time, so turns cost it no overlap and every
    update is fresh; a GPU's waves overlap, which turns would give up."""
    if job.updates != "auto":
        return job
    turns = cpu_workers and ticktock and job.waves >= 2 and not _async_only_settings(job)
    return dataclasses.replace(job, updates="wave-turns" if turns else "async")


ASYNC_ONLY_SETTINGS = ("staleness", "stale_policy")  # what grouped updates have no use for


def async_only_defaults() -> dict[str, Any]:
    """The defaults of the settings only asynchronous updates use."""
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    return {name: default_of(fields[name]) for name in ASYNC_ONLY_SETTINGS}


def _async_only_settings(job: JobConfig) -> list[str]:
    """``staleness = 2``-style descriptions of the settings of ``job`` that only asynchronous
    updates use and that differ from their defaults."""
    return [
        f"{name} = {getattr(job, name)}"
        for name, default in async_only_defaults().items()
        if getattr(job, name) != default
    ]
