"""torchvision's ResNet-18 trained by Wavelet on an image folder read through DataLoader workers.

The dataset factory writes a small image folder on first use (four classes, each a fixed
colour pattern under noise, saved as PNG files), then returns torchvision ``ImageFolder``
datasets: every sample is decoded from its file by a loader worker, nothing is held in memory.
Needs torchvision (``pip install 'wavelet[vision]'``; README "Examples"). From the repository's
root:

    wavelet launch --model torchvision.models:resnet18 --set model_kwargs.num_classes=4 \\
        --dataset examples.vision:image_folder --set dataset_kwargs.root=runs/images \\
        --set loader_workers=1 --batch-size 16 --lr 0.02 --epochs 2
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def image_folder(
    seed: int = 0,
    root: str = "runs/images",
    train_per_class: int = 96,
    test_per_class: int = 32,
    size: int = 32,
):
    """(train, test) ``ImageFolder`` datasets under ``root``, written there if missing."""
    from torchvision import datasets, transforms

    root_path = Path(root)
    if not (root_path / "test").is_dir():
        _write_images(root_path, train_per_class, test_per_class, size)
    to_tensor = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))]
    )
    return (
        datasets.ImageFolder(str(root_path / "train"), transform=to_tensor),
        datasets.ImageFolder(str(root_path / "test"), transform=to_tensor),
    )


CLASSES = ("checks", "stripes", "rings", "gradient")


def _write_images(root: Path, train_per_class: int, test_per_class: int, size: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    patterns = {
        "checks": ((xx * 4).astype(int) + (yy * 4).astype(int)) % 2,
        "stripes": (np.sin(xx * 12) > 0).astype(float),
        "rings": (np.sin(np.hypot(xx - 0.5, yy - 0.5) * 30) > 0).astype(float),
        "gradient": xx * 0.5 + yy * 0.5,
    }
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for name in CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                tint = rng.uniform(0.4, 1.0, size=3)  # colour varies, the pattern is the class
                image = patterns[name][..., None] * tint + rng.normal(0, 0.15, (size, size, 3))
                pixels = (np.clip(image, 0, 1) * 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")
