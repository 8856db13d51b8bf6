"""Built-in datasets, and a user's own by import path (``package.module:function``).

A dataset factory takes ``seed`` and its keyword arguments and returns either a ``Dataset`` of
in-memory tensors (the fast path) or a pair ``(train, test)`` of map-style
``torch.utils.data.Dataset`` objects, read through a ``DataLoader`` per wave (``LoaderDataset``:
any size, from disk, with loader workers). Every process builds the same dataset and takes its
own disjoint part of the training set (``part``), so no data moves over the network.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from wavelet.common.imports import import_callable


@dataclass
class Dataset:
    """A dataset held in memory as tensors (the fast path): what a dataset factory
    ``function(seed, **dataset_kwargs)`` may return::

        def blobs(seed, n=512):
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
            return wavelet.Dataset(x[:448], y[:448], x[448:], y[448:], num_classes=3)
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    max_shift: int = 0  # training batches are shifted by up to this many pixels (augmentation)

    def __post_init__(self) -> None:
        if len(self.train_x) != len(self.train_y) or len(self.test_x) != len(self.test_y):
            raise ValueError("dataset inputs and labels differ in length")
        if len(self.train_x) == 0:
            raise ValueError("dataset has no training samples")
        if len(self.test_x) == 0:
            raise ValueError("dataset has no test samples: the job could not be scored")
        at_least("max_shift", self.max_shift, 0)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.train_x)

    def sample_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``size`` training samples, repeated when there are fewer (probes that
        only need a batch's shape and real labels)."""
        idx = torch.arange(size) % len(self.train_x)
        return self.train_x[idx].clone(), self.train_y[idx].clone()

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.test_x), batch_size):
            yield self.test_x[start : start + batch_size], self.test_y[start : start + batch_size]

    def part(self, index: int, count: int, seed: int) -> DataPart:
        """Training part ``index`` of ``count`` equal, disjoint parts (a remainder is dropped so
        every wave runs the same number of steps per epoch)."""
        size = len(self.train_x) // count
        if size == 0:
            raise ValueError(f"{len(self.train_x)} training samples cannot feed {count} waves")
        order = torch.randperm(len(self.train_x), generator=torch.Generator().manual_seed(seed))
        idx = order[index * size : (index + 1) * size]
        return DataPart(self.train_x[idx], self.train_y[idx], self.max_shift)


@dataclass
class DataPart:
    x: torch.Tensor
    y: torch.Tensor
    max_shift: int = 0

    def batches(
        self, batch_size: int, epoch: int, seed: int, sizes: Callable[[], int] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled full batches for one epoch (a last partial batch is dropped); with
        ``sizes``, each batch takes as many samples as ``sizes()`` says just before it (balanced
        batches, ``ps/balance.py``)."""
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(self.x), generator=g)
        for idx in sized_runs(order, sizes or (lambda: batch_size)):
            x = self.x[idx]
            if self.max_shift:
                dx, dy = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=g)
                x = torch.roll(x, (int(dx), int(dy)), dims=(-2, -1))
            yield x, self.y[idx]

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.x) // batch_size

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class LoaderSettings:
    """How a wave's ``DataLoader`` reads a ``torch.utils.data.Dataset`` (the job's ``loader_*``
    settings); pinned memory follows the device."""

    workers: int = 0
    collate_fn: str = ""  # package.module:function, or the DataLoader's default
    pin_memory: bool = False

    def collate(self) -> Callable | None:
        return import_callable(self.collate_fn, "collate_fn", {}) if self.collate_fn else None


@dataclass
class LoaderDataset:
    """A user's map-style ``(train, test)`` datasets behind the in-memory ``Dataset``'s
    interface. ``num_classes``: the train set's ``num_classes`` or ``len(classes)`` attribute (as
    torchvision's have), else 0 (unknown: a factory that needs it must be given it)."""

    train: tud.Dataset
    test: tud.Dataset
    loader: LoaderSettings = field(default_factory=LoaderSettings)

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            d = getattr(self, name)
            try:
                len(d)
            except TypeError:
                raise TypeError(
                    f"the {name} dataset {type(d).__name__} has no len(): Wavelet reads "
                    "map-style datasets (with __len__ and __getitem__)"
                ) from None
        if len(self.train) == 0:
            raise ValueError("dataset has no training samples")
        first = self.train[0]
        if not (isinstance(first, tuple | list) and len(first) == 2):
            raise TypeError(
                f"the train dataset's samples are {type(first).__name__}, not (input, target) pairs"
            )
        self.input_shape = tuple(torch.as_tensor(first[0]).shape)
        classes = getattr(self.train, "num_classes", None)
        if classes is None:
            classes = len(getattr(self.train, "classes", ()))
        self.num_classes = int(classes)

    @property
    def num_train(self) -> int:
        return len(self.train)

    def part(self, index: int, count: int, seed: int) -> LoaderPart:
        if len(self.train) // count == 0:
            raise ValueError(f"{len(self.train)} training samples cannot feed {count} waves")
        return LoaderPart(self.train, index, count, seed, self.loader)

    def sample_batch(self, size: int) -> Any:
        """The first ``size`` training samples (repeated where there are fewer), collated as
        the waves' batches are: ``(inputs, targets)``, or what the job's collate_fn makes."""
        indices = [i % len(self.train) for i in range(size)]
        return self._collate()([self.train[i] for i in indices])

    def test_batches(self, batch_size: int) -> Iterator[Any]:
        yield from read_batches(self._loader(self.test, batch_size), self.loader)

    def _collate(self) -> Callable:
        return self.loader.collate() or tud.default_collate

    def _loader(self, data: tud.Dataset, batch_size: int, **kw) -> tud.DataLoader:
        return tud.DataLoader(
            data,
            batch_size=batch_size,
            num_workers=self.loader.workers,
            pin_memory=self.loader.pin_memory,
            collate_fn=self.loader.collate(),
            **kw,
        )


class LoaderPart:
    """One wave's part of a map-style training set: as ``DistributedSampler`` does, every epoch
    reshuffles the whole set with the job's seed and part ``index`` of ``count`` takes every
    ``count``-th sample of it, so the parts of one epoch are disjoint and all the same size."""

    def __init__(
        self, data: tud.Dataset, index: int, count: int, seed: int, loader: LoaderSettings
    ):
        self.sampler = tud.DistributedSampler(
            data, num_replicas=count, rank=index, shuffle=True, seed=seed, drop_last=True
        )
        self.data, self.settings = data, loader
        self._loaders: dict[int, tud.DataLoader] = {}

    def __len__(self) -> int:
        return len(self.sampler)

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.sampler) // batch_size

    def batches(
        self, batch_size: int, epoch: int, seed: int, sizes: Callable[[], int] | None = None
    ) -> Iterator[Any]:
        """Full batches of this epoch's part (``seed``, the wave's own, is not needed: the
        sampler's order is the job's, so that parts stay disjoint); with ``sizes``, of as many
        samples as it says (asked as the loader takes its next batch's indices: with loader
        workers, a few batches ahead)."""
        key = -1 if sizes is not None else batch_size
        loader = self._loaders.get(key)
        if loader is None:
            workers = self.settings.workers
            batching = (
                {"batch_sampler": SizedBatches(self.sampler, sizes)}
                if sizes is not None
                else {"batch_size": batch_size, "sampler": self.sampler, "drop_last": True}
            )
            loader = tud.DataLoader(
                self.data,
                **batching,
                num_workers=workers,
                pin_memory=self.settings.pin_memory,
                collate_fn=self.settings.collate(),
                persistent_workers=workers > 0,
            )
            self._loaders[key] = loader
        self.sampler.set_epoch(epoch)
        yield from read_batches(loader, self.settings)


class SizedBatches:
    """A ``DataLoader``'s batch sampler whose batches take ``sizes()`` indices each, in the
    sampler's order (the last partial one dropped)."""

    def __init__(self, sampler: tud.Sampler, sizes: Callable[[], int]):
        self.sampler, self.sizes = sampler, sizes

    def __iter__(self) -> Iterator[list[int]]:
        return sized_runs(list(self.sampler), self.sizes)


def sized_runs(order: Sequence, sizes: Callable[[], int]) -> Iterator:
    """Consecutive runs of ``order``, each as long as ``sizes()`` says just before it is cut; a
    last run that would not be full is dropped."""
    start = 0
    while start + (size := sizes()) <= len(order):
        yield order[start : start + size]
        start += size


class DataError(ValueError):
    """Reading a batch of a user's dataset failed: which part of the pipeline, and why."""


def read_batches(loader: tud.DataLoader, settings: LoaderSettings) -> Iterator[Any]:
    """``loader``'s batches; a failure (the dataset's ``__getitem__``, the collate_fn, a loader
    worker that died) becomes one ``DataError`` naming the pipeline and the cause."""
    batches = iter(loader)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(_read_failure(e, settings)) from e
        yield batch


def _read_failure(e: Exception, settings: LoaderSettings) -> str:
    where = (
        f"collate_fn {settings.collate_fn}"
        if settings.collate_fn
        else "the dataset's __getitem__ or the default collate"
    )
    cause = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    if settings.workers and "exited unexpectedly" in cause:
        # torch's words for a worker process that died (killed, out of memory, a crash in C)
        return (
            f"a DataLoader worker process died while reading a batch ({cause}); it runs {where}: "
            "check its memory use (the kernel's OOM killer) and native code, or set "
            "loader_workers=0 to see the error in this process"
        )
    workers = f", {settings.workers} loader worker(s)" if settings.workers else ""
    return f"reading a batch failed in {where}{workers}: {type(e).__name__}: {cause}"


def digits(seed: int = 0, test_fraction: float = 0.2, max_shift: int = 1) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 real images, shipped with scikit-learn).

    Training batches are shifted by up to ``max_shift`` pixels (0 turns that off)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"dataset_kwargs.test_fraction must be in (0, 1), got {test_fraction}")
    x_tr, y_tr, x_te, y_te = _digits_split(test_fraction)
    mean, std = x_tr.mean(), x_tr.std()

    def prep(a):
        return torch.tensor((a - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)

    return Dataset(prep(x_tr), torch.tensor(y_tr), prep(x_te), torch.tensor(y_te), 10, max_shift)


def _digits_split(test_fraction: float) -> list[np.ndarray]:
    """The digits split into train and test, the same split every time (not drawn from the
    job's seed, so runs are comparable), kept in the user's cache: importing scikit-learn (and
    the SciPy it pulls in) cost every process that builds the dataset about a second."""
    version = importlib.metadata.version("scikit-learn")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wavelet"
    path = cache / f"digits-sklearn{version}-test{test_fraction}.npz"
    try:
        with np.load(path) as saved:
            return [saved[k] for k in ("x_tr", "y_tr", "x_te", "y_te")]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # none yet, or bad
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    parts = train_test_split(x, y, test_size=test_fraction, random_state=0, stratify=y)
    x_tr, x_te, y_tr, y_te = parts
    try:  # written whole, then renamed: a process reading it meanwhile never sees half
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".npz", delete=False) as f:
            try:
                np.savez(f, x_tr=x_tr, y_tr=y_tr, x_te=x_te, y_te=y_te)
            except OSError:  # a full disk: leave no half-written file behind
                os.unlink(f.name)
                raise
        os.replace(f.name, path)
    except OSError:  # a read-only home or a full disk: no cache, just slower starts
        pass
    return [x_tr, y_tr, x_te, y_te]


def synthetic(
    seed: int = 0,
    shape: tuple[int, ...] | list[int] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 2048,
    test_size: int = 256,
) -> Dataset:
    """Gaussian inputs of any shape, labelled by a fixed random linear teacher (so learnable)."""
    shape = _checked_sizes(shape, num_classes, train_size, test_size)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(train_size + test_size, *shape, generator=g)
    teacher = torch.randn(x[0].numel(), num_classes, generator=g)
    y = (x.reshape(len(x), -1) @ teacher).argmax(1)
    return Dataset(x[:train_size], y[:train_size], x[train_size:], y[train_size:], num_classes)


def patterns(
    seed: int = 0,
    shape: tuple[int, ...] | list[int] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 4096,
    test_size: int = 512,
    noise: float = 10.0,
    max_shift: int = 2,
) -> Dataset:
    """Images a CNN learns in seconds: each class is a smooth random pattern (a 4x4 grid of
    colours, upsampled), each sample its class's pattern at a random contrast under Gaussian
    noise; training batches are shifted by up to ``max_shift`` pixels. At the default noise a
    narrow ResNet-18 (width 16) climbs to about 80% test accuracy in a minute on one CPU core,
    so time to accuracy is measurable, and its activations dominate its memory."""
    shape = _checked_sizes(shape, num_classes, train_size, test_size)
    if len(shape) != 3:
        raise ValueError(f"dataset_kwargs.shape must be [channels, height, width], got {shape}")
    at_least("noise", noise, 0)
    g = torch.Generator().manual_seed(2000 + seed)
    channels, size = shape[0], shape[1:]
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=size, mode="bilinear")
    n = train_size + test_size
    y = torch.randint(0, num_classes, (n,), generator=g)
    contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
    x = templates[y] * contrast + noise * torch.randn(n, *shape, generator=g)
    return Dataset(
        x[:train_size], y[:train_size], x[train_size:], y[train_size:], num_classes, max_shift
    )


def at_least(name: str, value: float, low: float) -> None:
    """ValueError naming ``dataset_kwargs.<name>`` unless ``value >= low``."""
    if not value >= low:
        raise ValueError(f"dataset_kwargs.{name} must be >= {low}, got {value}")


def _checked_sizes(shape, num_classes: int, train_size: int, test_size: int) -> tuple[int, ...]:
    """A built-in dataset's shape as a tuple, every size checked."""
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"dataset_kwargs.shape must be sizes >= 1, got {list(shape)}")
    at_least("num_classes", num_classes, 2)
    at_least("train_size", train_size, 1)
    at_least("test_size", test_size, 1)
    return shape


BUILTIN_DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": digits,
    "synthetic": synthetic,
    "patterns": patterns,
}


def build_dataset(
    name: str, seed: int, loader: LoaderSettings | None = None, **kwargs
) -> Dataset | LoaderDataset:
    factory = BUILTIN_DATASETS.get(name) or import_callable(name, "dataset", BUILTIN_DATASETS)
    data = factory(seed=seed, **kwargs)
    if isinstance(data, Dataset):
        return data
    if (
        isinstance(data, tuple | list)
        and len(data) == 2
        and all(isinstance(d, tud.Dataset) for d in data)
    ):
        return LoaderDataset(data[0], data[1], loader or LoaderSettings())
    raise TypeError(
        f"dataset factory {name!r} returned {type(data).__name__}: return a "
        "wavelet.common.datasets.Dataset, or a (train, test) pair of torch.utils.data.Dataset"
    )
