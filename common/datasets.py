"""Built-in datasets, and a user's own by import path (``package.module:function``).

A dataset factory takes ``seed`` and its keyword arguments and returns a ``Dataset`` of in-memory
tensors. Every process builds the same dataset and takes its own disjoint part of the training set
(``Dataset.part``), so no data moves over the network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from wavelet.common.imports import import_callable


@dataclass
class Dataset:
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

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

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
        self, batch_size: int, epoch: int, seed: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled full batches for one epoch (a last partial batch is dropped)."""
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(self.x), generator=g)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            x = self.x[idx]
            if self.max_shift:
                dx, dy = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=g)
                x = torch.roll(x, (int(dx), int(dy)), dims=(-2, -1))
            yield x, self.y[idx]

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.x) // batch_size


def digits(seed: int = 0, test_fraction: float = 0.2, max_shift: int = 1) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 real images, shipped with scikit-learn).

    Training batches are shifted by up to ``max_shift`` pixels (0 turns that off)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    # The test split is fixed (not drawn from the job's seed) so runs are comparable.
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=0, stratify=y
    )
    mean, std = x_tr.mean(), x_tr.std()

    def prep(a):
        return torch.tensor((a - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)

    return Dataset(prep(x_tr), torch.tensor(y_tr), prep(x_te), torch.tensor(y_te), 10, max_shift)


def synthetic(
    seed: int = 0,
    shape: tuple[int, ...] | list[int] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 2048,
    test_size: int = 256,
) -> Dataset:
    """Gaussian inputs of any shape, labelled by a fixed random linear teacher (so learnable)."""
    g = torch.Generator().manual_seed(1000 + seed)
    shape = tuple(int(s) for s in shape)
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
    g = torch.Generator().manual_seed(2000 + seed)
    shape = tuple(int(s) for s in shape)
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


BUILTIN_DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": digits,
    "synthetic": synthetic,
    "patterns": patterns,
}


def build_dataset(name: str, seed: int, **kwargs) -> Dataset:
    factory = BUILTIN_DATASETS.get(name) or import_callable(name, "dataset", BUILTIN_DATASETS)
    data = factory(seed=seed, **kwargs)
    if not isinstance(data, Dataset):
        raise TypeError(f"dataset factory {name!r} returned {type(data).__name__}, not Dataset")
    return data
