"""PS and all-reduce jobs under torchrun: one command for every process, roles from torchrun's
environment, shard addresses through torch.distributed's store; and the recipes that run it."""

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from conftest import CHILD_ENV, between_checkpoints, descendants, started, wait_for
from helpers import record_samples

from wavelet.common import shm
from wavelet.common.config import JobConfig
from wavelet.scripts.cli import build_parser
from wavelet.scripts.run import Layout, Role, _agreed_rules, layout_for

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TORCHRUN, *args],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def _assert_nothing_left(run_dir: Path) -> None:
    """No process of the job and no shared-memory segment of its run outlive it."""
    deadline = time.monotonic() + 15
    while any(str(run_dir).encode() in _cmdline(p) for p in _all_pids()):
        assert time.monotonic() < deadline, "processes of the job were left running"
        time.sleep(0.2)
    assert not list(shm.SHM_DIR.glob(shm.run_prefix(run_dir) + "*"))


def _all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def test_roles_follow_from_the_world():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    role = Role.from_env(env)
    layout = layout_for(role, 1)
    assert layout == Layout(shards_per_node=1, workers_per_node=2, nodes=2)
    assert layout.shards == 2 and layout.workers == 4
    assert layout.shard_index(role) is None and layout.worker_rank(role) == 3
    shard = Role.from_env({**env, "RANK": "3", "LOCAL_RANK": "0"})
    assert layout.shard_index(shard) == 1
    with pytest.raises(ValueError, match="leaves no worker"):
        layout_for(role, 3)


@pytest.mark.timeout(60)
def test_global_rank_0_decides_auto_updates_and_wire_for_every_node(monkeypatch):
    """A node whose own devices would decide otherwise still runs rank 0's rule: every shard of
    one job must apply the same one. A job over two nodes sends bf16, one over one node fp32."""
    import torch
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(30))
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(store.port)
    gpu_node = Role.from_env({**env, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    cpu_node = Role.from_env({**env, "RANK": "1", "LOCAL_RANK": "0", "GROUP_RANK": "1"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    decided = _agreed_rules(JobConfig(), gpu_node, store)
    assert (decided.updates, decided.wire_dtype, decided.wire) == ("async", "bf16", "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # alone, it would run turns
    decided = _agreed_rules(JobConfig(), cpu_node, store)
    assert (decided.updates, decided.wire_dtype) == ("async", "bf16")
    chosen = JobConfig(updates="wave-groups", wire_dtype="fp32")  # the user's are kept
    assert _agreed_rules(chosen, cpu_node, store) is chosen

    # one node: the tensors go through shared memory, in fp32
    one = {**env, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": str(store.port)}
    alone = Role.from_env({**one, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    alone = dataclasses.replace(alone, restart=1)  # a fresh set of keys in the same store
    assert _agreed_rules(JobConfig(), alone, store).wire_dtype == "fp32"


@pytest.mark.timeout(180)
def test_an_allreduce_job_under_torchrun_reports_like_launch(tmp_path):
    run_dir = tmp_path / "run"
    done = _torchrun(
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "wavelet.scripts.cli",
        "run",
        "--mode",
        "allreduce",
        "--epochs",
        "3",
        "--run-dir",
        str(run_dir),
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final test accuracy" in done.stdout and "samples/s" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "allreduce (torchrun)" and summary["test_accuracy"] > 0.5
    assert summary["samples"] == record_samples(run_dir) and "2 workers" in summary["throughput_of"]
    _assert_nothing_left(run_dir)


def _wavelet_args(command: list[str]) -> list[str]:
    """The wavelet part of a torchrun command line."""
    i = command.index("wavelet.scripts.cli")
    return command[i + 1 :]


def test_the_recipes_parse_and_match_the_cli():
    manifest = yaml.safe_load((ROOT / "examples" / "pytorchjob.yaml").read_text())
    assert manifest["kind"] == "PyTorchJob"
    container = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
        0
    ]
    commands = [container["command"]]
    script = (ROOT / "examples" / "slurm.sbatch").read_text().replace("\\\n", " ")
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0  # valid shell
    line = next(line for line in script.splitlines() if line.startswith("srun torchrun"))
    commands.append(shlex.split(line.replace('"$HEAD:29400"', "head:29400")))
    for command in commands:
        args = build_parser().parse_args(_wavelet_args(command))
        assert args.command == "run" and args.shards_per_node == 1
        assert (ROOT / args.config).exists()
    assert os.path.exists(ROOT / "configs" / "resnet18_synthetic.toml")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ps_job_under_torchrun_restarts_after_a_killed_shard_and_reaches_the_bar(tmp_path):
    """Two shards and two workers from one torchrun command (one job for both checks, because a
    launch costs more than its training here): a shard killed between checkpoints makes torchrun
    restart the group, which resumes from the checkpoints and ends above the accuracy bar."""
    run_dir = tmp_path / "run"
    cmd = [
        *TORCHRUN, "--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
        "-m", "wavelet.scripts.cli", "run", "--shards-per-node", "2",
        "--epochs", "20",  # room above the bar
        "--checkpoint-every", "60", "--run-dir", str(run_dir),
    ]  # fmt: skip
    with started(cmd, tmp_path / "torchrun.log", start_new_session=True) as proc:
        wait_for(lambda: between_checkpoints(run_dir), 120, "no updates after a checkpoint")
        shard = [
            p
            for p in descendants(proc.pid)
            if _environ(p).get("LOCAL_RANK") == "0" and b"wavelet" in _cmdline(p)
        ]
        assert len(shard) == 1
        os.kill(shard[0], signal.SIGKILL)
        assert proc.wait(240) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    out = (tmp_path / "torchrun.log").read_text()
    assert "final test accuracy" in out
    # the survivors stopped on torchrun's SIGTERM (none had to be killed after its 30 s wait)
    assert "Unable to shutdown process" not in out and "stopped before the end" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.97, summary
    assert summary["lost_updates"] > 0, summary
    assert set(summary["waves"]) == {"w0/0", "w0/1", "w1/0", "w1/1"}  # 2 workers x 2 waves
    # updates = auto on CPUs, decided once for all shards and workers: wave turns, none stale
    assert all(w["staleness_mean"] == 0 for w in summary["waves"].values()), summary["waves"]
    # job-wide: every worker's samples, from every worker's records
    assert summary["samples"] == record_samples(run_dir) and "2 workers" in summary["throughput_of"]
    _assert_nothing_left(run_dir)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_reduce_under_torchrun_restarts_from_its_checkpoint(tmp_path):
    """The all-reduce baseline of elastic membership: rank 0 checkpoints every second; a rank
    killed mid-run makes torchrun restart the group, which goes on from the checkpoint (not
    from the start) and finishes its budget."""
    run_dir = tmp_path / "run"
    cmd = [
        *TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "-m", "wavelet.scripts.cli", "run", "--mode", "allreduce", "--epochs", "30",
        "--checkpoint-every-s", "1", "--run-dir", str(run_dir),
    ]  # fmt: skip
    checkpoint = run_dir / "checkpoints" / "allreduce.pt"
    records = run_dir / "records" / "worker-0-wave-0.jsonl"
    with started(cmd, tmp_path / "torchrun.log", start_new_session=True) as proc:
        wait_for(lambda: checkpoint.exists(), 120, "no checkpoint")
        rank1 = [
            p
            for p in descendants(proc.pid)
            if _environ(p).get("RANK") == "1" and b"wavelet" in _cmdline(p)
        ]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        assert proc.wait(240) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    starts = [i for i, r in enumerate(rows) if r["kind"] == "start"]
    assert len(starts) == 2
    resumed_at = next(r["iter"] for r in rows[starts[1] :] if r["kind"] == "step")
    assert resumed_at > 0  # from the checkpoint, not from the start
    last = max(r["iter"] for r in rows if r["kind"] == "step")
    steps = next(r["steps_per_epoch"] for r in rows if r["kind"] == "start")
    assert last == 30 * steps - 1  # and to the end of its budget
    assert "all-reduce resumes from its checkpoint" in (tmp_path / "torchrun.log").read_text()
    _assert_nothing_left(run_dir)
