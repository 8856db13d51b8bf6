"""The built-in digits dataset: scikit-learn's fixed split, cached so a process that builds it
need not import scikit-learn again; and the built-in datasets and models name a bad setting
when they are built, before any daemon starts."""

import re

import numpy as np
import pytest
import torch

from wavelet.common.datasets import build_dataset, digits
from wavelet.common.models import build_model


def test_the_digits_split_is_cached_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = digits()
    cached = list((tmp_path / "wavelet").glob("digits-*.npz"))
    assert len(cached) == 1
    again = digits()  # from the cache
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    # scikit-learn's stratified split: every class in both parts, about a fifth held out
    assert len(first.test_y) == 360 and set(first.test_y.tolist()) == set(range(10))
    assert len(first.train_y) + len(first.test_y) == 1797


def test_an_unreadable_cache_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = digits()
    [cached] = (tmp_path / "wavelet").glob("digits-*.npz")
    cached.write_bytes(b"not an npz file")
    got = digits()
    assert torch.equal(got.test_x, want.test_x)
    with np.load(cached) as saved:  # written again, whole
        assert len(saved["y_te"]) == 360


def test_a_truncated_cache_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = digits()
    [cached] = (tmp_path / "wavelet").glob("digits-*.npz")
    cached.write_bytes(cached.read_bytes()[:1000])  # a zip cut short
    assert torch.equal(digits().train_x, want.train_x)


@pytest.mark.parametrize(
    "name, kwargs, said",
    [
        ("digits", {"test_fraction": 1.5}, "test_fraction must be in (0, 1)"),
        ("digits", {"max_shift": -3}, "max_shift must be >= 0"),
        ("synthetic", {"test_size": 0}, "test_size must be >= 1"),
        ("synthetic", {"train_size": -5}, "train_size must be >= 1"),
        ("synthetic", {"shape": [0]}, "shape must be sizes >= 1"),
        ("synthetic", {"num_classes": 1}, "num_classes must be >= 2"),
        ("patterns", {"noise": -1.0}, "noise must be >= 0"),
        ("patterns", {"shape": [3, 2]}, "shape must be [channels, height, width]"),
    ],
)
def test_a_builtin_datasets_bad_setting_is_named(name, kwargs, said):
    with pytest.raises(ValueError, match=re.escape(f"dataset_kwargs.{said}")):
        build_dataset(name, 0, **kwargs)


@pytest.mark.parametrize(
    "name, kwargs, shape, said",
    [
        ("mlp", {"hidden": 0}, (1, 8, 8), "model_kwargs.hidden must be >= 1"),
        ("resnet18", {"width": 0}, (3, 32, 32), "model_kwargs.width must be >= 1"),
        ("digits_cnn", {}, (64,), "digits_cnn takes images (channels, height, width)"),
    ],
)
def test_a_builtin_models_bad_setting_is_named(name, kwargs, shape, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        build_model(name, shape, 10, 0, **kwargs)
