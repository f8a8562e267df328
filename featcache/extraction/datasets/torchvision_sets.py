"""Single-domain classics (CIFAR-10, CIFAR-100, MNIST, SVHN, USPS) read from the files torchvision downloads.

torchvision fetches them (only when the user passes --download) and checks their MD5s; reading is done here from the
official on-disk formats, so data copied by hand works too and no heavy import happens offline: CIFAR python pickles
(through `safe_load`), MNIST idx files (plain or .gz), SVHN MATLAB files, USPS bz2 libsvm text. Each dataset is one
domain named like the dataset. Missing files without --download: one `UserError` line naming the folder expected.
"""

from __future__ import annotations

import bz2
import gzip
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from ...errors import UserError, first_line
from . import register_dataset
from .base import ArrayImages, Dataset
from .safe_pickle import safe_load

DIGITS = [str(d) for d in range(10)]
Splits = dict[str, ArrayImages]


# --- readers of the official formats -------------------------------------------------------------------------------


def _field(obj, key: str, path: Path):
    if not (isinstance(obj, dict) and key in obj):
        raise UserError(f"{path} is not a CIFAR python batch (no {key!r} entry); re-download it with --download")
    return obj[key]


def _read_cifar(
    root: Path, folder: str, train: list[str], test: str, meta: str, names_key: str, labels_key: str
) -> tuple[list[str], Splits]:
    """CIFAR python version: pickled dicts with 'data' [N, 3072] uint8 (channel-major) and a list of labels."""

    def batch(name: str) -> tuple[np.ndarray, np.ndarray]:
        path = root / folder / name
        obj = safe_load(path)
        flat = np.asarray(_field(obj, "data", path), dtype=np.uint8)  # [N, 3072]
        images = np.ascontiguousarray(flat.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # [N, 32, 32, 3]
        return images, np.asarray(_field(obj, labels_key, path), dtype=np.int64)  # [N]

    chunks = [batch(name) for name in train]
    splits = {
        "train": ArrayImages(np.concatenate([x for x, _ in chunks]), np.concatenate([y for _, y in chunks])),
        "test": ArrayImages(*batch(test)),
    }
    meta_path = root / folder / meta
    return [str(n) for n in _field(safe_load(meta_path), names_key, meta_path)], splits


def _on_disk(root: Path, relative: str) -> Path | None:
    """A required file, or its .gz: torchvision keeps MNIST's downloaded .gz beside the extracted idx file."""
    return next((p for p in (root / relative, root / f"{relative}.gz") if p.is_file()), None)


def _read_idx(path: Path) -> np.ndarray:
    """idx format: two zero bytes, a type code (0x08 = uint8), the number of dims, big-endian uint32 dims, data."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise UserError(f"{path} is not an idx file of uint8 (MNIST format); re-download it with --download")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4)  # [ndim]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape([int(d) for d in dims])


def _read_mnist(root: Path) -> tuple[list[str], Splits]:
    def split(prefix: str) -> ArrayImages:
        images = _read_idx(_on_disk(root, f"MNIST/raw/{prefix}-images-idx3-ubyte"))  # [N, 28, 28] uint8
        return ArrayImages(images, _read_idx(_on_disk(root, f"MNIST/raw/{prefix}-labels-idx1-ubyte")))

    return DIGITS, {"train": split("train"), "test": split("t10k")}


def _read_svhn(root: Path) -> tuple[list[str], Splits]:
    from scipy.io import loadmat  # scipy arrives with scikit-learn; imported here so other readers do not pay for it

    def split(name: str) -> ArrayImages:
        mat = loadmat(root / f"{name}_32x32.mat")
        images = np.ascontiguousarray(np.transpose(mat["X"], (3, 0, 1, 2)))  # [32, 32, 3, N] -> [N, 32, 32, 3] uint8
        labels = mat["y"].astype(np.int64).reshape(-1) % 10  # [N]; SVHN writes digit 0 as label 10
        return ArrayImages(images, labels)

    return DIGITS, {"train": split("train"), "test": split("test")}


def _read_usps_file(path: Path) -> ArrayImages:
    """libsvm text: 'label index:value ...' per line; labels 1..10, 256 pixels in [-1, 1] (zeros may be left out)."""
    with bz2.open(path, "rt") as f:
        rows = [np.array(line.replace(":", " ").split(), dtype=np.float64) for line in f if line.strip()]
    pixels = np.zeros((len(rows), 256), dtype=np.float32)  # [N, 256] in [-1, 1]
    for pixel_row, row in zip(pixels, rows):
        pixel_row[row[1::2].astype(np.int64) - 1] = row[2::2]
    images = ((pixels + 1) / 2 * 255).astype(np.uint8).reshape(-1, 16, 16)  # [N, 16, 16], torchvision's scaling
    labels = np.array([row[0] for row in rows], dtype=np.int64) - 1  # [N] 0..9
    return ArrayImages(images, labels)


def _read_usps(root: Path) -> tuple[list[str], Splits]:
    return DIGITS, {"train": _read_usps_file(root / "usps.bz2"), "test": _read_usps_file(root / "usps.t.bz2")}


# --- the registered datasets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    torchvision_class: str  # name in torchvision.datasets, used only to download
    split_kwargs: tuple[dict, ...]  # constructor keywords for each split to download
    files: tuple[str, ...]  # required, relative to root (MNIST idx files may also be .gz)
    layout: str
    read: Callable[[Path], tuple[list[str], Splits]]


_TRAIN_TEST = ({"train": True}, {"train": False})
_CIFAR10 = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)]
_MNIST = [f"MNIST/raw/{p}-{kind}" for p in ("train", "t10k") for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]

SOURCES: dict[str, _Source] = {
    "cifar10": _Source(
        "CIFAR10",
        _TRAIN_TEST,
        (*_CIFAR10, "cifar-10-batches-py/test_batch", "cifar-10-batches-py/batches.meta"),
        "ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta} (torchvision's CIFAR10 files)",
        partial(
            _read_cifar,
            folder="cifar-10-batches-py",
            train=[Path(p).name for p in _CIFAR10],
            test="test_batch",
            meta="batches.meta",
            names_key="label_names",
            labels_key="labels",
        ),
    ),
    "cifar100": _Source(
        "CIFAR100",
        _TRAIN_TEST,
        ("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),
        "ROOT/cifar-100-python/{train,test,meta} (torchvision's CIFAR100 files)",
        partial(
            _read_cifar,
            folder="cifar-100-python",
            train=["train"],
            test="test",
            meta="meta",
            names_key="fine_label_names",
            labels_key="fine_labels",
        ),
    ),
    "mnist": _Source(
        "MNIST",
        _TRAIN_TEST,
        tuple(_MNIST),
        "ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (torchvision's MNIST files)",
        _read_mnist,
    ),
    "svhn": _Source(
        "SVHN",
        ({"split": "train"}, {"split": "test"}),
        ("train_32x32.mat", "test_32x32.mat"),
        "ROOT/{train,test}_32x32.mat (torchvision's SVHN files, format 2 of http://ufldl.stanford.edu/housenumbers/)",
        _read_svhn,
    ),
    "usps": _Source(
        "USPS",
        _TRAIN_TEST,
        ("usps.bz2", "usps.t.bz2"),
        "ROOT/{usps.bz2,usps.t.bz2} (torchvision's USPS files, LIBSVM's multiclass USPS)",
        _read_usps,
    ),
}


def _download(name: str, source: _Source, root: Path) -> None:
    import torchvision.datasets  # heavy: imported only when the user asks to download

    cls = getattr(torchvision.datasets, source.torchvision_class)
    root.mkdir(parents=True, exist_ok=True)
    for kwargs in source.split_kwargs:
        try:
            cls(str(root), download=True, **kwargs)
        except Exception as e:  # network and checksum failures come in many types; all mean "no files"
            raise UserError(
                f"downloading {name} with torchvision.datasets.{source.torchvision_class} failed "
                f"({type(e).__name__}: {first_line(e)}); put the files in place by hand: {source.layout}"
            ) from None


def _loader(name: str, source: _Source) -> Callable[..., Dataset]:
    def load(root: Path | None, download: bool = False) -> Dataset:
        if root is None:
            raise UserError(f"{name} needs --data-root: a folder holding {source.layout}; --download fetches it there")
        if download:
            _download(name, source, root)
        missing = [f for f in source.files if _on_disk(root, f) is None]
        if missing:
            raise UserError(
                f"{name}: {root / missing[0]} not found; expected {source.layout}; pass --download to fetch it"
            )
        classes, splits = source.read(root)
        return Dataset(
            name=name, classes=classes, domains={name: splits}, source=f"{source.layout} at {root}", root=root
        )

    load.__name__ = load.__qualname__ = name
    load.__doc__ = f"{name}, one domain '{name}': {source.layout}."
    return load


for _name, _source in SOURCES.items():
    register_dataset(_name, layout=f"{_source.layout}; --download fetches it")(_loader(_name, _source))
