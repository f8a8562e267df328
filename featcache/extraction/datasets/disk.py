"""Readers for domain-shift benchmarks the user keeps on disk: FedBN's Digit-5, Office-Caltech-10 and DomainNet files,
PACS, and any `ROOT/{domain}/{class}/*` image tree.

Each domain becomes one entry of `Dataset.domains` with a 'train' and a 'test' split. Where the files carry no split
(image folders), a seeded stratified split per class makes one that does not move when other classes change.
Pickles are read with `safe_load`, so a dataset file cannot run code. None of these can be downloaded by featcache:
a missing dataset is a one-line `UserError` naming the layout and where to get it.

The readers with a fixed list of domains (digit5, office10, domainnet, pacs) load the domains present and record the
absent ones, with the paths they were expected at, in `Dataset.extra["missing_domains"]` (and the full list in
`extra["domain_order"]`): the partition refuses to run on fewer domains than the dataset has unless `--domains`
picks present ones (`partition.make_partition`), so an extraction never runs silently on 4 of 5 domains.
"""

from __future__ import annotations

import warnings
from pathlib import Path, PurePosixPath
from typing import Callable

import numpy as np

from ...errors import UserError
from . import register_dataset
from .base import ArrayImages, Dataset, PathImages, open_regular, require_regular
from .safe_pickle import safe_load

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
SPLITS = ("train", "test")

DIGIT5_FOLDERS = {"mnist": "MNIST", "svhn": "SVHN", "usps": "USPS", "synth": "SynthDigits", "mnistm": "MNIST_M"}
DIGIT5_CLASSES = [str(d) for d in range(10)]
OFFICE10_SITES = ("amazon", "caltech", "dslr", "webcam")
OFFICE10_CLASSES = "back_pack bike calculator headphones keyboard laptop_computer monitor mouse mug projector".split()
DOMAINNET_SITES = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
# FedBN's 10 of DomainNet's 345 classes
DOMAINNET_CLASSES = "bird feather headphones ice_cream teapot tiger whale windmill wine_glass zebra".split()
PACS_DOMAINS = ("photo", "art_painting", "cartoon", "sketch")
PACS_CLASSES = ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]

DIGIT5_LAYOUT = (
    "ROOT/{MNIST,SVHN,USPS,SynthDigits,MNIST_M}/partitions/train_part{0..9}.pkl and ROOT/{MNIST,...}/test.pkl "
    "beside partitions/ (FedBN's Digit-5 pickles: https://github.com/med-air/FedBN, utils/data_preprocess.py)"
)
OFFICE10_LAYOUT = (
    "ROOT/{amazon,caltech,dslr,webcam}_{train,test}.pkl with the images they list, or ROOT/{site}/{class}/*.jpg "
    "(FedBN's Office-Caltech-10: https://github.com/med-air/FedBN)"
)
DOMAINNET_LAYOUT = (
    "ROOT/{clipart,infograph,painting,quickdraw,real,sketch}_{train,test}.pkl with the images they list, or "
    "ROOT/{site}/{class}/*.jpg (images: https://ai.bu.edu/M3SDA/, FedBN's splits: https://github.com/med-air/FedBN)"
)
PACS_LAYOUT = (
    "ROOT/{photo,art_painting,cartoon,sketch}/{class}/*.jpg, ROOT may also hold them under kfold/, with the official "
    "split lists {domain}_{train,crossval,test}_kfold.txt in ROOT, ROOT/kfold, ROOT/pacs_label, ROOT/splits or "
    "ROOT/image_list when present "
    "(PACS: https://domaingeneralization.github.io/#data)"
)
IMAGEFOLDER_LAYOUT = "ROOT/{domain}/{class}/*.jpg|png|... or ROOT/{domain}/{train,test}/{class}/* (your own images)"


# --- shared helpers ------------------------------------------------------------------------------------------------


def _folder(name: str, root: Path | None, download: bool, layout: str) -> Path:
    """The dataset folder the user gave, checked; these datasets cannot be fetched, so `download` is refused."""
    if download:
        raise UserError(f"{name} cannot be downloaded by featcache; put it on disk as {layout}")
    if root is None:
        raise UserError(f"{name} needs --data-root pointing at {layout}")
    if not root.is_dir():
        raise UserError(f"{name}: {root} is not a folder; expected {layout}")
    return root


def _descend(root: Path, subfolder: str, holds_data: Callable[[Path], bool]) -> Path:
    """`root`, or `root/subfolder` when the user pointed at the parent of the folder FedBN's zip unpacks to."""
    if not holds_data(root) and holds_data(root / subfolder):
        return root / subfolder
    return root


def _image_files(folder: Path) -> list[Path]:
    """The image files in `folder`, each a regular file (a pipe, device, loop or folder named like an image is one
    line: reading it would hang or fail later)."""
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    for p in files:
        require_regular(p)
    return files


def _scan(folder: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    """Images in `folder/{class}/`, class folders taken in the order of `classes`; other folders are ignored."""
    paths: list[Path] = []
    labels: list[int] = []
    for k, cls in enumerate(classes):
        files = _image_files(folder / cls)
        paths += files
        labels += [k] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)  # [N]


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise UserError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: per class, a permutation seeded by (seed, class) sends round(n * fraction) images to test,
    keeping at least one image on each side when the class has two or more. Indices come back sorted."""
    test: list[np.ndarray] = []
    for k in np.unique(labels):
        idx = np.flatnonzero(labels == k)  # [n_k]
        n_test = int(round(len(idx) * test_fraction))
        n_test = min(max(n_test, 1), len(idx) - 1) if len(idx) >= 2 else 0
        test.append(np.random.default_rng([seed, int(k)]).permutation(idx)[:n_test])
    test_idx = np.sort(np.concatenate(test)) if test else np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), test_idx), test_idx


def _split_folder(folder: Path, classes: list[str], test_fraction: float, seed: int) -> dict[str, PathImages]:
    paths, labels = _scan(folder, classes)
    train, test = stratified_split(labels, test_fraction, seed)
    return {
        "train": PathImages([paths[i] for i in train], labels[train]),
        "test": PathImages([paths[i] for i in test], labels[test]),
    }


def _finish(
    name: str,
    classes: list[str],
    domains: dict,
    layout: str,
    root: Path,
    source: str,
    expected: dict[str, str] | None = None,
    folder: Path | None = None,
) -> Dataset:
    """The dataset; `expected` maps every domain the dataset has (in its order) to where its files belong, so the
    absent ones are recorded for the partition to refuse (see the module docstring). `folder` (default `root`) is
    the folder the data was found in, which its files' names in the fingerprint are relative to: FedBN's `data/` and
    the dataset folder inside it name the same files alike."""
    if not domains:
        raise UserError(f"{name}: no data found under {root}; expected {layout}")
    data = Dataset(name=name, classes=classes, domains=domains, source=source, root=folder or root)
    missing = {d: where for d, where in (expected or {}).items() if d not in domains}
    if missing:
        data.extra.update(missing_domains=missing, domain_order=list(expected))
    return data


# --- Digit-5 (FedBN pickles) ---------------------------------------------------------------------------------------


def _digit_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One FedBN digit pickle: a tuple (uint8 images [N, H, W] or [N, H, W, 3], labels [N])."""
    obj = safe_load(path)
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        kind = type(obj).__name__
        raise UserError(f"{path} should hold a pickled (images, labels) pair as FedBN writes it, got a {kind}")
    images = np.asarray(obj[0])
    labels = np.asarray(obj[1]).reshape(-1).astype(np.int64)  # [N]
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]  # [N, H, W, 1] -> [N, H, W]
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] != 3):
        raise UserError(f"{path}: expected uint8 images [N,H,W] or [N,H,W,3], got {images.dtype} {images.shape}")
    if len(images) != len(labels):
        raise UserError(f"{path}: expected one label per image, got {len(labels)} labels for {len(images)} images")
    if not len(images):
        raise UserError(
            f"{path} holds no images: an empty split cannot be trained or tested on; expected {DIGIT5_LAYOUT}"
        )
    outside = np.flatnonzero((labels < 0) | (labels > 9))  # [n_bad]
    if len(outside):
        i = int(outside[0])
        raise UserError(
            f"{path}: label {int(labels[i])} of image {i} is outside the digit classes 0..9 "
            f"({len(outside)} of {len(labels)} labels are)"
        )
    return images, labels


def _read_digit_domain(folder: Path, parts: int, sizes: list[int]) -> dict[str, ArrayImages]:
    """One domain's train parts 0..parts-1 (their sizes appended to `sizes`, for FedBN's percent) and test.pkl."""
    part_files = [folder / "partitions" / f"train_part{p}.pkl" for p in range(parts)]
    missing = [p for p in [*part_files, folder / "test.pkl"] if not p.is_file()]
    if missing:
        raise UserError(
            f"digit5: {missing[0]} is missing (parts={parts} reads train_part0..{parts - 1}); expected {DIGIT5_LAYOUT}"
        )
    chunks = [_digit_arrays(p) for p in part_files]
    sizes += [len(labels) for _, labels in chunks]
    train_images = np.concatenate([images for images, _ in chunks])  # [N, H, W] or [N, H, W, 3] uint8
    train_labels = np.concatenate([labels for _, labels in chunks])  # [N]
    return {"train": ArrayImages(train_images, train_labels), "test": ArrayImages(*_digit_arrays(folder / "test.pkl"))}


@register_dataset("digit5", layout=DIGIT5_LAYOUT)
def digit5(root: Path | None, download: bool = False, parts: int = 10) -> Dataset:
    """FedBN's Digit-5 pickles: domains mnist, svhn, usps, synth, mnistm (those present), classes '0'..'9'.

    FedBN cut each domain's training set into ten partitions of ~744 images (`partitions/train_part{0..9}.pkl`);
    `parts=k` reads train_part0..k-1. The default `parts=10` is what FedPCL runs (its `--percent` defaults to 1,
    which reads all ten); FedPCL then keeps the first 10 training and 200 test images per class, and FedBN's
    `--percent` (extract's `percent`, which follows FedBN's rule through the part sizes recorded in
    `extra["train_parts"]`) is the partition step's business, not the reader's. MNIST/USPS are grey [N, 28, 28] and
    [N, 16, 16]; SVHN, SynthDigits and MNIST-M are RGB [N, 32, 32, 3] / [N, 28, 28, 3]. `ROOT` may be FedBN's
    `data/` (holding `digit/`) or `data/digit/` itself.
    """
    if not (isinstance(parts, int) and 1 <= parts <= 10):
        raise UserError(f"digit5: parts must be an integer in 1..10 (FedBN's ten train_part files), got {parts!r}")
    root = _folder("digit5", root, download, DIGIT5_LAYOUT)
    base = _descend(root, "digit", lambda d: any((d / f).is_dir() for f in DIGIT5_FOLDERS.values()))
    sizes: dict[str, list[int]] = {d: [] for d, f in DIGIT5_FOLDERS.items() if (base / f).is_dir()}
    domains = {domain: _read_digit_domain(base / DIGIT5_FOLDERS[domain], parts, sizes[domain]) for domain in sizes}
    train_parts = "train_part0.pkl" if parts == 1 else f"train_part{{0..{parts - 1}}}.pkl"
    expected = {d: f"{base / f}/partitions/{train_parts} and {base / f}/test.pkl" for d, f in DIGIT5_FOLDERS.items()}
    source = f"FedBN Digit-5 pickles at {base}"
    data = _finish("digit5", DIGIT5_CLASSES, domains, DIGIT5_LAYOUT, root, source, expected, base)
    data.extra["train_parts"] = sizes
    return data


# --- Office-Caltech-10 and DomainNet (FedBN path pickles, or image folders) ----------------------------------------


def _path_parts(listed: str) -> tuple[str, ...]:
    """Components of a path as FedBN lists it, without leading '/', '.' and '..' ('../data/x/y' -> data, x, y)."""
    parts = PurePosixPath(listed.replace("\\", "/")).parts
    while parts and parts[0] in ("/", ".", ".."):
        parts = parts[1:]
    return parts


def _resolve_listed(listed: list[str], base: Path, root: Path, pkl: Path, layout: str) -> list[Path]:
    """Find the images a FedBN pickle lists. FedBN stores them relative to its own data folder
    ('office_caltech_10/amazon/back_pack/frame_0001.jpg', sometimes behind '../data/'), and FedPCL drops the first
    component; so try `base` and its two parents inside `root` with 0, 1, 2, ... leading components dropped, take the
    first that finds the first image, and require every other image to be found the same way. Every image must
    resolve (symlinks followed) inside `root`: a list cannot make featcache read files elsewhere."""
    if not listed:
        raise UserError(f"{pkl} lists no images: an empty split cannot be trained or tested on; expected {layout}")
    inside = root.resolve()
    first = _path_parts(listed[0])
    for folder in (base, *list(base.parents)[:2]):
        if not folder.resolve().is_relative_to(inside):
            break
        for drop in range(len(first) - 1):  # keep at least '{class}/{file}'
            if folder.joinpath(*first[drop:]).is_file():
                paths = [folder.joinpath(*_path_parts(p)[drop:]) for p in listed]
                outside = next((p for p in paths if not p.resolve().is_relative_to(inside)), None)
                if outside is not None:
                    raise UserError(
                        f"{pkl} lists {outside}, which resolves to {outside.resolve()} outside --data-root "
                        f"{root}: keep the images (and the targets of links to them) inside it"
                    )
                missing = [p for p in paths if not p.is_file()]
                if missing:
                    raise UserError(
                        f"{len(missing)} of {len(paths)} images listed in {pkl} are missing, e.g. {missing[0]}; "
                        f"expected {layout}"
                    )
                return paths
    raise UserError(
        f"cannot find {listed[0]!r} (listed in {pkl}) under {base} or its parents; unpack the images beside the "
        f"pickles as in {layout}"
    )


def _read_path_pickle(pkl: Path, base: Path, root: Path, classes: list[str], layout: str) -> PathImages:
    """One FedBN `{site}_{split}.pkl`: a pickled pair (image paths, text labels)."""
    obj = safe_load(pkl)
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2 and len(obj[0]) == len(obj[1])):
        raise UserError(f"{pkl} should hold a pickled (image paths, text labels) pair as FedBN writes it")
    index = {c: k for k, c in enumerate(classes)}
    texts = [str(t) for t in obj[1]]
    unknown = sorted(set(texts) - set(index))
    if unknown:
        raise UserError(f"{pkl} has labels {unknown[:3]} outside the expected classes {classes}")
    paths = _resolve_listed([str(p) for p in obj[0]], base, root, pkl, layout)
    return PathImages(paths, np.asarray([index[t] for t in texts], dtype=np.int64))


def _read_sites(
    name: str,
    root: Path,
    subfolder: str,
    sites: tuple[str, ...],
    classes: list[str],
    layout: str,
    test_fraction: float,
    seed: int,
) -> Dataset:
    """FedBN's `{site}_{train,test}.pkl` where they exist, else `{site}/{class}/*` split by seed."""
    _check_fraction(test_fraction)
    base = _descend(root, subfolder, lambda d: any((d / f"{s}_train.pkl").is_file() or (d / s).is_dir() for s in sites))
    domains: dict[str, dict[str, PathImages]] = {}
    for site in sites:
        pickles = {split: base / f"{site}_{split}.pkl" for split in SPLITS}
        present = [split for split, p in pickles.items() if p.is_file()]
        if present and len(present) < len(SPLITS):
            absent = next(p for p in pickles.values() if not p.is_file())
            raise UserError(f"{name}: {absent} is missing beside {pickles[present[0]].name}; expected {layout}")
        if present:
            domains[site] = {split: _read_path_pickle(p, base, root, classes, layout) for split, p in pickles.items()}
        elif (base / site).is_dir():
            domains[site] = _split_folder(base / site, classes, test_fraction, seed)
    source = f"{name} at {base} (FedBN pickles, else folders split with test_fraction={test_fraction}, seed={seed})"
    expected = {s: f"{base}/{s}_train.pkl and {base}/{s}_test.pkl, or {base}/{s}/{{class}}/*.jpg" for s in sites}
    return _finish(name, classes, domains, layout, root, source, expected, base)


@register_dataset("office10", layout=OFFICE10_LAYOUT)
def office10(root: Path | None, download: bool = False, test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """Office-Caltech-10: sites amazon, caltech, dslr, webcam; FedBN's 10 classes in FedBN's label order.
    `ROOT` may be FedBN's `data/` (holding `office_caltech_10/`) or that folder itself."""
    root = _folder("office10", root, download, OFFICE10_LAYOUT)
    return _read_sites(
        "office10", root, "office_caltech_10", OFFICE10_SITES, OFFICE10_CLASSES, OFFICE10_LAYOUT, test_fraction, seed
    )


@register_dataset("domainnet", layout=DOMAINNET_LAYOUT)
def domainnet(root: Path | None, download: bool = False, test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """DomainNet restricted to FedBN's 10 classes: sites clipart, infograph, painting, quickdraw, real, sketch.
    In folder layout the other 335 class folders are ignored (use `imagefolder` for all of them)."""
    root = _folder("domainnet", root, download, DOMAINNET_LAYOUT)
    return _read_sites(
        "domainnet", root, "DomainNet", DOMAINNET_SITES, DOMAINNET_CLASSES, DOMAINNET_LAYOUT, test_fraction, seed
    )


# --- PACS and generic image folders ---------------------------------------------------------------------------------


PACS_KFOLD = {"train": "train", "test": "crossval"}  # featcache's split -> the official list it reads
# where the lists may lie, relative to ROOT: the official download's pacs_label/, Dassl's splits/, TLlib's image_list/
PACS_LISTS = ("", "kfold", "pacs_label", "splits", "image_list")


@register_dataset("pacs", layout=PACS_LAYOUT)
def pacs(root: Path | None, download: bool = False, test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """PACS: domains photo, art_painting, cartoon, sketch (those present), 7 classes.

    Where the official split lists are present (`{domain}_train_kfold.txt` and `{domain}_crossval_kfold.txt`:
    lines `art_painting/dog/pic_001.jpg 1`, labels 1..7 in PACS's class order), a domain's train split is its
    train_kfold list and its test split its crossval_kfold list (Li et al., ICCV 2017); `{domain}_test_kfold.txt`
    is not read: it lists the whole domain, which is what a held-out domain is tested on (partition option
    holdout_domain: its train and test splits). Otherwise a seeded stratified split (`test_fraction`, `seed`).
    `extra["notes"]` says which."""
    _check_fraction(test_fraction)
    root = _folder("pacs", root, download, PACS_LAYOUT)
    base = _descend(root, "kfold", lambda d: any((d / s).is_dir() for s in PACS_DOMAINS))
    lists = next((f for f in dict.fromkeys(root / sub for sub in PACS_LISTS) if _kfold_lists(f)), None)
    domains = {
        domain: _kfold_splits(lists, domain, base, root)
        if lists is not None
        else _split_folder(base / domain, PACS_CLASSES, test_fraction, seed)
        for domain in PACS_DOMAINS
        if (base / domain).is_dir()
    }
    how = f"official kfold lists in {lists}" if lists else f"test_fraction={test_fraction}, seed={seed}"
    source = f"PACS folders at {base} ({how})"
    expected = {d: f"{base / d}/{{class}}/*.jpg" for d in PACS_DOMAINS}
    data = _finish("pacs", PACS_CLASSES, domains, PACS_LAYOUT, root, source, expected, base)
    data.extra["notes"] = [
        f"pacs: the official kfold splits ({lists}/{{domain}}_train_kfold.txt for train, _crossval_kfold.txt for test;"
        " _test_kfold.txt is not read: it lists the whole domain, which a held-out domain is tested on)"
        if lists
        else f"pacs: no official kfold lists found (in ROOT or its {', '.join(filter(None, PACS_LISTS))}): a seeded "
        f"{1 - test_fraction:g}"
        f"/{test_fraction:g} split per class (seed {seed})"
    ]
    return data


def _kfold_lists(folder: Path) -> bool:
    return any((folder / f"{d}_{PACS_KFOLD['train']}_kfold.txt").is_file() for d in PACS_DOMAINS)


def _kfold_splits(lists: Path, domain: str, base: Path, root: Path) -> dict[str, PathImages]:
    """One domain's splits from the official lists: `path label` per line, the path relative to the image folder
    (resolved as FedBN's path lists are: `_resolve_listed`), the label 1..7."""
    splits = {}
    for split, name in PACS_KFOLD.items():
        file = lists / f"{domain}_{name}_kfold.txt"
        if not file.is_file():
            raise UserError(f"pacs: {file} is missing beside the other kfold lists in {lists}; expected {PACS_LAYOUT}")
        with open_regular(file) as fh:
            rows = [line.split() for line in fh.read().decode("utf-8", "replace").splitlines() if line.strip()]
        bad = next(
            (r for r in rows if len(r) != 2 or not r[1].isdigit() or not 1 <= int(r[1]) <= len(PACS_CLASSES)), None
        )
        if bad is not None:
            raise UserError(
                f"{file}: line {' '.join(bad)!r} is not 'PATH LABEL' with a label in 1..{len(PACS_CLASSES)}"
            )
        paths = _resolve_listed([r[0] for r in rows], base, root, file, PACS_LAYOUT)
        splits[split] = PathImages(paths, np.asarray([int(r[1]) - 1 for r in rows], dtype=np.int64))
    return splits


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _has_split_folders(domain: Path) -> bool:
    return all((domain / split).is_dir() for split in SPLITS)


@register_dataset("imagefolder", layout=IMAGEFOLDER_LAYOUT)
def imagefolder(root: Path | None, download: bool = False, test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """Any `ROOT/{domain}/{class}/*` tree. Classes are the sorted union of class-folder names over all domains (a
    domain may lack some); a domain holding `train/` and `test/` keeps that split, others get a seeded stratified
    one. Domains without images are skipped; a class a domain has in test but not in train is allowed with a warning
    (extract refuses a class without images in any domain)."""
    _check_fraction(test_fraction)
    root = _folder("imagefolder", root, download, IMAGEFOLDER_LAYOUT)
    class_parents = {
        domain: [domain / s for s in SPLITS] if _has_split_folders(domain) else [domain] for domain in _subfolders(root)
    }
    classes = sorted({c.name for parents in class_parents.values() for parent in parents for c in _subfolders(parent)})
    domains: dict[str, dict[str, PathImages]] = {}
    for domain in class_parents:
        if _has_split_folders(domain):
            splits = {split: PathImages(*_scan(domain / split, classes)) for split in SPLITS}
        else:
            splits = _split_folder(domain, classes, test_fraction, seed)
        if any(len(s) for s in splits.values()):
            domains[domain.name] = splits
    _warn_test_only_classes(classes, domains)
    source = f"image folders at {root} (test_fraction={test_fraction}, seed={seed} where no train/test)"
    return _finish("imagefolder", classes, domains, IMAGEFOLDER_LAYOUT, root, source)


def _warn_test_only_classes(classes: list[str], domains: dict) -> None:
    """Warn about classes a domain has in test but not in train: that domain's clients are never tested on them,
    because a client's test labels follow its train labels (allowed: a domain may lack classes)."""
    for name, splits in domains.items():
        counts = {split: np.bincount(splits[split].labels, minlength=len(classes)) for split in SPLITS}  # [K] each
        unused = [classes[k] for k in np.flatnonzero((counts["test"] > 0) & (counts["train"] == 0))]
        if unused:
            warnings.warn(
                f"imagefolder: domain {name!r} has test images but no training images of {unused}: "
                "its clients are never tested on them",
                UserWarning,
                stacklevel=3,
            )
