"""The ``wavelet`` command: ``launch``, ``ps``, ``worker`` and ``stats``.

Every subcommand that runs training reads a job from ``--config FILE`` (TOML or JSON), then applies
the job flags (``--epochs 5``, ``--staleness inf``, ...) and ``--set key=value`` overrides.
A bad flag or value prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from wavelet.common.config import (
    STALE_POLICIES,
    ConfigError,
    JobConfig,
    LaunchConfig,
    PSConfig,
    WorkerConfig,
    apply_override,
    from_dict,
    load_toml,
    parse_override,
)

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _usage_exit(f"{self.prog}: {message} (see {self.prog} --help)")


def _usage_exit(message: str) -> NoReturn:
    print(f"wavelet: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# --- job flags -------------------------------------------------------------------------------

_JOB_FLAGS = [
    f.name
    for f in dataclasses.fields(JobConfig)
    if f.name != "optimizer" and not f.name.endswith("_kwargs")
]


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job (override the --config file)")
    g.add_argument("--config", help="job file, TOML or JSON (see configs/)")
    for name in _JOB_FLAGS:
        default = JobConfig.__dataclass_fields__[name].default
        g.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"job.{name}",
            metavar="V",
            help=f"(default {default})",
        )
    g.add_argument(
        "--optimizer",
        dest="job.optimizer.name",
        metavar="NAME",
        help="torch.optim optimizer by name (default sgd)",
    )
    g.add_argument("--lr", dest="job.optimizer.lr", metavar="V", help="learning rate")
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
        return launch(_resumed(args.resume), quiet=args.quiet)
    config = LaunchConfig(
        job=job_from_args(args),
        devices=args.devices.split(","),
        run_dir=args.run_dir or "",
        host=args.host,
        mode=args.mode,
        schedule=args.schedule,
        processes_per_device=args.processes_per_device,
        threads=args.threads,
        curve=args.curve,
        insecure=args.insecure,
        checkpoint_every=args.checkpoint_every,
        checkpoint_every_s=args.checkpoint_every_s,
    )
    return launch(config, quiet=args.quiet)


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
    from wavelet.ps.server import ShardServer

    config = PSConfig(
        job=job_from_args(args),
        shard_index=args.shard_index,
        bind=args.bind,
        expect_waves=args.expect_waves,
        ready_file=args.ready_file or "",
        run_dir=args.run_dir or "",
        max_message_mib=args.max_message_mib,
        max_parked=args.max_parked,
        checkpoint_every=args.checkpoint_every,
        checkpoint_every_s=args.checkpoint_every_s,
        curve_secret=args.curve_secret,
        curve_authorized=args.curve_authorized,
        insecure=args.insecure,
    )
    import torch

    torch.set_num_threads(config.threads)
    server = ShardServer(config)
    _on_signals(server.stop)
    print(f"shard {config.shard_index} listening on {server.address}", flush=True)
    server.serve_forever()
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from wavelet.common.job import check_job

    config = WorkerConfig(
        job=job_from_args(args),
        shard_addresses=args.shard,
        device=args.device,
        rank=args.rank,
        num_workers=args.num_workers,
        threads=args.threads,
        run_dir=args.run_dir,
        mode=args.mode,
        device_index=args.device_index,
        curve_secret=args.curve_secret,
        curve_server_key=args.curve_server_key,
        resume=args.resume,
    )
    if config.mode == "allreduce":
        from wavelet.worker.allreduce import AllReduceWorker

        daemon = AllReduceWorker(config)
    else:
        from wavelet.worker.daemon import WorkerDaemon

        check_job(config.job, config.num_workers * config.job.waves)
        daemon = WorkerDaemon(config, schedule=args.schedule)
    _on_signals(daemon.stop)
    return daemon.run()


def _cmd_compare(args: argparse.Namespace) -> int:
    from wavelet.scripts.compare import compare, format_table

    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        results = compare(job_from_args(args), args.devices.split(","), modes, out, args.target_acc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(format_table(results, args.target_acc))
    print(f"report: {out / 'report.md'}")
    return 0 if all(r.ok for r in results) else 1


def _cmd_tune(args: argparse.Namespace) -> int:
    from wavelet.scripts.tune import (
        format_recommendation,
        format_table,
        parse_bounds,
        settings_for,
        tune,
    )

    job = job_from_args(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in STALE_POLICIES:
            raise ConfigError(f"unknown policy {p!r}; choose from {', '.join(STALE_POLICIES)}")
    settings = settings_for(parse_bounds(args.bounds), policies)
    out = Path(args.out or f"runs/tune-{time.strftime('%Y%m%d-%H%M%S')}")
    results = tune(job, args.devices.split(","), settings, out, args.target_acc)
    print(format_table(results, args.target_acc))
    print(format_recommendation(results))
    print(f"report: {out / 'report.md'}")
    return 0 if all(r.metrics for r in results) else 1


def _cmd_stats(args: argparse.Namespace) -> int:
    from wavelet.common.security import ClientKeys
    from wavelet.scripts.stats import print_stats

    keys = ClientKeys.load(args.curve_secret, args.curve_server_key) if args.curve_secret else None
    return print_stats(args.addresses, timeout_s=args.timeout, keys=keys)


def _cmd_keys(args: argparse.Namespace) -> int:
    from wavelet.common.security import generate_keys

    for name in args.names:
        public, secret = generate_keys(args.out, name)
        print(f"{name}: public {public}, secret {secret}")
    return 0


def _on_signals(stop: Callable[[], None]) -> None:
    def handler(signum, frame):
        logging.getLogger("wavelet").info("received %s, shutting down", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _add_client_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--curve-secret", default="", metavar="FILE", help="CURVE: this client's .key_secret file"
    )
    p.add_argument(
        "--curve-server-key", default="", metavar="FILE", help="CURVE: the shards' public .key file"
    )


def _add_sweep_flags(p: argparse.ArgumentParser, name: str) -> None:
    """What compare and tune share: where to run, where to write, what accuracy to aim for."""
    p.add_argument("--devices", default="cpu")
    p.add_argument("--out", help=f"report directory (default runs/{name}-<time>)")
    p.add_argument(
        "--target-acc",
        type=float,
        default=0.97,
        help="test accuracy for the time-to-accuracy column (default 0.97)",
    )


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="shards checkpoint every N updates (0: only when they stop)",
    )
    p.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=0.0,
        metavar="S",
        help="shards checkpoint every S seconds (0: only when they stop)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="wavelet",
        description="Tick-tock data-parallel training on a sharded parameter server.",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    launch = sub.add_parser(
        "launch", help="run a whole job on this machine (the default job trains the digits CNN)"
    )
    _add_job_flags(launch)
    launch.add_argument(
        "--devices",
        default="cpu",
        help="comma-separated devices, one worker each: cpu, cuda:0,cuda:1, "
        "or cpu,cpu for two CPU workers (default cpu)",
    )
    launch.add_argument("--run-dir", help="where logs and records go (default runs/<time>)")
    launch.add_argument("--host", default="127.0.0.1", help="address the shards bind")
    launch.add_argument(
        "--schedule",
        choices=["ticktock", "together"],
        default="ticktock",
        help="ticktock: forwards take turns; together: waves start at once",
    )
    launch.add_argument(
        "--mode",
        choices=["ps", "allreduce"],
        default="ps",
        help="ps: waves through the shards; allreduce: DDP over "
        "torch.distributed (gloo on CPU, NCCL on GPU), the baseline",
    )
    launch.add_argument(
        "--processes-per-device",
        type=int,
        default=1,
        help="worker processes (ps) or DDP ranks (allreduce) per device; 2 runs two tasks "
        "on each device side by side, the baseline tick-tock is compared with",
    )
    launch.add_argument(
        "--curve",
        action="store_true",
        help="make CURVE keys (in the run dir) and encrypt and authenticate all "
        "of the job's traffic with them",
    )
    launch.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without --curve"
    )
    launch.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker process (default: the cores divided "
        "among the waves that run at once, so none are oversubscribed)",
    )
    _add_checkpoint_flags(launch)
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
    ps.add_argument("--shard-index", type=int, default=0)
    ps.add_argument(
        "--bind",
        default="tcp://127.0.0.1:0",
        help="ZeroMQ address to listen on; port 0 picks a free one",
    )
    ps.add_argument(
        "--expect-waves",
        type=int,
        default=0,
        help="hold first pulls until this many waves registered (0: no barrier)",
    )
    ps.add_argument("--ready-file", help="write the bound address here once listening")
    ps.add_argument(
        "--run-dir",
        help="per-push records and checkpoints go here; a shard "
        "restarted with the same run dir resumes from its last checkpoint",
    )
    _add_checkpoint_flags(ps)
    ps.add_argument(
        "--max-message-mib",
        type=float,
        default=1024.0,
        help="larger messages are dropped (default 1024)",
    )
    ps.add_argument(
        "--curve-secret",
        default="",
        metavar="FILE",
        help="CURVE: this shard's .key_secret file (see wavelet keys)",
    )
    ps.add_argument(
        "--curve-authorized",
        default="",
        metavar="DIR",
        help="CURVE: folder of the public .key files of the clients to accept",
    )
    ps.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding beyond loopback without CURVE (traffic in the clear)",
    )
    ps.add_argument(
        "--max-parked",
        type=int,
        default=4096,
        help="pulls held back by the staleness bound at once, at most (default 4096)",
    )
    ps.set_defaults(run=_cmd_ps)

    worker = sub.add_parser("worker", help="run the waves of one device")
    _add_job_flags(worker)
    worker.add_argument(
        "--shard",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a shard's address, once per shard, in order (ps mode)",
    )
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--rank", type=int, default=0)
    worker.add_argument("--num-workers", type=int, default=1)
    worker.add_argument(
        "--threads", type=int, default=0, help="torch threads for this process (0: all cores)"
    )
    worker.add_argument("--run-dir", default="runs/latest")
    worker.add_argument("--schedule", choices=["ticktock", "together"], default="ticktock")
    worker.add_argument(
        "--mode",
        choices=["ps", "allreduce"],
        default="ps",
        help="allreduce: one DDP rank, rendezvous from torchrun's env:// "
        "variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)",
    )
    _add_client_key_flags(worker)
    worker.add_argument(
        "--resume",
        action="store_true",
        help="go on from the clocks the shards restored from checkpoints",
    )
    worker.add_argument(
        "--device-index",
        type=int,
        default=-1,
        help="physical device number for memory "
        "reports, when several workers share a device (default: the rank)",
    )
    worker.set_defaults(run=_cmd_worker)

    comp = sub.add_parser("compare", help="run one job in several modes and compare them")
    _add_job_flags(comp)
    comp.add_argument(
        "--modes",
        default="ticktock,ticktock-wide,single,together,procs,bsp,allreduce,allreduce2",
        help="comma-separated, from ticktock, ticktock-wide, single, together, procs, bsp, "
        "allreduce, "
        "allreduce2 (default: all)",
    )
    _add_sweep_flags(comp, "compare")
    comp.set_defaults(run=_cmd_compare)

    tune = sub.add_parser("tune", help="sweep staleness bounds and policies on one job")
    _add_job_flags(tune)
    tune.add_argument("--bounds", default="0,1,2,4,8,inf", help="staleness bounds to try")
    tune.add_argument(
        "--policies", default="apply,scale,drop,dc-asgd", help="stale-gradient policies to try"
    )
    _add_sweep_flags(tune, "tune")
    tune.set_defaults(run=_cmd_tune)

    stats = sub.add_parser("stats", help="print live shards' versions, clocks and staleness")
    stats.add_argument("addresses", nargs="+", metavar="ADDRESS")
    stats.add_argument("--timeout", type=float, default=5.0)
    _add_client_key_flags(stats)
    stats.set_defaults(run=_cmd_stats)

    keys = sub.add_parser("keys", help="make CURVE key pairs (NAME.key, NAME.key_secret)")
    keys.add_argument("names", nargs="+", metavar="NAME", help="e.g. server worker0 worker1")
    keys.add_argument("--out", default="keys", help="folder for the key files (default keys/)")
    keys.set_defaults(run=_cmd_keys)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args.run(args)
    except ConfigError as e:
        _usage_exit(str(e))


if __name__ == "__main__":
    sys.exit(main())
