"""Configuration: validated dataclasses, loadable from TOML, overridable from the command line.

``JobConfig`` is what every process of a job must agree on (model, data, optimizer, staleness).
Each daemon has one config type that wraps it: ``PSConfig``, ``WorkerConfig``, ``LaunchConfig``.
A TOML file holds a job (top-level keys and an ``[optimizer]`` table); flags override it.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import inspect
import math
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wavelet.common.imports import import_path_of
from wavelet.common.schedule import SCHEDULES as LR_SCHEDULES

INF = math.inf
MiB = 1 << 20


class ConfigError(ValueError):
    """A bad configuration value; the message says which and what would be accepted."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: tuple = (),
    flag: str | None = None,
    allow_inf: bool = False,
    repeated: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field with what its command-line flag shows: ``help`` (one line), ``choices``,
    the flag's name (``flag``; derived from the field's name when None, no flag when ""),
    whether the float may be infinite, and whether a list is given as the flag repeated (once
    per item) rather than comma-separated. ``scripts/cli.py`` builds every flag from this."""
    metadata = {
        "help": help,
        "choices": tuple(choices),
        "flag": flag,
        "allow_inf": allow_inf,
        "repeated": repeated,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of config field ``f`` ("" for a field without one)."""
    flag = f.metadata.get("flag")
    if flag == "":
        return ""
    return flag or "--" + f.name.replace("_", "-")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def command_line(config: Any) -> list[str]:
    """The flags that give a daemon ``config`` (its settings that differ from the defaults),
    generated from the same field metadata as the flags themselves: a launcher that builds a
    config object and passes this can forget no setting on the way to a child."""
    args: list[str] = []
    for f in dataclasses.fields(config):
        flag, value = flag_of(f), getattr(config, f.name)
        if not flag or value == _default_of(f):
            continue
        if isinstance(_default_of(f), bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{f.name} must be true or false, got {value!r}")
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list) and f.metadata.get("repeated"):
            for item in value:
                args += [flag, str(item)]
        elif isinstance(value, list):
            args += [flag, ",".join(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def check_settings(config: Any, prefix: str = "") -> None:
    """Checks every config shares: no NaN anywhere, no infinity where the field does not allow
    one (only a staleness bound may be inf), and ``choices`` respected."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        allow_inf = f.metadata.get("allow_inf", False)
        _check_finite(prefix + f.name, value, allow_inf)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            _one_of(prefix + f.name, value, choices)


def _check_finite(name: str, value: Any, allow_inf: bool = False) -> None:
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(f"{name}.{k}", v)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_finite(name, v)


def _optimizer_names() -> dict[str, str]:
    """Lower-case name -> class name of every optimizer in torch.optim."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name != "Optimizer":
            found[name.lower()] = name
    return found


_OPTIMIZERS = _optimizer_names()

# torch.optim's optimizers whose step cannot be a shard's update of gradients it was sent
UNSUPPORTED_OPTIMIZERS = {
    "lbfgs": "needs a closure that computes the loss again, which a shard cannot call",
    "sparseadam": "takes sparse gradients, and every mode here sends dense ones",
    "muon": "updates 2-D weight matrices whole, and shards hold tensors cut into flat chunks",
}


# Defaults per optimizer, under whatever the job's kwargs say: SGD trains with momentum 0.7
# unless told otherwise (momentum=0 gives plain SGD). Not the usual 0.9: staleness acts as
# implicit momentum ("asynchrony begets momentum", Mitliagkas et al. 2016), and measured on the
# default job (tick-tock, s = 1), 0.9 ended at 96.7-98.6% test accuracy over runs, 0.7 at 99.4%.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.7}}


MODES = ("ps", "allreduce")
# Names of ps/policy.py's policies (kept here so config has no dependency on the ps package).
STALE_POLICIES = ("apply", "scale", "drop", "dc-asgd")
# how a shard turns pushes into updates (ps/synchronous.py)
UPDATES = ("auto", "async", "wave-groups", "wave-turns")
GROUPED_UPDATES = ("wave-groups", "wave-turns")  # a group per local wave index, taking turns
UPDATE_LRS = ("full", "by-samples")  # the step size of one update (docs/tuning.md)
PRECISIONS = ("fp32", "bf16", "fp16")  # of the forward (torch.autocast); parameters stay fp32
# dtype of gradients and weights between waves and shards; shards keep fp32 master weights
WIRE_DTYPES = ("fp32", "bf16", "fp16")
PLACEMENTS = ("size", "layers")  # of chunks on shards (common/sharding.py)
SCHEDULES = ("ticktock", "together")
TRANSPORTS = ("auto", "shm", "tcp")  # how tensors move between a wave and a shard
SPAWN_METHODS = ("fork", "exec")  # how the launcher starts its daemons (scripts/forkserver.py)
# all-reduce: DDP's find_unused_parameters; auto has DDP look in the first step and go on
# looking only where that step left a trainable parameter without a gradient (worker/allreduce.py)
FIND_UNUSED = ("auto", "always", "never")
# which parameters weight decay applies to: all (torch's default), or only those of two or more
# dimensions (the weights of linear and convolution layers; not biases or norm scales)
WEIGHT_DECAY_ON = ("all", "matrices")
# Help texts that more than one config class shows: written once.
# the launchers' settings for their shards (LaunchConfig, RunConfig)
SHARDS_CHECKPOINT_EVERY_HELP = "shards checkpoint every N updates (0: only when they stop)"
SHARDS_CHECKPOINT_EVERY_S_HELP = "shards checkpoint every S seconds (0: only when they stop)"
TRANSPORT_HELP = (
    "how tensors move to shards: shm (shared memory, same host), tcp (ZeroMQ frames), "
    "or auto (shm where a shard offers it and its segments open, else tcp)"
)
DAEMON_METRICS_PORT_HELP = (
    "serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; -1: off)"
)
# common/models.py and common/datasets.py; a user's own is named package.module:function
BUILTIN_MODELS = ("mlp", "digits_cnn", "resnet18")
BUILTIN_DATASETS = ("digits", "synthetic", "patterns")


@dataclass
class OptimizerConfig:
    """A ``torch.optim`` optimizer by name (case-insensitive) with its keyword arguments."""

    name: str = setting("sgd", help="torch.optim optimizer by name, e.g. sgd, adam, adamw")
    lr: float = setting(0.05, help="learning rate (the schedule scales it over the job)")
    kwargs: dict[str, Any] = setting(
        default_factory=dict, help="the optimizer's other arguments, e.g. momentum", flag=""
    )
    weight_decay_on: str = setting(
        "all",
        help="all: weight decay on every parameter (torch's default); matrices: only on "
        "parameters of two or more dimensions, none on biases, norm scales and other 1-D "
        "ones (as nanoGPT and timm train transformers)",
        choices=WEIGHT_DECAY_ON,
        flag="--weight-decay-on",
    )

    def __post_init__(self) -> None:
        check_settings(self, "optimizer.")
        if self.name.lower() in UNSUPPORTED_OPTIMIZERS:
            raise ConfigError(
                f"optimizer {self.name!r} {UNSUPPORTED_OPTIMIZERS[self.name.lower()]}; choose "
                "another of torch.optim, e.g. sgd, adam, adamw"
            )
        if self.name.lower() not in _OPTIMIZERS:
            raise ConfigError(
                f"optimizer {self.name!r} is not in torch.optim; choose one of "
                + ", ".join(sorted(set(_OPTIMIZERS) - set(UNSUPPORTED_OPTIMIZERS)))
            )
        _positive("optimizer.lr", self.lr)
        self._check_arguments()  # bad kwargs fail now, not on a shard
        decays = "weight_decay" in inspect.signature(self.optimizer_class).parameters
        if self.weight_decay_on != "all" and not decays:
            raise ConfigError(
                f"optimizer.weight_decay_on = {self.weight_decay_on!r}, but {self.name} has no "
                'weight decay: leave it "all" or choose an optimizer with one, e.g. adamw'
            )

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return getattr(torch.optim, _OPTIMIZERS[self.name.lower()])

    @property
    def effective_kwargs(self) -> dict[str, Any]:
        return {**OPTIMIZER_DEFAULTS.get(self.name.lower(), {}), **self.kwargs}

    def build(
        self, params: list[torch.Tensor], fused: bool = True, ndims: Sequence[int] | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer over ``params``; ``ndims``: each one's number of dimensions before any
        flattening (a shard's chunks are flat), which ``weight_decay_on`` needs."""
        cls = self.optimizer_class
        kwargs = self.effective_kwargs
        # The fused kernels update in one pass: 2x (SGD) to 4x (Adam) faster on a shard's chunks
        # (benchmarks/bench_ps.py). Used where the optimizer has one, unless the job says otherwise.
        has_fused = "fused" in inspect.signature(cls).parameters
        chosen = {"fused", "foreach"} & set(kwargs)
        if fused and has_fused and not chosen and all(p.is_floating_point() for p in params):
            kwargs = {**kwargs, "fused": True}
        groups = self._groups(params, ndims)
        try:
            return cls(groups, lr=self.lr, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"optimizer {self.name} rejected its arguments {kwargs}: {e}"
            ) from None

    def _groups(self, params: list[torch.Tensor], ndims: Sequence[int] | None) -> list:
        """``params`` as one group, or with ``weight_decay_on = "matrices"`` as two: those of two
        or more dimensions, and the rest without weight decay (an empty group is left out)."""
        if self.weight_decay_on == "all":
            return params
        if ndims is None or len(ndims) != len(params):
            raise ValueError("weight_decay_on needs every parameter's number of dimensions")
        decayed = [p for p, n in zip(params, ndims, strict=True) if n >= 2]
        spared = [p for p, n in zip(params, ndims, strict=True) if n < 2]
        groups = [{"params": decayed}, {"params": spared, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _check_arguments(self) -> None:
        """The optimizer's own checks of its arguments, without building one: a torch.optim
        class checks them in its ``__init__`` before handing over to ``Optimizer.__init__``,
        which imports torch._dynamo on first use (1.2 s per process here), so a subclass
        stops there. The launcher and the workers, which never step an optimizer, then never
        pay for that import."""
        cls = self.optimizer_class
        checked = type(f"Checked{cls.__name__}", (cls, _ArgumentsOnly), {})
        kwargs = self.effective_kwargs
        try:
            checked([torch.zeros(1, 1, requires_grad=True)], lr=self.lr, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"optimizer {self.name} rejected its arguments {kwargs}: {e}"
            ) from None
        except Exception:  # an __init__ that needs more of its base: build one after all
            self.build([torch.zeros(1, 1, requires_grad=True)])


class _ArgumentsOnly(torch.optim.Optimizer):
    """The base an optimizer's ``__init__`` reaches once it has checked its arguments: keeps
    what the rest of that ``__init__`` may read, and builds nothing."""

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        self.defaults = defaults
        self.param_groups = [{"params": list(params), **defaults}]
        self.state = collections.defaultdict(dict)


@dataclass
class JobConfig:
    """One training job, as every shard and worker sees it."""

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
        "fp32",
        help="dtype of gradients and weights between waves and shards (fp32, bf16, fp16); the "
        "shards keep fp32 master weights and optimizer state; all-reduce compresses the same way",
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
        "that time to target is known to S rather than to an epoch (0: by epochs only)",
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
    wave_timeout_s: float = setting(
        30.0, help="a shard drops a wave it has not heard from for this long"
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
    # A straggler, for experiments: wave number slow_wave (counted over the whole job, -1 for
    # none) takes slow_factor times as long per iteration.
    slow_wave: int = setting(-1, help="experiments: this wave (job-wide index) is a straggler")
    slow_factor: float = setting(1.0, help="experiments: the straggler's slowdown factor")

    def __post_init__(self) -> None:
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
            _positive(name, getattr(self, name))
        for name in ("epochs", "eval_every", "memory_trace_iters", "seed", "loader_workers"):
            _non_negative(name, getattr(self, name))
        for name in ("max_seconds", "eval_every_s", "max_grad_norm"):
            _non_negative(name, getattr(self, name))
        for name in (
            "chunk_mib",
            "request_timeout_s",
            "baton_timeout_s",
            "heartbeat_s",
            "wave_timeout_s",
        ):
            _positive(name, getattr(self, name))
        if not 0.0 <= self.baton_handoff <= 1.0:
            raise ConfigError(f"baton_handoff must be in [0, 1], got {self.baton_handoff!r}")
        if self.slow_factor < 1.0:
            raise ConfigError(f"slow_factor must be >= 1, got {self.slow_factor!r}")
        _non_negative("drop_limit", self.drop_limit)
        _non_negative("dc_lambda", self.dc_lambda)
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
        if self.updates in GROUPED_UPDATES:
            unused = _async_only_settings(self)
            if unused:
                raise ConfigError(
                    f"updates = {self.updates} has no staleness bound and no stale policy (its "
                    f"turn order fixes each update's delay), so {' and '.join(unused)} would do "
                    "nothing: drop it, or use --updates async to bound asynchronous waves"
                )

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mib * MiB))


def launch_updates(
    job: JobConfig,
    devices: list[str],
    mode: str = "ps",
    schedule: str = "ticktock",
    processes_per_device: int = 1,
) -> JobConfig:
    """``concrete_updates`` for a launch of ``job`` on ``devices`` with these settings."""
    cpu_workers = all(torch.device(d).type == "cpu" for d in devices)
    ticktock = mode == "ps" and schedule == "ticktock" and processes_per_device == 1
    return concrete_updates(job, cpu_workers, ticktock)


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
    return {name: _default_of(fields[name]) for name in ASYNC_ONLY_SETTINGS}


def _async_only_settings(job: JobConfig) -> list[str]:
    """``staleness = 2``-style descriptions of the settings of ``job`` that only asynchronous
    updates use and that differ from their defaults."""
    return [
        f"{name} = {getattr(job, name)}"
        for name, default in async_only_defaults().items()
        if getattr(job, name) != default
    ]


@dataclass
class PSConfig:
    """One parameter-server shard daemon."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shard_index: int = setting(0, help="which shard of the job this daemon serves")
    bind: str = setting(
        "tcp://127.0.0.1:0", help="ZeroMQ address to listen on; port 0 picks a free one"
    )
    expect_waves: int = setting(
        0, help="hold first pulls until this many waves registered (0: no barrier)"
    )
    ready_file: str = setting("", help="write the bound address here once listening")
    run_dir: str = setting(
        "",
        help="per-push records, checkpoints and the admin token go here; a shard restarted "
        "with the same run dir resumes from its last checkpoint",
    )
    threads: int = setting(1, help="torch threads of the shard process")
    # Limits, so that no client can exhaust the shard's memory: larger messages are dropped by
    # ZeroMQ (the connection is closed), pulls parked beyond max_parked get an error reply.
    max_message_mib: float = setting(1024.0, help="larger messages are dropped")
    max_parked: int = setting(4096, help="pulls held back by the staleness bound at once, at most")
    max_waves: int = setting(
        0,
        help="waves this shard serves at once, at most (0: twice --expect-waves, at least 16, "
        "which leaves room for re-joins)",
    )
    # Checkpoints (into run_dir/checkpoints): every N updates and/or every S seconds (0: never),
    # and always when the daemon stops. A restarted shard resumes from its last checkpoint.
    checkpoint_every: int = setting(0, help="checkpoint every N updates (0: only when stopping)")
    checkpoint_every_s: float = setting(
        0.0, help="checkpoint every S seconds (0: only when stopping)"
    )
    # CURVE (common/security.py): this shard's secret key file and the folder of the public keys
    # of the clients it accepts. Binding beyond loopback without them needs insecure = True.
    curve_secret: str = setting("", help="CURVE: this shard's .key_secret file (wavelet keys)")
    curve_authorized: str = setting(
        "", help="CURVE: folder of the public .key files of the clients to accept"
    )
    curve_admin_key: str = setting(
        "",
        help="CURVE: public .key file of the client whose checkpoint and shutdown requests "
        "are obeyed (instead of the admin token)",
    )
    insecure: bool = setting(
        False, help="allow binding beyond loopback without CURVE (traffic in the clear)"
    )
    shm: bool = setting(
        True, help="offer shared-memory segments to waves on this host (--no-shm: TCP only)"
    )
    metrics_port: int = setting(-1, help=DAEMON_METRICS_PORT_HELP)
    metrics_host: str = setting(
        "", help="address the metrics port binds (default: the host of --bind)"
    )
    admin_token_file: str = setting(
        "",
        help="file of the token checkpoint and shutdown requests need (made 0600 if missing; "
        "default RUN_DIR/admin.token)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        _non_negative("shard_index", self.shard_index)
        if bool(self.curve_secret) != bool(self.curve_authorized):
            raise ConfigError("CURVE needs both --curve-secret and --curve-authorized")
        if self.curve_admin_key and not self.curve_secret:
            raise ConfigError("--curve-admin-key needs CURVE (--curve-secret, --curve-authorized)")
        _positive("max_message_mib", self.max_message_mib)
        _positive("max_parked", self.max_parked)
        _non_negative("max_waves", self.max_waves)
        _non_negative("checkpoint_every", self.checkpoint_every)
        _non_negative("checkpoint_every_s", self.checkpoint_every_s)
        if self.shard_index >= self.job.shards:
            raise ConfigError(
                f"shard_index {self.shard_index} is out of range for {self.job.shards} shards"
            )
        _non_negative("expect_waves", self.expect_waves)
        _positive("threads", self.threads)
        check_address("bind", self.bind)
        _check_metrics_port(self.metrics_port)

    @property
    def wave_limit(self) -> int:
        """``max_waves``, or the default derived from ``expect_waves``."""
        return self.max_waves or max(2 * self.expect_waves, 16)

    @property
    def admin_token_path(self) -> str:
        """Where the admin token is ("" when the shard has neither a token file nor a run dir)."""
        if self.admin_token_file:
            return self.admin_token_file
        return str(Path(self.run_dir) / "admin.token") if self.run_dir else ""


@dataclass
class WorkerConfig:
    """One worker daemon: the waves of one device."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shard_addresses: list[str] = setting(
        default_factory=list,
        help="a shard's address, once per shard, in shard order (ps mode)",
        flag="--shard",
        repeated=True,
    )
    shard_address_files: list[str] = setting(
        default_factory=list,
        help="instead of --shard: a file a starting shard writes its address to, once per shard, "
        "in shard order; read once the worker has loaded its data (wavelet launch starts "
        "workers beside their shards this way)",
        flag="--shard-address-file",
        repeated=True,
    )
    device: str = setting("cpu", help="the device whose waves this daemon runs: cpu, cuda:N")
    rank: int = setting(0, help="this worker's index among --num-workers")
    num_workers: int = setting(1, help="worker daemons in the job")
    threads: int = setting(
        0, help="torch threads of this process (0: chosen by a short probe, worker/threads.py)"
    )
    core_budget: int = setting(
        0, help="CPU cores this process may use when it chooses its threads (0: all)"
    )
    run_dir: str = setting("runs/latest", help="where records go")
    mode: str = setting(
        "ps",
        help="ps: waves through the shards; allreduce: one DDP rank, rendezvous from "
        "torchrun's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)",
        choices=MODES,
    )
    schedule: str = setting(
        "ticktock",
        help="ticktock: forwards take turns; together: waves start at once",
        choices=SCHEDULES,
    )
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)
    device_index: int = setting(
        -1,
        help="physical device number for memory reports, when several workers share a device "
        "(default: the rank)",
    )
    resume: bool = setting(
        False, help="go on from the clocks the shards restored from their checkpoints"
    )
    cuda_memory_gib: float = setting(
        0.0,
        help="cap this process's CUDA caching allocator at this many GiB, so a large card "
        "behaves like a smaller one (0: no cap)",
    )
    metrics_port: int = setting(-1, help=DAEMON_METRICS_PORT_HELP)
    metrics_host: str = setting("127.0.0.1", help="address the metrics port binds")
    curve_secret: str = setting("", help="CURVE: this worker's .key_secret file")
    curve_server_key: str = setting("", help="CURVE: the shards' public .key file")
    report: bool = setting(
        True,
        help="ps mode: print the progress of this worker's waves and, at the end, the test "
        "metrics of the shards' weights, samples/s and staleness (wavelet launch and wavelet "
        "run show their own)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        given = len(self.shard_addresses) or len(self.shard_address_files)
        if self.shard_addresses and self.shard_address_files:
            raise ConfigError("pass --shard addresses or --shard-address-file files, not both")
        if self.mode == "ps" and given != self.job.shards:
            raise ConfigError(
                f"got {given} shard addresses for a job of {self.job.shards} shards; pass one "
                "--shard address per shard, in shard order"
            )
        for a in self.shard_addresses:
            check_address("shard address", a)
        check_device(self.device)
        _positive("num_workers", self.num_workers)
        if not 0 <= self.rank < self.num_workers:
            raise ConfigError(f"rank {self.rank} is out of range for {self.num_workers} workers")
        _non_negative("threads", self.threads)
        _non_negative("core_budget", self.core_budget)
        _non_negative("cuda_memory_gib", self.cuda_memory_gib)
        _check_metrics_port(self.metrics_port)
        if self.device_index < 0:
            self.device_index = self.rank
        if bool(self.curve_secret) != bool(self.curve_server_key):
            raise ConfigError("CURVE needs both --curve-secret and --curve-server-key")


@dataclass
class LaunchConfig:
    """A whole job on this machine: the shards and one worker per device."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    devices: list[str] = setting(
        default_factory=lambda: ["cpu"],
        help="comma-separated devices, one worker each: cpu, cuda:0,cuda:1, or cpu,cpu for two "
        "CPU workers",
    )
    run_dir: str = setting("", help="where logs, records and checkpoints go (default runs/<time>)")
    host: str = setting("127.0.0.1", help="address the shards bind")
    curve: bool = setting(
        False,
        help="make CURVE keys (in the run dir) and encrypt and authenticate all of the job's "
        "traffic with them",
    )
    insecure: bool = setting(False, help="allow a non-loopback --host without --curve")
    checkpoint_every: int = setting(0, help=SHARDS_CHECKPOINT_EVERY_HELP)
    checkpoint_every_s: float = setting(0.0, help=SHARDS_CHECKPOINT_EVERY_S_HELP)
    resume: bool = setting(False, help="run_dir holds a stopped job: restart it", flag="")
    mode: str = setting(
        "ps",
        help="ps: waves through the shards; allreduce: DDP over torch.distributed (gloo on "
        "CPU, NCCL on GPU), the baseline",
        choices=MODES,
    )
    schedule: str = setting(
        "ticktock",
        help="ps mode: ticktock (forwards take turns) or together (waves start at once)",
        choices=SCHEDULES,
    )
    # Worker processes (ps mode) or DDP ranks (allreduce mode) per device; 2 gives the
    # "two tasks on one device" baselines.
    processes_per_device: int = setting(
        1,
        help="worker processes (ps) or DDP ranks (allreduce) per device; 2 runs two tasks on "
        "each device side by side, the baseline tick-tock is compared with",
        choices=(1, 2),
    )
    threads: int = setting(
        0,
        help="torch threads per worker process (0: the cores divided among the waves that "
        "run at once)",
    )
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)
    cuda_memory_gib: float = setting(
        0.0,
        help="cap each device's CUDA memory at this many GiB, split among its processes, so a "
        "large card behaves like a smaller one (0: no cap)",
    )
    max_restarts: int = setting(
        0,
        help="restart a shard or worker that dies, up to N times in all (shards from their "
        "last checkpoint, workers from the shards' clocks); then stop the job",
    )
    metrics_port: int = setting(
        -1,
        help="every daemon serves Prometheus metrics: shard i on BASE+i, worker r on "
        "BASE+shards+r (0: free ports, listed at start; -1: off)",
    )
    spawn: str = setting(
        "fork",
        help="how daemons start: fork (from one process per job that imported torch once; a "
        "daemon starts in a fraction of a second) or exec (a fresh Python each, 2-5 s of CPU)",
        choices=SPAWN_METHODS,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        _non_negative("cuda_memory_gib", self.cuda_memory_gib)
        _check_metrics_port(self.metrics_port)
        _non_negative("max_restarts", self.max_restarts)
        if not self.devices:
            raise ConfigError("devices is empty: name at least one device, e.g. cpu or cuda:0")
        for d in self.devices:
            check_device(d)
        _non_negative("threads", self.threads)

    def concrete_job(self) -> JobConfig:
        """The job with ``updates = "auto"`` decided for these devices (``concrete_updates``)."""
        return launch_updates(
            self.job, self.devices, self.mode, self.schedule, self.processes_per_device
        )


@dataclass
class RunConfig:
    """One process of a job torchrun started (``wavelet run``): the same on every node; the
    process's role (shard, worker or all-reduce rank) comes from torchrun's environment."""

    job: JobConfig = setting(default_factory=JobConfig, help="the job", flag="")
    shards_per_node: int = setting(
        1, help="the first K local ranks of each node serve shards, the others are workers"
    )
    mode: str = setting(
        "ps",
        help="ps: shards and tick-tock workers; allreduce: every process a DDP rank",
        choices=MODES,
    )
    run_dir: str = setting(
        "", help="where records go on each node; none means runs/torchrun-<rendezvous id>"
    )
    curve_keys: str = setting(
        "",
        help="CURVE keys every node can read (wavelet keys --job DIR): encrypt and authenticate "
        "all of the job's PS traffic",
    )
    checkpoint_every: int = setting(0, help=SHARDS_CHECKPOINT_EVERY_HELP)
    checkpoint_every_s: float = setting(0.0, help=SHARDS_CHECKPOINT_EVERY_S_HELP)
    insecure: bool = setting(False, help="allow shards on a non-loopback address without CURVE")
    transport: str = setting("auto", help=TRANSPORT_HELP, choices=TRANSPORTS)

    def __post_init__(self) -> None:
        check_settings(self)
        _positive("shards_per_node", self.shards_per_node)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


def check_address(what: str, address: str) -> None:
    """The one check of a ZeroMQ address for every command: tcp://HOST:PORT (PORT a number,
    0 or * for any), ipc://PATH or inproc://NAME."""
    example = "like tcp://127.0.0.1:5555"
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(f"{what} {address!r} is not a ZeroMQ address {example}")
    scheme, rest = address.split("://", 1)
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise ConfigError(f"{what} {address!r} names no {scheme} endpoint")
        return
    if scheme != "tcp":
        raise ConfigError(f"{what} {address!r}: use tcp://, ipc:// or inproc:// ({example})")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what} {address!r} needs a host and a port, {example}")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ConfigError(f"{what} {address!r}: port {port!r} is not a number from 0 to 65535")


def _check_metrics_port(port: int) -> None:
    if not -1 <= port <= 65535:
        raise ConfigError(f"metrics_port must be -1 (off), 0 (any free port) or a port, got {port}")


def check_device(device: str) -> None:
    """A device this machine has: cpu, or cuda:N with N below the CUDA device count."""
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a torch device like cpu or cuda:0") from None
    if d.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: only cpu and cuda devices are supported")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r}: this machine has no usable CUDA device (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use cpu"
            )
        count = torch.cuda.device_count()
        if d.index is not None and d.index >= count:
            raise ConfigError(
                f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}"
            )


# --- building configs from dictionaries (TOML files, --set overrides) ----------------------------


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, checking names and types; nested dataclasses recurse."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {where + close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown setting {where + unknown[0]!r}{hint} (known: {', '.join(sorted(names))})"
        )
    for f in dataclasses.fields(cls):  # a setting with choices: name them, whatever came
        choices = f.metadata.get("choices")
        if choices and f.name in data and data[f.name] not in choices:
            _one_of(where + f.name, data[f.name], choices)
    kwargs = {k: _coerce(hints[k], v, f"{where}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _coerce(kind: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, value, f"{name}.")
    origin = typing.get_origin(kind)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        (item,) = typing.get_args(kind)
        return [_coerce(item, v, name) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table, got {value!r}")
        return dict(value)
    if kind is float:
        if isinstance(value, str) and value.lower() in ("inf", "infinity", "+inf"):
            return INF  # a field that allows no infinity says so in check_settings
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{name} must be {getattr(kind, '__name__', kind)}, got {value!r}")


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        why = f"config file {path} does not exist"
        if not Path(path).is_absolute():
            why += f" in {Path.cwd()}"
        if Path(path).parts[:1] == ("configs",):  # the repository's, used from elsewhere
            why += "; the jobs in configs/ come with Wavelet's repository: give their path"
        raise ConfigError(why) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a TOML literal, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. optimizer.kwargs.momentum=0.8")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is not a table")
    node[path[-1]] = value
