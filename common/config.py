"""Configuration: validated dataclasses, loadable from TOML, overridable from the command line.

``JobConfig`` is what every process of a job must agree on (model, data, optimizer, staleness).
Each daemon has one config type that wraps it: ``PSConfig``, ``WorkerConfig``, ``LaunchConfig``.
A TOML file holds a job (top-level keys and an ``[optimizer]`` table); flags override it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wavelet.common.schedule import SCHEDULES as LR_SCHEDULES

INF = math.inf
MiB = 1 << 20


class ConfigError(ValueError):
    """A bad configuration value; the message says which and what would be accepted."""


def _optimizer_names() -> dict[str, str]:
    """Lower-case name -> class name of every optimizer in torch.optim."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name != "Optimizer":
            found[name.lower()] = name
    return found


_OPTIMIZERS = _optimizer_names()


# Defaults per optimizer, under whatever the job's kwargs say: SGD trains with momentum 0.7
# unless told otherwise (momentum=0 gives plain SGD). Not the usual 0.9: staleness acts as
# implicit momentum ("asynchrony begets momentum", Mitliagkas et al. 2016), and measured on the
# default job (tick-tock, s = 1), 0.9 ended at 96.7-98.6% test accuracy over runs, 0.7 at 99.4%.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {"sgd": {"momentum": 0.7}}


@dataclass
class OptimizerConfig:
    """A ``torch.optim`` optimizer by name (case-insensitive) with its keyword arguments."""

    name: str = "sgd"
    lr: float = 0.05
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name.lower() not in _OPTIMIZERS:
            raise ConfigError(
                f"optimizer {self.name!r} is not in torch.optim; choose one of "
                + ", ".join(sorted(_OPTIMIZERS))
            )
        _positive("optimizer.lr", self.lr)
        self.build([torch.zeros(1, requires_grad=True)])  # bad kwargs fail now, not on a shard

    @property
    def effective_kwargs(self) -> dict[str, Any]:
        return {**OPTIMIZER_DEFAULTS.get(self.name.lower(), {}), **self.kwargs}

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, _OPTIMIZERS[self.name.lower()])
        kwargs = self.effective_kwargs
        # The fused kernels update in one pass: 2x (SGD) to 4x (Adam) faster on a shard's chunks
        # (scripts/bench_ps.py). Used where the optimizer has one, unless the job says otherwise.
        if "fused" in inspect.signature(cls).parameters and not {"fused", "foreach"} & set(kwargs):
            if all(p.is_floating_point() for p in params):
                kwargs = {**kwargs, "fused": True}
        try:
            return cls(params, lr=self.lr, **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"optimizer {self.name} rejected its arguments {kwargs}: {e}"
            ) from None


@dataclass
class JobConfig:
    """One training job, as every shard and worker sees it."""

    model: str = "digits_cnn"  # built-in name or "package.module:function"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"  # built-in name or "package.module:function"
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32  # per wave
    epochs: int = 15
    max_seconds: float = 0.0  # wall-clock budget per wave; 0 means epochs alone decide
    seed: int = 0
    waves: int = 2  # waves per device: 2 is tick-tock, 1 the single-wave baseline
    shards: int = 2
    chunk_mib: float = 4.0  # large tensors are cut into chunks of at most this size
    staleness: float = 1  # 0 bulk-synchronous, k stale-synchronous, inf asynchronous
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: str = "cosine"  # constant | cosine, over the job's budget
    stale_policy: str = "apply"  # apply | scale | drop | dc-asgd (see ps/policy.py)
    drop_limit: int = 4  # drop policy: gradients staler than this are dropped
    dc_lambda: float = 0.04  # dc-asgd: strength of the delay compensation
    eval_every: int = 1  # epochs between test-accuracy records (0: only at the end)
    memory_trace_iters: int = 40  # iterations per wave whose saved-activation timeline is kept
    request_timeout_s: float = 300.0  # longest wait for a shard's reply, parking included
    baton_timeout_s: float = 30.0  # a wave stalled this long loses its turn to forward
    # Workers heartbeat their live waves every heartbeat_s; a shard that hears nothing from a
    # wave for wave_timeout_s drops it from the membership, so it no longer holds others back.
    heartbeat_s: float = 1.0
    wave_timeout_s: float = 30.0
    # The baton passes once the holder's backward has freed all but this fraction of its saved
    # activations; 1.0 passes it the moment the forward ends (see docs/design.md).
    baton_handoff: float = 0.3
    # A straggler, for experiments: wave number slow_wave (counted over the whole job, -1 for
    # none) takes slow_factor times as long per iteration.
    slow_wave: int = -1
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "waves", "shards"):
            _positive(name, getattr(self, name))
        for name in ("epochs", "eval_every", "memory_trace_iters", "seed"):
            _non_negative(name, getattr(self, name))
        for name in ("max_seconds",):
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
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("stale_policy", self.stale_policy, STALE_POLICIES)
        _non_negative("drop_limit", self.drop_limit)
        _non_negative("dc_lambda", self.dc_lambda)
        if self.epochs == 0 and self.max_seconds == 0:
            raise ConfigError("epochs and max_seconds are both 0: give the job a budget")
        s = self.staleness
        if not (s >= 0 and (s == INF or float(s).is_integer())):
            raise ConfigError(f"staleness must be a whole number >= 0 or inf, got {s!r}")
        if s != INF:
            self.staleness = int(s)

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mib * MiB))


@dataclass
class PSConfig:
    """One parameter-server shard daemon."""

    job: JobConfig = field(default_factory=JobConfig)
    shard_index: int = 0
    bind: str = "tcp://127.0.0.1:0"  # port 0 picks a free port; the bound address is announced
    expect_waves: int = 0  # pulls at clock 0 wait until this many waves registered (0: none)
    ready_file: str = ""  # where to write the bound address once listening
    run_dir: str = ""  # per-push records and checkpoints go here (none if empty)
    threads: int = 1
    # Limits, so that no client can exhaust the shard's memory: larger messages are dropped by
    # ZeroMQ (the connection is closed), pulls parked beyond max_parked get an error reply.
    max_message_mib: float = 1024.0
    max_parked: int = 4096
    # Checkpoints (into run_dir/checkpoints): every N updates and/or every S seconds (0: never),
    # and always when the daemon stops. A restarted shard resumes from its last checkpoint.
    checkpoint_every: int = 0
    checkpoint_every_s: float = 0.0
    # CURVE (common/security.py): this shard's secret key file and the folder of the public keys
    # of the clients it accepts. Binding beyond loopback without them needs insecure = True.
    curve_secret: str = ""
    curve_authorized: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        _non_negative("shard_index", self.shard_index)
        if bool(self.curve_secret) != bool(self.curve_authorized):
            raise ConfigError("CURVE needs both --curve-secret and --curve-authorized")
        _positive("max_message_mib", self.max_message_mib)
        _positive("max_parked", self.max_parked)
        _non_negative("checkpoint_every", self.checkpoint_every)
        _non_negative("checkpoint_every_s", self.checkpoint_every_s)
        if self.shard_index >= self.job.shards:
            raise ConfigError(
                f"shard_index {self.shard_index} is out of range for {self.job.shards} shards"
            )
        _non_negative("expect_waves", self.expect_waves)
        _positive("threads", self.threads)
        _check_address("bind", self.bind)


@dataclass
class WorkerConfig:
    """One worker daemon: the waves of one device."""

    job: JobConfig = field(default_factory=JobConfig)
    shard_addresses: list[str] = field(default_factory=list)
    device: str = "cpu"
    rank: int = 0  # this worker's index among num_workers
    num_workers: int = 1
    threads: int = 0  # torch intra-op threads for this process; 0 picks cores / processes
    run_dir: str = "runs/latest"
    mode: str = "ps"  # ps: waves through the shards; allreduce: one DDP rank
    device_index: int = -1  # which physical device this is, for memory reports (-1: rank)
    resume: bool = False  # go on from the clocks the shards restored from their checkpoints
    curve_secret: str = ""  # CURVE: this worker's secret key file...
    curve_server_key: str = ""  # ...and the shards' public key file

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        if self.mode == "ps" and len(self.shard_addresses) != self.job.shards:
            raise ConfigError(
                f"got {len(self.shard_addresses)} shard addresses for a job of "
                f"{self.job.shards} shards; pass one --shard address per shard, in shard order"
            )
        for a in self.shard_addresses:
            _check_address("shard address", a)
        _check_device(self.device)
        _positive("num_workers", self.num_workers)
        if not 0 <= self.rank < self.num_workers:
            raise ConfigError(f"rank {self.rank} is out of range for {self.num_workers} workers")
        _non_negative("threads", self.threads)
        if self.device_index < 0:
            self.device_index = self.rank
        if bool(self.curve_secret) != bool(self.curve_server_key):
            raise ConfigError("CURVE needs both --curve-secret and --curve-server-key")


@dataclass
class LaunchConfig:
    """A whole job on this machine: the shards and one worker per device."""

    job: JobConfig = field(default_factory=JobConfig)
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    run_dir: str = ""  # default: runs/<timestamp>
    host: str = "127.0.0.1"
    curve: bool = False  # make CURVE keys for this job and use them between all its processes
    insecure: bool = False  # allow a non-loopback host without CURVE
    checkpoint_every: int = 0  # shards checkpoint every N updates (0: only when they stop)
    checkpoint_every_s: float = 0.0
    resume: bool = False  # run_dir holds a stopped job: restart it from its checkpoints
    mode: str = "ps"  # ps | allreduce
    schedule: str = "ticktock"  # ps mode: ticktock (forwards take turns) | together
    # Worker processes (ps mode) or DDP ranks (allreduce mode) per device; 2 gives the
    # "two tasks on one device" baselines.
    processes_per_device: int = 1
    threads: int = 0  # torch threads per worker process; 0 sizes pools to the cores

    def __post_init__(self) -> None:
        if not self.devices:
            raise ConfigError("devices is empty: name at least one device, e.g. cpu or cuda:0")
        for d in self.devices:
            _check_device(d)
        _one_of("mode", self.mode, MODES)
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("processes_per_device", self.processes_per_device, (1, 2))
        _non_negative("threads", self.threads)


MODES = ("ps", "allreduce")
# Names of ps/policy.py's policies (kept here so config has no dependency on the ps package).
STALE_POLICIES = ("apply", "scale", "drop", "dc-asgd")
SCHEDULES = ("ticktock", "together")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


def _check_address(what: str, address: str) -> None:
    if not address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{what} {address!r} is not a ZeroMQ address like tcp://127.0.0.1:5555")


def _check_device(device: str) -> None:
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a torch device like cpu or cuda:0") from None
    if d.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: only cpu and cuda devices are supported")


# --- building configs from dictionaries (TOML files, --set overrides) ----------------------------


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, checking names and types; nested dataclasses recurse."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting {where}{unknown[0]!r}; known: {', '.join(sorted(names))}"
        )
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
        if isinstance(value, str) and value.lower() in ("inf", "infinity"):
            return INF
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
        raise ConfigError(f"config file {path} does not exist") from None
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
