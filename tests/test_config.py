"""Configuration: TOML files, flag overrides, validation; bad values exit 2 with one line."""

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import run_wavelet

from wavelet.common.config import JobConfig
from wavelet.common.datasets import build_dataset
from wavelet.common.models import build_model
from wavelet.common.settings import INF, ConfigError, from_dict
from wavelet.scripts.cli import build_parser
from wavelet.scripts.cli import main as cli_main
from wavelet.scripts.flags import job_from_args


def _job(*argv):
    return job_from_args(build_parser().parse_args(["launch", *argv]))


def test_toml_then_flags_then_set(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text(
        textwrap.dedent("""
        model = "mlp"
        epochs = 3
        staleness = inf
        [optimizer]
        name = "adam"
        lr = 0.001
        kwargs = { betas = [0.8, 0.9] }
    """)
    )
    job = _job("--config", str(f), "--epochs", "5", "--set", "model_kwargs.hidden=64")
    assert (job.model, job.epochs, job.staleness) == ("mlp", 5, INF)
    assert job.optimizer.name == "adam" and job.optimizer.kwargs == {"betas": [0.8, 0.9]}
    assert job.model_kwargs == {"hidden": 64}
    assert _job("--staleness", "2").staleness == 2
    assert _job("--optimizer", "adamw").optimizer.effective_kwargs == {}
    assert _job().optimizer.effective_kwargs == {"momentum": 0.7}


@pytest.mark.parametrize(
    "data,words",
    [
        ({"staleness": 1.5}, "staleness"),
        ({"staleness": -1}, "staleness"),
        ({"batch_size": 0}, "batch_size"),
        ({"epochs": "ten"}, "epochs must be int"),
        ({"bogus": 1}, "unknown setting 'bogus'"),
        ({"batchsize": 1}, "unknown setting 'batchsize'; did you mean 'batch_size'"),
        ({"optimizer": {"name": "nosuch"}}, "not in torch.optim"),
        ({"optimizer": {"name": "LBFGS"}}, "needs a closure"),
        ({"find_unused_parameters": 1}, "must be one of auto, always, never, got 1"),
        ({"turn_patience": -1}, "turn_patience must be >= 0"),
        ({"balance_max_factor": 0.5}, "balance_max_factor = 0.5: .* give 1 or more"),
        ({"balance_max_factor": float("nan")}, "balance_max_factor must be a finite number"),
        ({"turn_patience": 2, "updates": "async"}, "is for wave turns and wave groups"),
        ({"optimizer": {"name": "sparseadam"}}, "takes sparse gradients"),
        ({"optimizer": {"name": "adam", "kwargs": {"momentum": 0.7}}}, "rejected its arguments"),
        ({"optimizer": {"lr": -1.0}}, "lr must be > 0"),
        ({"optimizer": {"kwargs": {"momentum": -0.5}}}, "Invalid momentum value"),
        ({"optimizer": {"name": "adam", "kwargs": {"betas": [1.5, 0.9]}}}, "Invalid beta"),
        ({"optimizer": {"kwargs": {"fused": True, "foreach": True}}}, "cannot be `True` together"),
        ({"epochs": 0, "max_seconds": 0}, "budget"),
    ],
)
def test_bad_values_name_the_problem(data, words):
    with pytest.raises(ConfigError, match=words):
        from_dict(JobConfig, data)


def test_every_supported_optimizer_passes_its_own_checks_without_loading_the_compiler():
    # the launcher and the workers check the optimizer but never step one: the check must not
    # import torch._dynamo, as building an optimizer does (about a second per process)
    code = (
        "import sys\n"
        "from wavelet.common.optimizer import (\n"
        "    OptimizerConfig, _OPTIMIZERS, UNSUPPORTED_OPTIMIZERS)\n"
        "for name in set(_OPTIMIZERS) - set(UNSUPPORTED_OPTIMIZERS):\n"
        "    OptimizerConfig(name=name, lr=0.01)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "--epochs", "-1"],
        ["launch", "--config", "configs/no-such-job.toml"],
        ["launch", "--staleness", "1.5"],
        ["launch", "--no-such-flag"],
        ["launch", "--devices", "tpu:0"],
        ["launch", "--model", "nosuch"],
        ["launch", "--batch-size", "5000"],
        ["launch", "--balance-max-factor", "0.5"],
        # a quorum the job's waves cannot meet (one worker of 2 waves; 4 waves expected)
        ["launch", "--updates", "k-of-n", "--sync-quorum", "3"],
        ["ps", "--updates", "k-of-n", "--sync-quorum", "5", "--expect-waves", "4"],
        ["ps", "--shard-index", "5"],
        ["ps", "--bind", "127.0.0.1:5555"],
        ["worker", "--shard", "tcp://127.0.0.1:1"],  # 1 address for the default 2 shards
        # non-finite numbers are refused up front, not blamed on the gradients later
        ["launch", "--lr", "inf"],
        ["launch", "--lr", "nan"],
        ["launch", "--max-seconds", "inf"],
        ["launch", "--set", "optimizer.kwargs.momentum=nan"],
        ["launch", "--set", "dataset_kwargs.noise=-inf"],
        # addresses, checked in one place for every command
        ["stats", "not-an-address"],
        ["stats", "tcp://127.0.0.1:abc"],
        ["worker", "--shard", "tcp://127.0.0.1:abc", "--shard", "tcp://127.0.0.1:1"],
        ["admin", "shutdown", "tcp://localhost", "--token-file", "x"],
        # sweep lists
        ["tune", "--bounds", "x"],
        ["tune", "--bounds", ""],
        ["tune", "--policies", ""],
        ["tune", "--policies", "apply,nosuch"],
        # numbers that are not numbers
        ["ps", "--max-parked", "many"],
        # modes to compare
        ["compare", "--modes", "tiktok"],
        ["compare", "--modes", ","],
        ["compare", "--memory-budget", "lots"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys, monkeypatch, tmp_path):
    # in this process, through the CLI's own main(): the same parser and checks as the command
    # (whose process the test below starts), without a torch import per case
    monkeypatch.setattr("sys.path", list(sys.path))
    monkeypatch.chdir(tmp_path)  # where a run dir would go: refused input makes none
    monkeypatch.setattr("signal.signal", lambda *a: None)  # leave pytest's handlers alone
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wavelet: error:"), stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [["launch", "--epochs", "-1"], ["ps", "--shard-index", "5"]])
def test_the_command_itself_says_bad_input_in_one_line_and_exits_2(argv):
    done = run_wavelet(*argv, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wavelet: error:"), done.stderr


def test_user_model_and_dataset_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        import torch
        from wavelet.common.datasets import Dataset

        def tiny(input_shape, num_classes, width=5):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, width),
                                       torch.nn.Linear(width, num_classes))

        def data(seed, n=40):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 2, 3, generator=g)
            return Dataset(x, (x.sum((1, 2)) > 0).long(), x[:8], (x[:8].sum((1, 2)) > 0).long(), 2)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = build_dataset("mymodels:data", seed=0, n=50)
    assert data.input_shape == (2, 3) and len(data.train_x) == 50
    model = build_model("mymodels:tiny", data.input_shape, 2, seed=0, width=7)
    assert model[1].out_features == 7
    with pytest.raises(ValueError, match="built-in"):
        build_model("nosuch", (4,), 2, seed=0)
    with pytest.raises(ValueError, match="cannot import"):
        build_model("nosuch_module_xyz:f", (4,), 2, seed=0)


def test_builtin_models_and_datasets():
    digits = build_dataset("digits", seed=0)
    assert digits.input_shape == (1, 8, 8) and len(digits.test_x) == 360
    cnn = build_model("digits_cnn", digits.input_shape, 10, seed=0)
    assert 200_000 < sum(p.numel() for p in cnn.parameters()) < 300_000
    resnet = build_model("resnet18", (3, 32, 32), 10, seed=0)
    assert 11_000_000 < sum(p.numel() for p in resnet.parameters()) < 11_300_000
    assert resnet(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    syn = build_dataset("synthetic", seed=0, shape=[5, 7], train_size=64, test_size=16)
    assert syn.train_x.shape == (64, 5, 7)
    parts = [digits.part(i, 3, seed=0) for i in range(3)]
    rows = {tuple(x.flatten().tolist()) for p in parts for x in p.x}
    assert len(rows) == sum(len(p.x) for p in parts), "wave data parts overlap"


def test_same_seed_same_weights_even_from_parallel_threads():
    import threading

    out = [None] * 4

    def build(i):
        out[i] = build_model("digits_cnn", (1, 8, 8), 10, seed=3).state_dict()

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    for sd in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0].values(), sd.values(), strict=True))


def test_a_daemons_command_line_carries_every_setting_it_was_given():
    """The launcher builds each child's flags from its config object: every field that has a
    flag survives the trip through argv, so a new setting cannot be forgotten on the way."""
    import dataclasses

    from wavelet.common.daemon_config import PSConfig, WorkerConfig
    from wavelet.common.settings import command_line
    from wavelet.scripts.flags import config_from_args

    job = JobConfig(shards=2)
    ps = PSConfig(
        job=job,
        shard_index=1,
        bind="tcp://127.0.0.1:5000",
        expect_waves=4,
        ready_file="r",
        run_dir="d",
        max_parked=7,
        max_waves=9,
        checkpoint_every=3,
        checkpoint_every_s=1.5,
        insecure=True,
        shm=False,
        metrics_port=0,
        metrics_host="127.0.0.2",
        admin_token_file="t",
    )
    worker = WorkerConfig(
        job=job,
        shard_addresses=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
        rank=1,
        num_workers=2,
        threads=1,
        core_budget=2,
        run_dir="d",
        schedule="together",
        transport="tcp",
        device_index=3,
        resume=True,
        cuda_memory_gib=0.5,
        metrics_port=0,
    )
    parser = build_parser()
    for config, command in ((ps, "ps"), (worker, "worker")):
        args = parser.parse_args([command, "--shards", "2", *command_line(config)])
        back = config_from_args(type(config), args, job=job)
        for f in dataclasses.fields(config):
            assert getattr(back, f.name) == getattr(config, f.name), f.name
