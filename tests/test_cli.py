"""The command line as a new user meets it: failures are one line, help is complete."""

import argparse
import dataclasses
import socket
from collections import Counter

import msgpack
import pytest
import torch
import zmq
from conftest import run_wavelet
from helpers import free_port

from wavelet.common.config import JobConfig
from wavelet.common.daemon_config import LaunchConfig, PSConfig, WorkerConfig
from wavelet.scripts.cli import build_parser


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cpu,cuda:1"])
def test_cuda_devices_are_checked_before_anything_starts(tmp_path, device):
    done = run_wavelet("launch", "--devices", device, "--run-dir", str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "no usable CUDA device" in done.stderr
    assert not (tmp_path / "logs").exists(), "daemons were started"


def test_a_port_in_use_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_wavelet("ps", "--bind", f"tcp://127.0.0.1:{port}", timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"tcp://127.0.0.1:{port}" in lines[0] and "in use" in lines[0]


@pytest.mark.timeout(90)
def test_a_worker_without_shards_says_so_in_one_line_and_waits_once():
    # shard 0 is a socket that takes requests and never answers (it counts them); nothing at
    # all listens at shard 1's address
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    shards = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}"]
    timeout_s = 10
    try:
        done = run_wavelet(
            "--log-level",
            "WARNING",
            "worker",
            "--shard",
            shards[0],
            "--shard",
            shards[1],
            "--threads",
            "1",
            "--set",
            f"request_timeout_s={timeout_s}",
            timeout=80,
        )
        ops = Counter()
        while silent.poll(0):
            frames = silent.recv_multipart()
            ops[msgpack.unpackb(frames[1])["op"]] += 1
    finally:
        silent.close()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("wavelet worker: wave w0/0, w0/1 failed")
    assert all(s in lines[0] for s in shards), lines[0]
    # one request per wave, waited for once: no retry, and no second wait to leave the shards
    assert ops["register"] == 2 and ops["leave"] == 0, ops
    assert set(ops) <= {"register", "heartbeat"}, ops


@pytest.mark.timeout(120)
def test_a_model_module_in_the_working_directory_imports(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch.nn as nn\n\n"
        "def make(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n"
    )
    done = run_wavelet(
        "launch",
        "--model",
        "mymodel:make",
        "--epochs",
        "1",
        "--run-dir",
        "run",
        timeout=110,
        cwd=tmp_path,
        by_hand=True,  # a new Python in that directory, as the user's
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "final test accuracy" in done.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_flag_of_every_command_says_what_it_does_and_its_choices():
    commands = _subparsers(build_parser())
    assert {"launch", "ps", "worker", "compare", "tune", "stats", "admin", "keys"} <= set(commands)
    for name, sub in commands.items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), (name, action.option_strings)
            assert "\n" not in action.help
            for choice in action.choices or ():
                assert str(choice) in text, (name, action.dest, choice)
    # the help comes from the config dataclasses' metadata: one source
    launch = commands["launch"].format_help()
    for cls in (JobConfig, LaunchConfig):
        for field in dataclasses.fields(cls):
            if field.metadata.get("flag") == "":
                continue
            assert field.metadata["help"][:30].split()[0] in launch, field.name
            for choice in field.metadata["choices"]:
                assert str(choice) in launch
    for cls, command in ((PSConfig, "ps"), (WorkerConfig, "worker")):
        text = commands[command].format_help()
        for field in dataclasses.fields(cls):
            if field.metadata.get("flag") != "":
                flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
                assert flag in text, (command, flag)
