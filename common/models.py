"""Built-in models, and a user's own model by import path (``package.module:function``).

A factory gets the job's ``model_kwargs`` as keyword arguments, and the dataset's ``input_shape``
and ``num_classes`` where it takes them: by name where it has parameters so named (or two leading
positional parameters without defaults, the built-ins' form), not at all otherwise, so that
``--model torchvision.models:resnet18 --set model_kwargs.num_classes=10`` calls
``resnet18(num_classes=10)``. A ``model_kwargs`` key the factory does not take is refused.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from wavelet.common.imports import import_callable


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    _at_least_one("hidden", hidden)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def digits_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    """A small CNN for 8x8 digits (about 240k parameters at the default width)."""
    _at_least_one("width", width)
    if len(input_shape) != 3:
        raise ValueError(f"digits_cnn takes images (channels, height, width), not {input_shape}")
    channels, height, width_px = input_shape
    flat = 2 * width * (height // 2) * (width_px // 2)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 216),
        nn.ReLU(),
        nn.Linear(216, num_classes),
    )


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (CIFAR style: 3x3 stem, no max-pool; 11.2M parameters at
    width 64). ``width`` scales every layer's channels: at 16 it has 0.7M parameters and its
    activations, not its weights, fill its memory."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, cin = [], width
        for factor, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            cout = factor * width
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(8 * width, num_classes)

    def checkpoint_blocks(self) -> list[nn.Module]:
        """What activation checkpointing recomputes: the stem and each residual block."""
        return [self.stem, *self.layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


def resnet18(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Module:
    _at_least_one("width", width)
    if len(input_shape) != 3:
        raise ValueError(f"resnet18 takes images (channels, height, width), not {input_shape}")
    return ResNet18(input_shape[0], num_classes, width)


def _at_least_one(name: str, value: int) -> None:
    if not value >= 1:
        raise ValueError(f"model_kwargs.{name} must be >= 1, got {value}")


# reentrant: a user's factory may itself call build_model (wrapping a built-in one)
_BUILD_LOCK = threading.RLock()

BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "digits_cnn": digits_cnn,
    "resnet18": resnet18,
}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, /, seed: int, **kwargs
) -> nn.Module:
    """The model ``name`` with weights drawn from ``seed``: every wave builds the same one.
    (The first three are positional-only, so that ``kwargs`` may hold a ``num_classes``.)"""
    factory = BUILTIN_MODELS.get(name) or import_callable(name, "model", BUILTIN_MODELS)
    # Module constructors draw from the global RNG: waves building their replicas in parallel
    # threads would interleave draws and get different weights from the same seed.
    args, kwargs = factory_arguments(name, factory, tuple(input_shape), num_classes, kwargs)
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {name!r} returned {type(model).__name__}, not nn.Module")
    return model


def factory_arguments(
    name: str, factory: Callable, input_shape: tuple[int, ...], num_classes: int, kwargs: dict
) -> tuple[tuple, dict]:
    """How to call a model factory (see the module's docstring); TypeError naming any
    ``model_kwargs`` key it does not take."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): the built-in form
        return (input_shape, num_classes), kwargs
    named = {n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in named and not takes_any]
    if unknown:
        raise TypeError(
            f"model factory {name!r} takes no {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(sorted(named)) or 'no arguments'}"
        )
    kwargs = dict(kwargs)
    if "input_shape" in named or "num_classes" in named:
        if "input_shape" in named:
            kwargs.setdefault("input_shape", input_shape)
        if "num_classes" in named and "num_classes" not in kwargs:
            # a dataset that does not say leaves a default of the factory's own in place
            if num_classes > 0 or params["num_classes"].default is params["num_classes"].empty:
                kwargs["num_classes"] = _known_classes(name, num_classes)
        return (), kwargs
    positional = [
        p
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) >= 2:  # (shape, classes, ...) under other names
        return (input_shape, _known_classes(name, num_classes)), kwargs
    return (), kwargs


def _known_classes(name: str, num_classes: int) -> int:
    if num_classes > 0:
        return num_classes
    raise ValueError(
        f"model factory {name!r} needs the number of classes, and the dataset does not say it "
        "(its train set has no num_classes or classes attribute): give it with --set "
        "model_kwargs.num_classes=N, or give the train dataset a num_classes attribute"
    )


def checkpoint_blocks(model: nn.Module) -> int:
    """Run the model's blocks under activation checkpointing (``torch.utils.checkpoint``,
    non-reentrant): their activations are not kept for backward but recomputed then, so a larger
    batch fits the same memory at the cost of a second forward. Gradients are exactly those of
    the plain model; parameter names do not change (the sharding plan stays the same). BatchNorm
    running statistics are updated again by the recomputation.

    Which blocks: what ``model.checkpoint_blocks()`` returns where the model defines one (the
    hook for a user's model; ResNet-18 returns its stem and residual blocks); for an
    ``nn.Sequential``, about sqrt(n) segments of consecutive layers (one layer per segment would
    keep every layer's input: no saving); else every top-level child but the last (usually the
    classifier, whose activations are small). Returns how many blocks run checkpointed."""
    hook = getattr(model, "checkpoint_blocks", None)
    if callable(hook):
        blocks = list(hook())
    elif isinstance(model, nn.Sequential):
        layers = list(model.children())
        segments = max(2, round(math.sqrt(len(layers))))
        model.forward = lambda x: (
            torch.utils.checkpoint.checkpoint_sequential(layers, segments, x, use_reentrant=False)
            if torch.is_grad_enabled()
            else nn.Sequential.forward(model, x)
        )
        return segments - 1  # checkpoint_sequential runs the last segment plainly
    else:
        blocks = list(model.children())[:-1]
    for block in blocks:
        block.forward = _checkpointed(block.forward)
    return len(blocks)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
