"""Settings: the machinery every config type shares, apart from the types themselves.

``setting`` declares a config field with what its command-line flag shows; ``command_line``
turns a config back into flags; ``check_settings`` and the small checks below validate values
with one-line ``ConfigError`` messages; ``from_dict``, ``load_toml`` and ``parse_override``
build configs from TOML files and ``--set key=value``. The types a user writes live in
``common/config.py``; the daemons' own in ``common/daemon_config.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import torch

INF = math.inf
MiB = 1 << 20


class ConfigError(ValueError):
    """A bad configuration value; the message says which and what would be accepted::

        try:
            wavelet.JobConfig(epoch=3)
        except wavelet.ConfigError as e:
            print(e)  # unknown setting 'epoch'; did you mean 'epochs'?

    It is a ``ValueError``, so code that catches those catches it too.
    """


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


def default_of(f: dataclasses.Field) -> Any:
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
        if not flag or value == default_of(f):
            continue
        if isinstance(default_of(f), bool):
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
            one_of(prefix + f.name, value, choices)


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


def one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def non_negative(name: str, value: float) -> None:
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


def check_metrics_port(port: int) -> None:
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


def init_names(cls: type) -> set[str]:
    """What ``cls(...)`` takes by keyword: its fields and its init-only values (``lr``)."""
    return set(cls.__dataclass_fields__)


# torch.optim arguments a user may give where the optimizer's kwargs table belongs
OPTIMIZER_ARGUMENTS = ("momentum", "weight_decay", "betas", "eps", "nesterov", "dampening")
_CHECKED: list[type] = []  # the config classes, for "it belongs in another table"


def unknown_setting(cls: type, name: str, where: str = "") -> ConfigError:
    """The one line for a setting ``cls`` does not have: the close spelling, or the table it
    belongs in (a nested config's setting given at the top, or the other way round)."""
    names = init_names(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # a nested table's setting, given one level up
        kind = hints.get(f.name)
        if dataclasses.is_dataclass(kind) and name in init_names(kind):
            return ConfigError(
                f"unknown setting {where + name!r}: it is a setting of the {f.name} table; "
                f"give it as {where + f.name}.{name}"
            )
    for parent in _CHECKED:  # a setting of the table above, given inside a nested one
        nested = [
            f
            for f in dataclasses.fields(parent)
            if typing.get_type_hints(parent).get(f.name) is cls
        ]
        if nested and name in init_names(parent):
            return ConfigError(
                f"unknown setting {where + name!r}: {name} is a setting of the job itself, not "
                f"of its {nested[0].name} table: give it at the top level"
            )
    if name in OPTIMIZER_ARGUMENTS:
        table = "" if "kwargs" in names else "optimizer."
        return ConfigError(
            f"unknown setting {where + name!r}: {name} is an argument of the optimizer; give it "
            f"as {where}{table}kwargs.{name} (--set {where}{table}kwargs.{name}=V; from Python, "
            f"optimizer={{'name': 'sgd', 'kwargs': {{'{name}': V}}}})"
        )
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        return ConfigError(f"unknown setting {where + name!r}; did you mean {where + close[0]!r}?")
    known = ", ".join(sorted(names))
    return ConfigError(f"unknown setting {where + name!r} (known: {known})")


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, checking names and types; nested dataclasses recurse."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - init_names(cls))
    if unknown:
        raise unknown_setting(cls, unknown[0], where)
    for f in dataclasses.fields(cls):  # a setting with choices: name them, whatever came
        choices = f.metadata.get("choices")
        if choices and f.name in data and data[f.name] not in choices:
            one_of(where + f.name, data[f.name], choices)
    kwargs = {k: _coerce(_unwrapped(hints[k]), v, f"{where}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _unwrapped(kind: Any) -> Any:
    """An init-only value's own type (``InitVar[float | None]`` -> float)."""
    if isinstance(kind, dataclasses.InitVar):
        kind = kind.type
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def keyword_checked(cls: type) -> type:
    """A config class whose construction refuses an unknown keyword with the same one line as
    a file or a flag (``JobConfig(epoch=3)``: did you mean 'epochs'?), not a bare TypeError."""
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - init_names(cls))
        if unknown:
            raise unknown_setting(cls, unknown[0])
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    _CHECKED.append(cls)
    return cls


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
