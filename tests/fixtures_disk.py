"""Writers of tiny datasets in the real on-disk formats the readers meet, built in a test's tmp_path.

FedBN pickles (digit arrays; image paths + text labels), image files in every PIL mode the readers must turn into
RGB, CIFAR python batches byte-for-byte as Python 2's cPickle wrote them, MNIST idx, SVHN MATLAB and USPS bz2 libsvm.
"""

from __future__ import annotations

import bz2
import gzip
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

DIGIT5_SHAPES = {  # per-image shape in FedBN's pickles
    "MNIST": (28, 28),
    "SVHN": (32, 32, 3),
    "USPS": (16, 16),
    "SynthDigits": (32, 32, 3),
    "MNIST_M": (28, 28, 3),
}


def digit_arrays(n: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)  # [n, *shape]
    return images, (np.arange(n) + seed) % 10  # [n] int64


def write_digit5(root: Path, folders=tuple(DIGIT5_SHAPES), parts: int = 2, per_part: int = 12, n_test: int = 15):
    """FedBN's Digit-5 files; returns {folder: (train images, train labels, test images, test labels)}."""
    written = {}
    for f, folder in enumerate(folders):
        chunks = [digit_arrays(per_part, DIGIT5_SHAPES[folder], seed=10 * f + p) for p in range(parts)]
        (root / folder / "partitions").mkdir(parents=True)
        for p, chunk in enumerate(chunks):
            dump(chunk, root / folder / "partitions" / f"train_part{p}.pkl")
        test = digit_arrays(n_test, DIGIT5_SHAPES[folder], seed=10 * f + 9)
        dump(test, root / folder / "test.pkl")
        written[folder] = (np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]), *test)
    return written


def dump(obj, path: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol)
    return path


def write_image(path: Path, mode: str = "RGB", size: tuple[int, int] = (6, 5), seed: int = 0) -> Path:
    """A small random image in `mode` ('RGB', 'L', 'RGBA', 'P', 'I;16'); the suffix picks the file format."""
    rng = np.random.default_rng(seed)
    w, h = size
    arrays = {
        "RGB": lambda: rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
        "L": lambda: rng.integers(0, 256, (h, w), dtype=np.uint8),
        "RGBA": lambda: rng.integers(0, 256, (h, w, 4), dtype=np.uint8),
        "P": lambda: rng.integers(0, 256, (h, w), dtype=np.uint8),
        "I;16": lambda: rng.integers(1000, 60000, (h, w), dtype=np.uint16),
    }
    image = Image.fromarray(arrays[mode]())
    if mode == "P":
        image = image.convert("P")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def write_class_folders(folder: Path, counts: dict[str, int], suffix: str = ".jpg", mode: str = "RGB") -> None:
    for cls, n in counts.items():
        for i in range(n):
            write_image(folder / cls / f"img_{i:03d}{suffix}", mode, seed=zlib.crc32(f"{cls}/{i}".encode()))


# --- CIFAR as Python 2 pickled it (protocol 2, str = 8-bit strings, numpy.core module names) -------------------------


def _py2_str(data: bytes) -> bytes:
    return (b"U" + bytes([len(data)]) if len(data) < 256 else b"T" + struct.pack("<I", len(data))) + data


def _py2_int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)


def _py2_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _py2_uint8_array(a: np.ndarray) -> bytes:
    dtype = b"cnumpy\ndtype\n" + _py2_tuple([_py2_str(b"u1"), _py2_int(0), _py2_int(1)]) + b"R"
    dtype += _py2_tuple([_py2_int(3), _py2_str(b"|"), b"N", b"N", b"N", _py2_int(-1), _py2_int(-1), _py2_int(0)]) + b"b"
    shape = _py2_tuple([_py2_int(d) for d in a.shape])
    state = _py2_tuple([_py2_int(1), shape, dtype, b"\x89", _py2_str(np.ascontiguousarray(a).tobytes())])
    args = _py2_tuple([b"cnumpy\nndarray\n", _py2_tuple([_py2_int(0)]), _py2_str(b"b")])
    return b"cnumpy.core.multiarray\n_reconstruct\n" + args + b"R" + state + b"b"


def _py2_value(v) -> bytes:
    if isinstance(v, np.ndarray):
        return _py2_uint8_array(v)
    if isinstance(v, str):
        return _py2_str(v.encode("latin1"))
    if isinstance(v, int):
        return _py2_int(v)
    return b"](" + b"".join(_py2_value(x) for x in v) + b"e"  # list


def py2_pickle(d: dict) -> bytes:
    """A dict of str -> uint8 array | int | str | list, as Python 2's cPickle.dump(d, f, 2) writes it."""
    items = b"".join(_py2_value(k) + _py2_value(v) for k, v in d.items())
    return b"\x80\x02}(" + items + b"u."


def write_cifar10(root: Path, per_batch: int = 4, n_test: int = 5) -> tuple[np.ndarray, list[int]]:
    """cifar-10-batches-py with 5 train batches; returns the train images [N, 32, 32, 3] and labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(py2_pickle({"num_cases_per_batch": per_batch, "label_names": names}))
    images, labels = [], []
    for b, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else per_batch
        hwc = np.random.default_rng(b).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # [n, 32, 32, 3]
        y = [(b + i) % 10 for i in range(n)]
        flat = hwc.transpose(0, 3, 1, 2).reshape(n, 3072)  # [n, 3072]: all red, then green, then blue
        batch = {"batch_label": f"batch {b}", "labels": y, "data": flat, "filenames": [f"f{i}.png" for i in range(n)]}
        (folder / name).write_bytes(py2_pickle(batch))
        if name != "test_batch":
            images.append(hwc)
            labels += y
    return np.concatenate(images), labels


def write_cifar100(root: Path, n: int = 6) -> None:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    names = [f"class_{k:02d}" for k in range(100)]
    (folder / "meta").write_bytes(py2_pickle({"fine_label_names": names, "coarse_label_names": names[:20]}))
    for s, split in enumerate(["train", "test"]):
        flat = np.random.default_rng(s).integers(0, 256, (n, 3072), dtype=np.uint8)  # [n, 3072]
        fine = [(37 * i + s) % 100 for i in range(n)]
        (folder / split).write_bytes(py2_pickle({"data": flat, "fine_labels": fine, "coarse_labels": [0] * n}))


# --- MNIST idx, SVHN .mat, USPS libsvm -------------------------------------------------------------------------------


def idx_bytes(a: np.ndarray) -> bytes:
    return b"\x00\x00\x08" + bytes([a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(np.uint8).tobytes()


def write_mnist(root: Path, n_train: int = 7, n_test: int = 4, gz: bool = False) -> dict[str, tuple]:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images, labels = digit_arrays(n, (28, 28), seed=n)
        for name, a in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(a)))
            else:
                (raw / name).write_bytes(idx_bytes(a))
        out[prefix] = (images, labels)
    return out


def write_svhn(root: Path, n: int = 6) -> dict[str, tuple]:
    from scipy.io import savemat

    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for s, split in enumerate(("train", "test")):
        images, digits = digit_arrays(n, (32, 32, 3), seed=s)
        y = np.where(digits == 0, 10, digits).astype(np.uint8).reshape(-1, 1)  # [n, 1], SVHN writes 0 as 10
        savemat(root / f"{split}_32x32.mat", {"X": np.transpose(images, (1, 2, 3, 0)), "y": y})  # X [32, 32, 3, n]
        out[split] = (images, digits)
    return out


def usps_line(label: int, pixels: np.ndarray, drop_zeros: bool = False) -> str:
    """LIBSVM line for one USPS digit: label 1..10 and index:value pairs for pixels in [-1, 1]."""
    pairs = [f"{i + 1}:{v:.6g}" for i, v in enumerate(pixels) if not (drop_zeros and v == 0)]
    return " ".join([str(label + 1), *pairs])


def write_usps(root: Path, n: int = 5, drop_zeros: bool = False) -> dict[str, tuple]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for s, name in enumerate(("usps.bz2", "usps.t.bz2")):
        rng = np.random.default_rng(s)
        pixels = np.round(rng.uniform(-1, 1, (n, 256)), 4)  # [n, 256]
        pixels[:, 0] = 0.0  # exactly zero: LIBSVM files may leave such entries out
        labels = np.arange(n) % 10
        text = "\n".join(usps_line(int(y), p, drop_zeros) for y, p in zip(labels, pixels)) + "\n"
        (root / name).write_bytes(bz2.compress(text.encode()))
        out[name] = (pixels, labels)
    return out


# --- a complete tiny copy of every on-disk dataset, as its authors lay it out -----------------------------------------


def write_fedbn_sites(data: Path, folder: str, sites, classes, per_class: int = 2, size=(8, 8)) -> None:
    """FedBN's path-list layout: `data/folder/{site}_{train,test}.pkl`, each a pickled (image paths, text labels)
    pair listing PNGs as FedBN does, relative to its `data/` ('office_caltech_10/amazon/mug/frame_0001.png'); the
    last image of each class is a test image."""
    for site in sites:
        listed = {"train": ([], []), "test": ([], [])}
        for cls in classes:
            for i in range(per_class):
                rel = f"{folder}/{site}/{cls}/frame_{i:04d}.png"
                write_image(data / rel, size=size, seed=zlib.crc32(rel.encode()))
                split = "test" if i == per_class - 1 else "train"
                listed[split][0].append(rel)
                listed[split][1].append(cls)
        for split, pair in listed.items():
            dump(pair, data / folder / f"{site}_{split}.pkl")


def write_domain_folders(root: Path, domains, classes, per_class: int = 2, size=(8, 8)) -> None:
    """`root/{domain}/{class}/img_NNN.png`, every image different (seeded by its path)."""
    for d in domains:
        for c in classes:
            for i in range(per_class):
                write_image(root / d / c / f"img_{i:03d}.png", size=size, seed=zlib.crc32(f"{d}/{c}/{i}".encode()))


def _readers() -> dict:
    from featcache.extraction.datasets.disk import (
        DOMAINNET_CLASSES,
        DOMAINNET_SITES,
        OFFICE10_CLASSES,
        OFFICE10_SITES,
        PACS_CLASSES,
        PACS_DOMAINS,
    )

    multi = {"partition": "feature"}
    single = {"partition": "iid", "clients": 2}
    return {  # dataset -> (write a complete copy into ROOT, extract's options for it)
        "digit5": (lambda root: write_digit5(root, parts=10, per_part=2, n_test=4), multi),
        "office10": (
            lambda root: write_fedbn_sites(root, "office_caltech_10", OFFICE10_SITES, OFFICE10_CLASSES),
            multi,
        ),
        "domainnet": (lambda root: write_fedbn_sites(root, "DomainNet", DOMAINNET_SITES, DOMAINNET_CLASSES), multi),
        "pacs": (lambda root: write_domain_folders(root / "kfold", PACS_DOMAINS, PACS_CLASSES), multi),
        "imagefolder": (lambda root: write_domain_folders(root, ("d1", "d2"), ("a", "b", "c"), per_class=3), multi),
        "cifar10": (lambda root: write_cifar10(root), single),
        "cifar100": (lambda root: write_cifar100(root, n=100), single),
        "mnist": (lambda root: write_mnist(root, gz=True), single),
        "svhn": (lambda root: write_svhn(root, n=10), single),
        "usps": (lambda root: write_usps(root, n=10), single),
    }


READERS = _readers()  # every on-disk reader `featcache datasets` lists; tests check that none is missing
