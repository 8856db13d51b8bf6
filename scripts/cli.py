"""The ``wavelet`` command: ``launch``, ``ps``, ``worker``, ``run`` (under torchrun), ``compare``,
``tune``, ``stats``, ``admin`` and ``keys``.

Every subcommand that runs training reads a job from ``--config FILE`` (TOML or JSON), then applies
the job flags (``--epochs 5``, ``--staleness inf``, ...) and ``--set key=value`` overrides.
A bad flag or value prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from wavelet.common.config import STALE_POLICIES, JobConfig, OptimizerConfig
from wavelet.common.daemon_config import LaunchConfig, PSConfig, RunConfig, WorkerConfig
from wavelet.common.records import new_run_dir
from wavelet.common.settings import (
    ConfigError,
    apply_override,
    check_address,
    check_device,
    flag_of,
    from_dict,
    load_toml,
    parse_override,
)
from wavelet.scripts.forkserver import ForkServer
from wavelet.scripts.signals import INTERRUPTED, interrupt_on_sigint, on_signals

log = logging.getLogger(__name__)

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _usage_exit(f"{self.prog}: {message} (see {self.prog} --help)")


def _usage_exit(message: str) -> NoReturn:
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


def _number(kind: type) -> Callable[[str], Any]:
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
                type=_number(kind) if kind in (int, float) else str,
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
_OPTIMIZER_FLAGS = {"name": "--optimizer", "lr": "--lr", "weight_decay_on": "--weight-decay-on"}


def _add_job_flags(p: argparse.ArgumentParser) -> None:
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


def job_from_args(args: argparse.Namespace) -> JobConfig:
    data: dict[str, Any] = {}
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
        apply_override(data, *parse_override(text))
    return from_dict(JobConfig, data)


# --- subcommands ------------------------------------------------------------------------------


def _cmd_launch(args: argparse.Namespace) -> int:
    from wavelet.scripts.launch import launch

    if args.resume:
        return launch(_resumed(args.resume), quiet=args.quiet, fork_server=args.fork_server)
    # --resume RUN_DIR is handled above; the config's own resume flag is then False, not the path
    config = config_from_args(LaunchConfig, args, job=job_from_args(args), resume=False)
    return launch(config, quiet=args.quiet, fork_server=args.fork_server)


def _resumed(run_dir: str) -> LaunchConfig:
    """The launch settings and job a run dir was started with, to resume it."""
    try:
        job = json.loads((Path(run_dir) / "job.json").read_text())
        settings = json.loads((Path(run_dir) / "launch.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{run_dir} is not a run dir wavelet launch can resume: {e}") from None
    settings.update(resume=True, run_dir=run_dir)
    return from_dict(LaunchConfig, {**settings, "job": job})


def _cmd_ps(args: argparse.Namespace) -> int:
    from wavelet.ps.server import BindError, ShardServer

    config = config_from_args(PSConfig, args, job=job_from_args(args))
    import torch

    torch.set_num_threads(config.threads)
    try:
        server = ShardServer(config)
    except BindError as e:
        raise ConfigError(str(e)) from None
    endpoint = None
    if config.metrics_port >= 0:
        from wavelet.ps.metrics import serve_shard_metrics

        endpoint = serve_shard_metrics(server, config)
    on_signals(server.stop)
    print(f"shard {config.shard_index} listening on {server.address}", flush=True)
    try:
        server.serve_forever()
    finally:
        if endpoint:
            endpoint.stop()
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from wavelet.common.job import check_job

    config = config_from_args(WorkerConfig, args, job=job_from_args(args))
    if config.mode == "allreduce":
        from wavelet.worker.allreduce import AllReduceWorker, exit_rank, run_rank

        rank = AllReduceWorker(config)
        on_signals(rank.stop)
        exit_rank(run_rank(rank))
    from wavelet.worker.daemon import WorkerDaemon

    check_job(config.job, config.num_workers * config.job.waves)
    daemon = WorkerDaemon(config)
    on_signals(daemon.stop)
    if not config.report:
        return daemon.run()
    from wavelet.scripts.report import train_and_report

    return train_and_report(daemon)


def _cmd_run(args: argparse.Namespace) -> int:
    from wavelet.scripts.run import run

    return run(config_from_args(RunConfig, args, job=job_from_args(args)))


def _cmd_compare(args: argparse.Namespace) -> int:
    from wavelet.scripts.budget import parse_budget
    from wavelet.scripts.compare import (
        compare,
        default_modes,
        format_table,
        plan_budget,
        verdict,
    )
    from wavelet.scripts.modes import check_modes

    job = job_from_args(args)
    plan = None
    if args.memory_budget:
        plan = plan_budget(job, parse_budget(args.memory_budget), args.devices[0], args.lr_scaling)
    default = default_modes(job, args.devices, plan is not None)
    modes = check_modes(
        [m.strip() for m in (args.modes or ",".join(default)).split(",") if m.strip()]
    )
    out = Path(args.out) if args.out else new_run_dir("compare")
    try:
        results = compare(
            job,
            args.devices,
            modes,
            out,
            args.target_acc,
            {"cuda_memory_gib": args.cuda_memory_gib},
            plan,
            fork_server=args.fork_server,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print("\n".join(verdict(results, args.target_acc, plan)))
    print(format_table(results, args.target_acc, plan))
    print(f"report: {out / 'report.md'}")
    if any(r.interrupted for r in results):
        return INTERRUPTED
    return 0 if all(r.ok for r in results) else 1


def _cmd_tune(args: argparse.Namespace) -> int:
    from wavelet.scripts.tune import (
        format_recommendation,
        format_table,
        parse_bounds,
        parse_policies,
        parse_updates,
        settings_for,
        tune,
    )

    job = job_from_args(args)
    settings = settings_for(
        parse_bounds(args.bounds), parse_policies(args.policies), parse_updates(args.sweep_updates)
    )
    for d in args.devices:
        check_device(d)
    out = Path(args.out) if args.out else new_run_dir("tune")
    results = tune(job, args.devices, settings, out, args.target_acc, args.fork_server)
    print(format_table(results, args.target_acc))
    print(format_recommendation(results))
    print(f"report: {out / 'report.md'}")
    if any(r.interrupted for r in results):
        return INTERRUPTED
    return 0 if all(r.figures for r in results) else 1


def _cmd_stats(args: argparse.Namespace) -> int:
    from wavelet.scripts.stats import print_stats, run_dir_shards, watch

    keys = _client_keys(args)
    if len(args.addresses) == 1 and Path(args.addresses[0]).is_dir():
        addresses, run_keys = run_dir_shards(Path(args.addresses[0]))
        keys = keys or run_keys
    else:
        addresses = args.addresses
        for a in addresses:
            if "://" not in a:  # meant as a run dir
                raise ConfigError(f"{a}: no such directory, and not a shard address (tcp://...)")
    for a in addresses:
        check_address("shard address", a)
    if args.watch:
        return watch(addresses, args.watch, timeout_s=args.timeout, keys=keys)
    return print_stats(addresses, timeout_s=args.timeout, keys=keys)


def _cmd_admin(args: argparse.Namespace) -> int:
    from wavelet.common.messages import AdminRequest
    from wavelet.common.protocol import Op, ShardError
    from wavelet.common.security import admin_token_file, load_admin_token
    from wavelet.worker.connection import call_shard

    for a in args.addresses:
        check_address("shard address", a)
    if bool(args.run_dir) == bool(args.token_file):
        raise ConfigError("give the shards' admin token: --run-dir RUN_DIR or --token-file FILE")
    path = args.token_file or admin_token_file(args.run_dir)
    token = load_admin_token(path, create=False)
    keys = _client_keys(args)
    if keys is None and args.run_dir and (Path(args.run_dir) / "keys").is_dir():
        from wavelet.common.security import JobKeys

        keys = JobKeys(Path(args.run_dir) / "keys").client("launcher")  # its admin key
    op = Op.CHECKPOINT if args.action == "checkpoint" else Op.SHUTDOWN
    failed = 0
    for a in args.addresses:
        try:
            body = AdminRequest(token=token).to_wire()
            h = call_shard(a, op, args.timeout, keys=keys, body=body)
        except ShardError as e:
            print(f"wavelet admin: {e}", file=sys.stderr)
            failed += 1
            continue
        where = f": {h.body['path']}" if "path" in h.body else ""
        print(f"{a}: {args.action} done at version {h.body['version']}{where}")
    return 1 if failed else 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from wavelet.common.shm import SHM_DIR, SegmentsLock, remove_segments, run_prefix

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory")
    held = []
    try:
        # each live shard holds its lock: taking them all proves the job's shards are gone
        for path in sorted(run_dir.glob("ps-*.lock")):
            lock = SegmentsLock(path)
            if not lock.acquire():
                raise ConfigError(
                    f"a shard of {run_dir} is still running (pid {lock.holder()}); stop the job "
                    "first (it removes its segments as it stops)"
                )
            held.append(lock)
        removed = remove_segments(run_prefix(run_dir))
    finally:
        for lock in held:
            lock.release()
    print(f"removed {len(removed)} shared-memory segment(s) of {run_dir} from {SHM_DIR}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from wavelet.common.security import JobKeys, generate_keys

    if args.job:
        from wavelet.scripts.run import CURVE_ADMIN, CURVE_CLIENT

        keys = JobKeys.create(Path(args.job), [CURVE_CLIENT, CURVE_ADMIN])
        print(f"job keys in {keys.folder}: wavelet run --curve-keys {keys.folder}")
        return 0
    if not args.names:
        raise ConfigError("name the key pairs to make (e.g. server worker0), or give --job DIR")
    for name in args.names:
        public, secret = generate_keys(args.out, name)
        print(f"{name}: public {public}, secret {secret}")
    return 0


def _client_keys(args: argparse.Namespace):
    from wavelet.common.security import ClientKeys

    if not args.curve_secret:
        return None
    return ClientKeys.load(args.curve_secret, args.curve_server_key)


def _add_client_key_flags(p: argparse.ArgumentParser) -> None:
    add_config_flags(
        p,
        WorkerConfig,
        skip=tuple(
            f.name for f in dataclasses.fields(WorkerConfig) if not f.name.startswith("curve_")
        ),
    )


def _add_sweep_flags(p: argparse.ArgumentParser, name: str) -> None:
    """What compare and tune share: where to run, where to write, what accuracy to aim for."""
    add_config_flags(
        p,
        LaunchConfig,
        skip=tuple(
            f.name
            for f in dataclasses.fields(LaunchConfig)
            if f.name not in ("devices", "cuda_memory_gib")
        ),
    )
    p.add_argument("--out", help=f"report directory (default runs/{name}-<time>)")
    p.add_argument(
        "--target-acc",
        type=_number(float),
        default=0.97,
        help="test accuracy for the time-to-accuracy column (default 0.97)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="wavelet",
        description="Tick-tock data-parallel training on a sharded parameter server.",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much the daemons log (default INFO)",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_training_commands(sub)
    _add_sweep_commands(sub)
    _add_tool_commands(sub)
    return p


def _add_training_commands(sub) -> None:
    """launch (a whole job here), ps and worker (one daemon), run (one process under torchrun)."""

    launch = sub.add_parser(
        "launch", help="run a whole job on this machine (the default job trains the digits CNN)"
    )
    _add_job_flags(launch)
    add_config_flags(launch, LaunchConfig)
    launch.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="restart a stopped job from its run dir: shards restore their checkpoints, "
        "waves go on from their clocks (other flags are ignored)",
    )
    launch.add_argument("--quiet", action="store_true", help="no progress lines")
    launch.set_defaults(run=_cmd_launch)

    ps = sub.add_parser("ps", help="run one parameter-server shard daemon")
    _add_job_flags(ps)
    add_config_flags(ps, PSConfig)
    ps.set_defaults(run=_cmd_ps)

    worker = sub.add_parser("worker", help="run the waves of one device")
    _add_job_flags(worker)
    add_config_flags(worker, WorkerConfig)
    worker.set_defaults(run=_cmd_worker)

    run = sub.add_parser(
        "run",
        help="one process of a job started by torchrun: its role (shard or worker) from "
        "torchrun's environment, the same command on every node",
    )
    _add_job_flags(run)
    add_config_flags(run, RunConfig)
    run.set_defaults(run=_cmd_run)


def _add_sweep_commands(sub) -> None:
    """compare (one job in several modes) and tune (staleness bounds and policies)."""
    from wavelet.scripts.modes import BUDGET_MODES, DEFAULT_MODES
    from wavelet.scripts.modes import MODES as COMPARE_MODES

    comp = sub.add_parser("compare", help="run one job in several modes and compare them")
    _add_job_flags(comp)
    comp.add_argument(
        "--modes",
        default="",
        help="comma-separated modes, from "
        + ", ".join(COMPARE_MODES)
        + " (default: all but "
        + ", ".join(m for m in COMPARE_MODES if m not in DEFAULT_MODES)
        + "; with --memory-budget: "
        + ", ".join(BUDGET_MODES)
        + "; where ticktock comes out as wave-turns, as updates = auto does on CPUs, "
        "ticktock-async instead of ticktock-turns)",
    )
    comp.add_argument(
        "--memory-budget",
        default="",
        metavar="SIZE",
        help="compare at equal memory: each mode at the largest batch per task whose saved "
        "activations per device fit SIZE (200MB, 1.5GiB, or 1.3x one wave's peak)",
    )
    comp.add_argument(
        "--lr-scaling",
        choices=["linear", "none"],
        default="linear",
        help="with --memory-budget: the learning rate follows the samples per update "
        "(linear) or stays (none) (default linear)",
    )
    _add_sweep_flags(comp, "compare")
    comp.set_defaults(run=_cmd_compare)

    tune = sub.add_parser(
        "tune",
        help="sweep update rules, staleness bounds and policies on one job, ranked by time to "
        "target",
    )
    _add_job_flags(tune)
    tune.add_argument(
        "--bounds", default="0,1,2,4,8,inf", help="staleness bounds to try (default 0,1,2,4,8,inf)"
    )
    tune.add_argument(
        "--policies",
        default=",".join(STALE_POLICIES),
        help="stale-gradient policies to try, from "
        + ", ".join(STALE_POLICIES)
        + " (default: all)",
    )
    tune.add_argument(
        "--update-rules",
        dest="sweep_updates",
        metavar="RULES",
        default="async",
        help="update rules to try, from async (every bound and policy above), wave-groups and "
        "wave-turns (once each) (default async)",
    )
    _add_sweep_flags(tune, "tune")
    tune.set_defaults(run=_cmd_tune)


def _add_tool_commands(sub) -> None:
    """stats, admin, clean and keys: tools around running or stopped jobs."""
    stats = sub.add_parser("stats", help="print live shards' versions, clocks and staleness")
    stats.add_argument(
        "addresses",
        nargs="+",
        metavar="ADDRESS",
        help="the shards' addresses, or the run dir of a job wavelet launch started",
    )
    stats.add_argument(
        "--timeout", type=_number(float), default=5.0, help="seconds to wait per shard (default 5)"
    )
    stats.add_argument(
        "--watch",
        type=_number(float),
        default=0.0,
        metavar="SECONDS",
        help="refresh the table every SECONDS until Ctrl-C (default 0: print once)",
    )
    _add_client_key_flags(stats)
    stats.set_defaults(run=_cmd_stats)

    admin = sub.add_parser(
        "admin", help="checkpoint or shut down running shards (needs the run's admin token)"
    )
    admin.add_argument("action", choices=["checkpoint", "shutdown"], help="what the shards do")
    admin.add_argument("addresses", nargs="+", metavar="ADDRESS", help="the shards' addresses")
    admin.add_argument("--run-dir", help="the shards' run dir (its admin.token is used)")
    admin.add_argument("--token-file", help="the admin token file, if not in a run dir")
    admin.add_argument(
        "--timeout",
        type=_number(float),
        default=30.0,
        help="seconds to wait per shard (default 30)",
    )
    _add_client_key_flags(admin)
    admin.set_defaults(run=_cmd_admin)

    clean = sub.add_parser(
        "clean",
        help="remove the shared-memory segments a killed job left (once none of its shards runs)",
    )
    clean.add_argument("run_dir", metavar="RUN_DIR", help="the job's run dir")
    clean.set_defaults(run=_cmd_clean)

    keys = sub.add_parser("keys", help="make CURVE key pairs (NAME.key, NAME.key_secret)")
    keys.add_argument("names", nargs="*", metavar="NAME", help="e.g. server worker0 worker1")
    keys.add_argument(
        "--job",
        metavar="DIR",
        help="make a torchrun job's keys in DIR (the shards' pair, one client pair for the "
        "workers, the authorized folder), for wavelet run --curve-keys DIR",
    )
    keys.add_argument("--out", default="keys", help="folder for the key files (default keys/)")
    keys.set_defaults(run=_cmd_keys)


# Commands that start jobs: the fork server their daemons come from is forked from the command
# itself, before it runs anything (``ForkServer.fork_here``).
JOB_COMMANDS = (_cmd_launch, _cmd_compare, _cmd_tune)


def _job_fork_server(args: argparse.Namespace) -> ForkServer | None:
    if args.run not in JOB_COMMANDS or getattr(args, "spawn", None) == "exec":
        return None
    return ForkServer.fork_here()


def main(argv: list[str] | None = None, entry_point: bool | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments). ``entry_point``: whether
    this call is the process's own command, returning only to exit (default: without
    ``argv``, as ``wavelet`` and ``python -m`` call it); only then may a command that starts
    jobs fork their daemons' server from this process."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # A user's model or dataset module in the working directory imports, as with python -m.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # forked before anything runs (a test batch, a user's module), and outside the try below:
    # the server and its daemons leave by SystemExit through this frame, as from a new Python
    own_process = argv is None if entry_point is None else entry_point
    args.fork_server = _job_fork_server(args) if own_process else None
    interrupt_on_sigint()  # daemons replace it with their clean stop (on_signals)
    try:
        return args.run(args)
    except ConfigError as e:
        _usage_exit(str(e))
    finally:
        if args.fork_server is not None:
            args.fork_server.close()


if __name__ == "__main__":
    sys.exit(main())
