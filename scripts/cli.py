"""The ``wavelet`` command: ``launch``, ``ps``, ``worker``, ``run`` (under torchrun), ``compare``,
``tune``, ``stats``, ``admin`` and ``keys``.

Every subcommand that runs training reads a job from ``--config FILE`` (TOML or JSON), then applies
the job flags (``--epochs 5``, ``--staleness inf``, ...) and ``--set key=value`` overrides.
A bad flag or value prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from wavelet.common.config import STALE_POLICIES
from wavelet.common.daemon_config import LaunchConfig, PSConfig, RunConfig, WorkerConfig
from wavelet.common.process_exit import run_and_exit
from wavelet.common.settings import (
    ConfigError,
)
from wavelet.scripts.commands import (
    cmd_admin,
    cmd_clean,
    cmd_compare,
    cmd_keys,
    cmd_launch,
    cmd_ps,
    cmd_run,
    cmd_stats,
    cmd_tune,
    cmd_worker,
)
from wavelet.scripts.flags import Parser, add_config_flags, add_job_flags, number, usage_exit
from wavelet.scripts.forkserver import ForkServer
from wavelet.scripts.signals import interrupt_on_stop_signals

log = logging.getLogger(__name__)


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
            if f.name not in ("devices", "cuda_memory_gib", "slow_device")
        ),
    )
    p.add_argument("--out", help=f"report directory (default runs/{name}-<time>)")
    p.add_argument(
        "--target-acc",
        type=number(float),
        default=0.97,
        help="test accuracy for the time-to-accuracy column (default 0.97)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="wavelet",
        description="Tick-tock data-parallel training on a sharded parameter server.",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much the daemons log (default INFO)",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_training_commands(sub)
    _add_sweep_commands(sub)
    _add_tool_commands(sub)
    return p


def _add_training_commands(sub) -> None:
    """launch (a whole job here), ps and worker (one daemon), run (one process under torchrun)."""

    launch = sub.add_parser(
        "launch", help="run a whole job on this machine (the default job trains the digits CNN)"
    )
    add_job_flags(launch)
    add_config_flags(launch, LaunchConfig)
    launch.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="restart a stopped job from its run dir: shards restore their checkpoints, "
        "waves go on from their clocks (other flags are ignored)",
    )
    launch.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing but errors: no run-dir line, progress or summary (they are in the "
        "run dir: summary.json, logs/)",
    )
    launch.set_defaults(run=cmd_launch)

    ps = sub.add_parser("ps", help="run one parameter-server shard daemon")
    add_job_flags(ps)
    add_config_flags(ps, PSConfig)
    ps.set_defaults(run=cmd_ps)

    worker = sub.add_parser("worker", help="run the waves of one device")
    add_job_flags(worker)
    add_config_flags(worker, WorkerConfig)
    worker.set_defaults(run=cmd_worker)

    run = sub.add_parser(
        "run",
        help="one process of a job started by torchrun: its role (shard or worker) from "
        "torchrun's environment, the same command on every node",
    )
    add_job_flags(run)
    add_config_flags(run, RunConfig)
    run.set_defaults(run=cmd_run)


def _add_sweep_commands(sub) -> None:
    """compare (one job in several modes) and tune (staleness bounds and policies)."""
    from wavelet.scripts.modes import BUDGET_MODES, DEFAULT_MODES
    from wavelet.scripts.modes import MODES as COMPARE_MODES

    comp = sub.add_parser("compare", help="run one job in several modes and compare them")
    add_job_flags(comp)
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
    comp.set_defaults(run=cmd_compare)

    tune = sub.add_parser(
        "tune",
        help="sweep update rules, staleness bounds and policies on one job, ranked by time to "
        "target",
    )
    add_job_flags(tune)
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
    tune.add_argument(
        "--seeds",
        default="0,1",
        help="run every setting once per seed; a difference within the spread between seeds "
        "is a tie (default 0,1)",
    )
    _add_sweep_flags(tune, "tune")
    tune.set_defaults(run=cmd_tune)


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
        "--timeout", type=number(float), default=5.0, help="seconds to wait per shard (default 5)"
    )
    stats.add_argument(
        "--watch",
        type=number(float),
        default=0.0,
        metavar="SECONDS",
        help="refresh the table every SECONDS until Ctrl-C (default 0: print once)",
    )
    _add_client_key_flags(stats)
    stats.set_defaults(run=cmd_stats)

    admin = sub.add_parser(
        "admin", help="checkpoint or shut down running shards (needs the run's admin token)"
    )
    admin.add_argument("action", choices=["checkpoint", "shutdown"], help="what the shards do")
    admin.add_argument(
        "addresses",
        nargs="+",
        metavar="ADDRESS",
        help="the shards' addresses, or the run dir of a job wavelet launch started (its "
        "admin token too)",
    )
    admin.add_argument("--run-dir", help="the shards' run dir (its admin.token is used)")
    admin.add_argument("--token-file", help="the admin token file, if not in a run dir")
    admin.add_argument(
        "--timeout",
        type=number(float),
        default=30.0,
        help="seconds to wait per shard (default 30)",
    )
    _add_client_key_flags(admin)
    admin.set_defaults(run=cmd_admin)

    clean = sub.add_parser(
        "clean",
        help="remove the shared-memory segments a killed job left (once none of its shards runs)",
    )
    clean.add_argument("run_dir", metavar="RUN_DIR", help="the job's run dir")
    clean.set_defaults(run=cmd_clean)

    keys = sub.add_parser("keys", help="make CURVE key pairs (NAME.key, NAME.key_secret)")
    keys.add_argument("names", nargs="*", metavar="NAME", help="e.g. server worker0 worker1")
    keys.add_argument(
        "--job",
        metavar="DIR",
        help="make a torchrun job's keys in DIR (the shards' pair, one client pair for the "
        "workers, the authorized folder), for wavelet run --curve-keys DIR",
    )
    keys.add_argument("--out", default="keys", help="folder for the key files (default keys/)")
    keys.set_defaults(run=cmd_keys)


# Commands that start jobs: the fork server their daemons come from is forked from the command
# itself, before it runs anything (``ForkServer.fork_here``).
JOB_COMMANDS = (cmd_launch, cmd_compare, cmd_tune)


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
    # the server ends in ForkServer.fork_here, its daemons in their own call of this function
    own_process = argv is None if entry_point is None else entry_point
    args.fork_server = _job_fork_server(args) if own_process else None
    interrupt_on_stop_signals()  # daemons replace it with their clean stop (on_signals)
    if not own_process:
        return _run(args)
    run_and_exit(lambda: _run(args))  # without the teardown of torch's modules (a second each)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except ConfigError as e:
        usage_exit(str(e))
    finally:
        if args.fork_server is not None:
            args.fork_server.close()


if __name__ == "__main__":
    sys.exit(main())
