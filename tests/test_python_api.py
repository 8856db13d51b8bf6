"""``import wavelet``: JobConfig, launch and compare from Python, with the job's parts given as
functions (turned into import paths, since every worker is another process that imports them)."""

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import wavelet
from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model
from wavelet.common.models import build_model
from wavelet.worker.evaluate import evaluate

PARTS = """
import itertools

import torch.nn.functional as F

from wavelet.common.models import build_model


def small_mlp(input_shape, num_classes, hidden=32):
    return build_model("mlp", input_shape, num_classes, 0, hidden=hidden)


def smooth_step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, label_smoothing=0.05)


def no_loss(model, batch):
    x, _ = batch
    return model(x)  # a batch of outputs, not a scalar loss


_calls = itertools.count()  # of this process: the launcher's check is its first call


def fails_in_training(model, batch):
    if next(_calls) > 0:
        raise RuntimeError("this step fails once training starts")
    return smooth_step(model, batch)
"""


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A user's module of job parts, importable here and by the processes launch starts there."""
    (tmp_path / "myparts.py").write_text(PARTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("myparts")
    sys.modules.pop("myparts", None)


def test_the_package_is_the_api():
    assert wavelet.JobConfig is JobConfig
    assert callable(wavelet.launch) and callable(wavelet.compare)
    assert callable(wavelet.load_model)
    assert issubclass(wavelet.ConfigError, ValueError)


def test_functions_become_import_paths():
    job = wavelet.JobConfig(model=build_model)
    assert job.model == "wavelet.common.models:build_model"


def _nested():
    def factory(input_shape, num_classes, seed):
        return build_model("mlp", input_shape, num_classes, seed)

    return factory


@pytest.mark.parametrize(
    "part,why",
    [
        (lambda shape, classes, seed: None, "lambda"),
        (_nested(), "nested function"),
        (JobConfig.__post_init__, "method"),
        (42, "a name, an import path or a function"),
    ],
)
def test_a_part_no_other_process_can_import_is_refused_at_once(part, why):
    with pytest.raises(wavelet.ConfigError, match=why):
        wavelet.JobConfig(model=part)


def test_a_function_of_a_script_run_by_path_is_refused_with_what_to_do(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import wavelet\n"
        "def factory(input_shape, num_classes, seed):\n    pass\n"
        "try:\n    wavelet.JobConfig(model=factory)\n"
        "except wavelet.ConfigError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "__main__" in done.stdout and "move it into a module" in done.stdout, done.stderr


@pytest.mark.timeout(200)
def test_launch_from_python_trains_with_the_users_functions_and_returns_the_summary(parts):
    job = wavelet.JobConfig(
        model=parts.small_mlp, step=parts.smooth_step, model_kwargs={"hidden": 48}, epochs=3
    )
    summary = wavelet.launch(job, run_dir="run", quiet=True)
    assert summary["test_accuracy"] > 0.3  # 3x chance after 3 epochs: it learned
    saved = json.loads(open("run/job.json").read())
    assert (saved["model"], saved["step"]) == ("myparts:small_mlp", "myparts:smooth_step")
    _the_trained_model_scores_what_the_summary_says("run", summary)


@pytest.mark.timeout(200)
def test_all_reduce_leaves_its_trained_model_too(parts):
    job = wavelet.JobConfig(model=parts.small_mlp, epochs=2)
    summary = wavelet.launch(job, run_dir="run", mode="allreduce", quiet=True)
    _the_trained_model_scores_what_the_summary_says("run", summary)


def _the_trained_model_scores_what_the_summary_says(run_dir, summary):
    """``wavelet.load_model`` rebuilds the job's model from job.json with the run's weights
    (model.pt, a plain state_dict), and it scores the summary's final accuracy."""
    assert summary["model"] == f"{run_dir}/model.pt"
    model = wavelet.load_model(run_dir)
    assert not model.training
    dataset, _ = build_dataset_and_model(JobConfig())
    assert evaluate(model, dataset, torch.device("cpu"))["accuracy"] == summary["test_accuracy"]
    state = torch.load(summary["model"], weights_only=True)
    assert state.keys() == model.state_dict().keys()


@pytest.mark.timeout(200)
def test_a_job_that_fails_raises_job_failed_with_its_run_dir(parts):
    job = wavelet.JobConfig(model="mlp", step=parts.fails_in_training, epochs=1)
    with pytest.raises(wavelet.JobFailed) as failed:
        wavelet.launch(job, run_dir="bad", quiet=True)
    assert failed.value.exit_code == 1 and failed.value.run_dir == "bad"
    # a step that returns no loss is refused before anything starts
    no_loss = dataclasses.replace(job, step=parts.no_loss)
    with pytest.raises(wavelet.ConfigError, match="not a scalar loss"):
        wavelet.launch(no_loss, run_dir="refused", quiet=True)
    with pytest.raises(wavelet.ConfigError, match="unknown launch setting 'device'"):
        wavelet.launch(job, device="cpu")


@pytest.mark.timeout(300)
def test_compare_from_python_returns_each_modes_figures(parts, capfd):
    job = wavelet.JobConfig(model=parts.small_mlp, epochs=1)
    with pytest.raises(wavelet.ConfigError, match="unknown mode 'tiktok'"):
        wavelet.compare(job, ["ticktock", "tiktok"])
    assert not os.path.exists("runs")  # refused before any run dir was made
    capfd.readouterr()
    figures = wavelet.compare(job, ["ticktock", "allreduce"], out="side", target=0.3, quiet=True)
    assert capfd.readouterr().out == ""  # as launch(quiet=True): no line per mode
    assert list(figures) == ["ticktock", "allreduce"]
    for mode, got in figures.items():
        assert got["run_dir"] == f"side/{mode}" and got["samples_per_s"] > 0, got
        assert 0 <= got["final_score"] <= 1 and got["score_curve"], got
        assert "memory_traces" not in got and "batch" not in got  # no budget chose a batch
    assert os.path.exists("side/report.md")
    json.dumps(figures)  # plain data


def test_the_flat_api_reads_like_the_command_line_and_fails_in_one_line():
    import wavelet

    job = wavelet.JobConfig(lr=0.05, optimizer="adamw", waves=2, staleness=1)
    assert (job.optimizer.name, job.optimizer.lr, job.waves) == ("adamw", 0.05, 2)
    job = wavelet.JobConfig(optimizer={"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}})
    assert job.optimizer.effective_kwargs["momentum"] == 0.9
    for kwargs, says in (
        ({"epoch": 3}, "did you mean 'epochs'?"),
        ({"momentum": 0.9}, "optimizer.kwargs.momentum"),
        ({"optimizer": {"lr": -1}}, "optimizer.lr must be > 0"),
        ({"optimizer": "lbfgs"}, "cannot call"),
        ({"optimizer": 3}, "optimizer must be a name"),
    ):
        with pytest.raises(wavelet.ConfigError, match=re.escape(says)):
            wavelet.JobConfig(**kwargs)


def test_wavelet_exports_exactly_its_public_names_each_with_an_example():
    import wavelet
    from wavelet.scripts import api

    # the package names the API's exports itself (it imports the API lazily): the same list
    assert dir(wavelet) == sorted(wavelet.__all__) == sorted(api.__all__)
    assert "importlib" not in dir(wavelet) and "annotations" not in dir(wavelet)
    for name in wavelet.__all__:
        doc = getattr(wavelet, name).__doc__ or ""
        assert "::" in doc or ">>>" in doc, f"wavelet.{name} has no example in its docstring"
