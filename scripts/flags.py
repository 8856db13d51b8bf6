"""Command-line flags generated from the config dataclasses' field metadata, and the job flags
every training command shares (``--config FILE``, one flag per job setting, ``--set k=v``).

A bad flag or value prints one line and exits with status 2 (``usage_exit``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import typing
from collections.abc import Callable
from typing import Any, NoReturn

from wavelet.common.config import JobConfig
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.settings import (
    ConfigError,
    apply_override,
    flag_of,
    from_dict,
    load_toml,
    parse_override,
)

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if wrong:  # a misspelt command or choice: the closest one
            choices = re.findall(r"'([^']*)'", wrong.group(2))
            close = difflib.get_close_matches(wrong.group(1), choices, n=1)
            if close:
                message += f"; did you mean {close[0]}?"
        usage_exit(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001 (argparse's own)
        """As argparse's, but a flag no command has is reported by the command it was given
        to, with the closest flag that command has: ``--stalness``: did you mean
        ``--staleness``? (see wavelet launch --help)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = self._command_parser(parsed)
            flag = next((e for e in extra if e.startswith("-")), extra[0])
            options = [o for a in command._actions for o in a.option_strings]
            close = difflib.get_close_matches(flag.split("=")[0], options, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            usage_exit(f"unrecognized argument {flag}{hint} (see {command.prog} --help)")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser the arguments went to (this one where there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest or "", None)
                if name in action.choices:
                    return action.choices[name]
        return self


def usage_exit(message: str) -> NoReturn:
    print(f"wavelet: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# --- flags, generated from the config dataclasses' field metadata ------------------------------


def _default_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "none" if value == "" else str(value)


def _flag_help(f: dataclasses.Field, default: Any) -> str:
    text = f.metadata["help"]
    choices = f.metadata.get("choices")
    if choices:
        text += "; one of " + ", ".join(map(str, choices))
    if not isinstance(default, bool):
        text += f" (default {_default_text(default)})"
    return text


def number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a{'n' if kind is int else ''} {kind.__name__}"
            ) from None

    parse.__name__ = kind.__name__
    return parse


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_config_flags(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of config dataclass ``cls`` that has one (dest: the field's name)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = flag_of(f)
        if not flag or f.name in skip:
            continue
        kind, default = hints[f.name], _field_default(f)
        kw: dict[str, Any] = {"dest": f.name, "help": _flag_help(f, default)}
        if kind is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            p.add_argument(flag, action=action, default=default, **kw)
        elif kind == list[str] and f.metadata.get("repeated"):
            metavar = "FILE" if f.name.endswith("_files") else "ADDRESS"
            p.add_argument(flag, action="append", default=None, metavar=metavar, **kw)
        elif kind == list[str]:
            p.add_argument(flag, type=_comma_list, default=default, metavar="A,B", **kw)
        else:
            choices = f.metadata.get("choices") or None
            p.add_argument(
                flag,
                type=number(kind) if kind in (int, float) else str,
                default=default,
                choices=choices,
                metavar="V" if not choices else None,
                **kw,
            )


def config_from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """``cls`` from the flags ``add_config_flags`` made, plus ``fixed`` fields (the job)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        kwargs[f.name] = [] if value is None and f.metadata.get("repeated") else value
    return cls(**kwargs, **fixed)


_JOB_FIELDS = [f for f in dataclasses.fields(JobConfig) if f.metadata.get("flag") != ""]
_JOB_NAMES = {f.name for f in dataclasses.fields(JobConfig)}
_OPTIMIZER_FLAGS = {"name": "--optimizer", "lr": "--lr", "weight_decay_on": "--weight-decay-on"}


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """Job flags keep the text the user typed (None when not given), so that a --config file's
    values stand unless a flag overrides them; job_from_args turns them into a JobConfig."""
    g = p.add_argument_group("job (override the --config file)")
    g.add_argument("--config", help="job file, TOML or JSON (see configs/)")
    for f in _JOB_FIELDS:
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f"job.{f.name}",
            metavar="V",
            help=_flag_help(f, _field_default(f)),
        )
    for f in dataclasses.fields(OptimizerConfig):
        if f.name in _OPTIMIZER_FLAGS:
            g.add_argument(
                _OPTIMIZER_FLAGS[f.name],
                dest=f"job.optimizer.{f.name}",
                metavar="V",
                help=_flag_help(f, _field_default(f)),
            )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any job setting, e.g. optimizer.kwargs.momentum=0.8 or "
        "dataset_kwargs.train_size=4096 (repeatable)",
    )


def job_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None) -> JobConfig:
    """The job the flags give: ``--config`` (else ``base``, e.g. a running job's), then each
    job flag, then ``--set`` overrides."""
    data: dict[str, Any] = dict(base or {})
    if args.config:
        if args.config.endswith(".json"):
            try:
                with open(args.config) as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"cannot read {args.config}: {e}") from None
        else:
            data = load_toml(args.config)
    for dest, raw in vars(args).items():
        if dest.startswith("job.") and raw is not None:
            _, value = parse_override(f"x={raw}")
            if dest.endswith(".name") or dest in ("job.model", "job.dataset"):
                value = raw  # names stay strings even when they look like numbers
            apply_override(data, dest.split(".")[1:], value)
    for text in args.overrides:
        path, value = parse_override(text)
        if len(path) == 1 and path[0] not in _JOB_NAMES and hasattr(args, path[0]):
            flag = "--" + path[0].replace("_", "-")
            raise ConfigError(
                f"--set {text!r}: {path[0]} is a flag of this command, not a job setting: "
                f"give it as {flag} {value}"
            )
        apply_override(data, path, value)
    return from_dict(JobConfig, data)
