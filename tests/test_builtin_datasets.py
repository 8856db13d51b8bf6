"""The built-in digits dataset: scikit-learn's fixed split, cached so a process that builds it
need not import scikit-learn again."""

import numpy as np
import torch

from wavelet.common.datasets import digits


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
