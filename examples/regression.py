"""A regression trained by Wavelet: a user's own dataset, model, step and evaluation.

Targets are a smooth nonlinear function of 8 features plus noise; the step is mean squared
error and the evaluation reports R^2 (1 is perfect, 0 predicts the mean), the headline to
maximise. From the repository's root:

    wavelet launch --dataset examples.regression:dataset --model examples.regression:model \\
        --step examples.regression:mse_step --evaluate examples.regression:r_squared \\
        --target-metric r2 --optimizer adam --lr 0.003 --epochs 8
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wavelet.common.datasets import Dataset


def dataset(seed: int = 0, features: int = 8, train_size: int = 4096, test_size: int = 1024):
    g = torch.Generator().manual_seed(3000 + seed)
    x = torch.randn(train_size + test_size, features, generator=g)
    w = torch.randn(features, generator=g)
    y = torch.sin(x @ w / features**0.5) + 0.3 * (x[:, 0] * x[:, 1])
    y = (y + 0.05 * torch.randn(len(x), generator=g)).unsqueeze(1)
    # one output: num_classes is the model's output width for the built-in checks
    return Dataset(x[:train_size], y[:train_size], x[train_size:], y[train_size:], 1)


def model(input_shape, hidden: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(input_shape[0], hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def mse_step(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def r_squared(model, batches) -> dict[str, float]:
    predictions, targets = [], []
    for x, y in batches:
        predictions.append(model(x))
        targets.append(y)
    p, y = torch.cat(predictions), torch.cat(targets)
    mse = float(F.mse_loss(p, y))
    return {"r2": 1.0 - mse / float(y.var(unbiased=False)), "mse": mse}
