"""What each ``wavelet`` subcommand does, once ``scripts/cli.py`` has parsed its flags."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from wavelet.common.daemon_config import LaunchConfig, PSConfig, RunConfig, WorkerConfig
from wavelet.common.records import new_run_dir
from wavelet.common.settings import ConfigError, check_address, check_device, from_dict
from wavelet.scripts.flags import config_from_args, job_from_args
from wavelet.scripts.signals import INTERRUPTED, on_signals

log = logging.getLogger(__name__)


def cmd_launch(args: argparse.Namespace) -> int:
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


def cmd_ps(args: argparse.Namespace) -> int:
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

        try:
            endpoint = serve_shard_metrics(server, config)
        except BaseException:
            server.close()  # its sockets, before the process exits with one line
            raise
    on_signals(server.stop)
    print(f"shard {config.shard_index} listening on {server.address}", flush=True)
    try:
        server.serve_forever()
    finally:
        if endpoint:
            endpoint.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from wavelet.common.job import check_job

    config = config_from_args(WorkerConfig, args, job=job_from_args(args))
    if config.join:
        config = _joined(config, args)
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


def _joined(config: WorkerConfig, args: argparse.Namespace) -> WorkerConfig:
    """``wavelet worker --join ADDR``: the running job's description from that shard (its job,
    with what the command line says of it on top: --max-seconds, say), every shard's address
    and a worker slot."""
    import dataclasses

    from wavelet.common.messages import DescribeRequest, reply_body
    from wavelet.common.protocol import Op, ShardError
    from wavelet.common.security import load_admin_token
    from wavelet.worker.connection import call_shard, client_keys

    token = load_admin_token(config.join_token_file, create=False)
    try:
        h = call_shard(
            config.join,
            Op.DESCRIBE,
            timeout_s=30.0,
            keys=client_keys(config),
            body=DescribeRequest(token=token).to_wire(),
        )
    except ShardError as e:
        raise ConfigError(f"--join {config.join}: {e}") from None
    described = reply_body(Op.DESCRIBE, h)
    job = job_from_args(args, base=described.job)
    print(
        f"joining the job of {config.join} as worker {described.rank} of "
        f"{described.num_workers} ({len(described.shards)} shard(s))",
        flush=True,
    )
    return dataclasses.replace(
        config,
        job=job,
        shard_addresses=described.shards,
        rank=described.rank,
        num_workers=described.num_workers,
        join="",
    )


def cmd_run(args: argparse.Namespace) -> int:
    from wavelet.scripts.run import run

    return run(config_from_args(RunConfig, args, job=job_from_args(args)))


def cmd_compare(args: argparse.Namespace) -> int:
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
            {"cuda_memory_gib": args.cuda_memory_gib, "slow_device": args.slow_device},
            plan,
            fork_server=args.fork_server,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print("\n".join(verdict(results, args.target_acc, plan)))
    print(format_table(results, args.target_acc, plan))
    plots = [p for p in ("accuracy.png", "memory.png") if (out / p).exists()]
    print(f"report: {out / 'report.md'}; plots: " + ", ".join(str(out / p) for p in plots))
    if any(r.interrupted for r in results):
        return INTERRUPTED
    return 0 if all(r.ok for r in results) else 1


def cmd_tune(args: argparse.Namespace) -> int:
    from wavelet.scripts.tune import (
        format_recommendation,
        format_table,
        parse_bounds,
        parse_policies,
        parse_seeds,
        parse_updates,
        settings_for,
        tune,
        with_references,
    )

    job = job_from_args(args)
    settings = settings_for(
        parse_bounds(args.bounds), parse_policies(args.policies), parse_updates(args.sweep_updates)
    )
    seeds = parse_seeds(args.seeds)
    for d in args.devices:
        check_device(d)
    out = Path(args.out) if args.out else new_run_dir("tune")
    results = tune(
        job, args.devices, with_references(settings), out, args.target_acc, args.fork_server, seeds
    )
    print(format_table(results, args.target_acc))
    print(format_recommendation(results))
    print(f"report: {out / 'report.md'}; plot: {out / 'accuracy.png'}")
    if any(r.interrupted for r in results):
        return INTERRUPTED
    return 0 if all(r.figures for r in results) else 1


def _shards_given(given: list[str]):
    """The shards' addresses as given, or those the run dir given in their place records (a
    ``wavelet launch`` job's shards listen on ports of the moment): (addresses, the run dir or
    None, the launcher's CURVE keys where that run dir has them)."""
    from wavelet.scripts.stats import run_dir_shards

    run_dir, keys, addresses = None, None, list(given)
    if len(given) == 1 and Path(given[0]).is_dir():
        run_dir = Path(given[0])
        addresses, keys = run_dir_shards(run_dir)
    else:
        for a in addresses:
            if "://" not in a:  # meant as a run dir
                raise ConfigError(f"{a}: no such directory, and not a shard address (tcp://...)")
    for a in addresses:
        check_address("shard address", a)
    return addresses, run_dir, keys


def cmd_stats(args: argparse.Namespace) -> int:
    from wavelet.scripts.stats import print_stats, watch

    addresses, _, run_keys = _shards_given(args.addresses)
    keys = client_keys_of(args) or run_keys
    if args.watch:
        return watch(addresses, args.watch, timeout_s=args.timeout, keys=keys)
    return print_stats(addresses, timeout_s=args.timeout, keys=keys)


def cmd_admin(args: argparse.Namespace) -> int:
    from wavelet.common.messages import AdminRequest
    from wavelet.common.protocol import Op, ShardError
    from wavelet.common.security import admin_token_file, load_admin_token
    from wavelet.worker.connection import call_shard

    addresses, given_dir, run_keys = _shards_given(args.addresses)
    if args.run_dir and args.token_file:
        raise ConfigError(
            "give the shards' admin token once: --run-dir RUN_DIR or --token-file FILE"
        )
    run_dir = args.run_dir or (None if args.token_file else given_dir)
    if not (run_dir or args.token_file):
        raise ConfigError(
            "give the shards' admin token: --run-dir RUN_DIR or --token-file FILE (or the run "
            "dir in place of the addresses)"
        )
    path = args.token_file or admin_token_file(run_dir)
    token = load_admin_token(path, create=False)
    keys = client_keys_of(args)
    if keys is None and run_dir and (Path(run_dir) / "keys").is_dir():
        from wavelet.common.security import JobKeys

        keys = JobKeys(Path(run_dir) / "keys").client("launcher")  # its admin key
    keys = keys or run_keys
    op = Op.CHECKPOINT if args.action == "checkpoint" else Op.SHUTDOWN
    failed = 0
    for a in addresses:
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


def cmd_clean(args: argparse.Namespace) -> int:
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


def cmd_keys(args: argparse.Namespace) -> int:
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


def client_keys_of(args: argparse.Namespace):
    from wavelet.common.security import ClientKeys

    if not args.curve_secret:
        return None
    return ClientKeys.load(args.curve_secret, args.curve_server_key)
