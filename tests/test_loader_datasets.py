"""A dataset factory may return a (train, test) pair of map-style torch Datasets: each wave reads
its part through a DataLoader (workers, a collate_fn by import path), the parts of an epoch are
disjoint and reshuffled every epoch, and a dataset that reads every sample from a file trains."""

import json
from pathlib import Path

import pytest
import torch
import torch.utils.data as tud
from conftest import ONE_SHARD, run_wavelet

from wavelet.common.datasets import (
    DataError,
    DataPart,
    LoaderDataset,
    LoaderSettings,
    SizedBatches,
    build_dataset,
)

FILES = '''
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class Files(Dataset):
    """One .npy file per sample, its class in its name: nothing is held in memory."""

    classes = ["a", "b", "c", "d"]

    def __init__(self, root):
        self.paths = sorted(Path(root).glob("*.npy"))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        path = self.paths[i]
        return torch.from_numpy(np.load(path)), int(path.stem.split("_")[1])


def write(root, n, seed):
    """n samples: each class a fixed 8x8 pattern under noise."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32)
    Path(root).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        c = i % 4
        x = patterns[c] + 0.5 * rng.normal(size=(1, 8, 8)).astype(np.float32)
        np.save(Path(root) / f"{i:05d}_{c}.npy", x)


def files(seed, root):
    return Files(Path(root) / "train"), Files(Path(root) / "test")


def stack(samples):
    """A user's collate_fn: the default's, spelled out."""
    xs, ys = zip(*samples)
    return torch.stack(xs), torch.tensor(ys)


def not_a_dataset(seed):
    return [1, 2, 3]


def broken_collate(samples):
    raise KeyError("label")


class DiesInWorker(Files):
    """Kills the loader worker process that reads it (as the OOM killer would)."""

    def __getitem__(self, i):
        import os
        import signal

        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def dying(seed, root):
    return DiesInWorker(Path(root) / "train"), Files(Path(root) / "test")
'''


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    (tmp_path / "mydata.py").write_text(FILES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mydata = importlib.import_module("mydata")
    mydata.write(tmp_path / "data" / "train", 512, seed=1)
    mydata.write(tmp_path / "data" / "test", 128, seed=2)
    yield tmp_path
    import sys

    sys.modules.pop("mydata", None)


class Numbers(tud.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


def test_the_parts_of_an_epoch_are_disjoint_and_every_epoch_reshuffles():
    data = LoaderDataset(Numbers(103), Numbers(10))
    parts = [data.part(i, 3, seed=5) for i in range(3)]
    assert [len(p) for p in parts] == [34, 34, 34]  # the remainder is dropped
    epochs = []
    for epoch in range(2):
        seen = [torch.cat([y for _, y in p.batches(17, epoch, seed=99)]) for p in parts]
        everything = torch.cat(seen)
        assert len(set(everything.tolist())) == len(everything) == 102  # disjoint
        epochs.append(seen[0].tolist())
    assert epochs[0] != epochs[1]  # part 0 read other samples in epoch 1


def test_a_factory_of_something_else_is_refused_with_what_to_return(project):
    with pytest.raises(TypeError, match=r"\(train, test\) pair of torch.utils.data.Dataset"):
        build_dataset("mydata:not_a_dataset", seed=0)


def test_samples_from_files_with_a_collate_fn(project):
    settings = LoaderSettings(workers=0, collate_fn="mydata:stack")
    data = build_dataset("mydata:files", 0, settings, root=str(project / "data"))
    assert (data.input_shape, data.num_classes, data.num_train) == ((1, 8, 8), 4, 512)
    x, y = data.sample_batch(600)  # beyond the data: repeated
    assert x.shape == (600, 1, 8, 8) and y.dtype == torch.int64


@pytest.mark.timeout(240)
def test_a_dataset_read_from_files_through_loader_workers_trains(project):
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--dataset", "mydata:files", "--set", f"dataset_kwargs.root={project / 'data'}",
        "--model", "mlp", "--set", "loader_workers=1", "--collate-fn", "mydata:stack",
        "--epochs", "3", "--threads", "1", "--run-dir", "run", timeout=220, cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5  # 2x chance on 4 classes: it learned
    # 2 waves of 256 samples each per epoch, 32 a batch, 3 epochs
    assert summary["samples"] == 3 * 2 * 8 * 32


def test_a_failing_collate_fn_is_one_error_naming_it(project):
    settings = LoaderSettings(collate_fn="mydata:broken_collate")
    data = build_dataset("mydata:files", 0, settings, root=str(project / "data"))
    with pytest.raises(DataError, match=r"collate_fn mydata:broken_collate: KeyError: 'label'"):
        next(iter(data.part(0, 2, seed=0).batches(8, 0, seed=0)))


def test_a_loader_worker_that_dies_is_one_error_saying_so(project):
    data = build_dataset("mydata:dying", 0, LoaderSettings(workers=1), root=str(project / "data"))
    with pytest.raises(DataError, match=r"a DataLoader worker process died .*loader_workers=0"):
        next(iter(data.part(0, 2, seed=0).batches(8, 0, seed=0)))


@pytest.mark.timeout(200)
def test_a_dying_loader_worker_stops_the_job_with_one_line(project):
    done = run_wavelet(
        "launch", *ONE_SHARD,
        "--dataset", "mydata:dying", "--set", f"dataset_kwargs.root={project / 'data'}",
        "--model", "mlp", "--set", "loader_workers=1", "--epochs", "1", "--threads", "1",
        "--run-dir", "run", timeout=180, cwd=project,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    died = [line for line in done.stderr.splitlines() if "DataLoader worker process died" in line]
    assert len(died) >= 1, done.stderr[-3000:]


def test_balanced_batches_take_the_sizes_asked_and_drop_a_last_partial_one():
    """In memory and through a DataLoader's batch sampler alike (ps/balance.py asks the sizes)."""
    part = DataPart(torch.arange(10.0).reshape(10, 1), torch.arange(10))
    asks = iter([3, 4, 5])
    assert [len(y) for _, y in part.batches(2, 0, 0, sizes=lambda: next(asks))] == [3, 4]
    asks = iter([3, 4, 5])
    sampler = tud.SequentialSampler(range(10))
    assert list(SizedBatches(sampler, lambda: next(asks))) == [[0, 1, 2], [3, 4, 5, 6]]
    assert [len(y) for _, y in part.batches(4, 0, 0)] == [4, 4]  # the job's batch otherwise
