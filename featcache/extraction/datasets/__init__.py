"""Dataset registry: `load_dataset(name, root, ...)` returns a `Dataset`; readers register themselves by name.

Like timm's model registry: a reader module decorates its loader with `@register_dataset("name", layout=...)`;
`layout` is the one-line description of the expected files shown when data is missing.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import zipfile
from contextlib import suppress
from pathlib import Path
from typing import Callable

import numpy as np

from ...atomic import write_atomic
from ...cache.identity import installed_versions
from ...errors import UserError, first_line, suggest
from ..contents import Contents
from .base import ArrayImages, Dataset, ImageSet, PathImages

_READERS: dict[str, Callable[..., Dataset]] = {}
_LAYOUTS: dict[str, str] = {}
_RECIPES: dict[str, tuple[str, ...]] = {}  # built-in datasets generated from installed packages -> those packages
_SIDES: dict[str, int] = {}  # built-in datasets -> the side of their images, known without building them


def register_dataset(name: str, layout: str = "", recipe_from: tuple[str, ...] = (), image_side: int | None = None):
    """Register a reader. `recipe_from` marks a dataset built deterministically from these installed distributions:
    its identity is then the reader's source code plus their versions, known without building a single image; its
    `image_side` (pixels) is then declared too, for extract's default image size."""

    def deco(fn):
        _READERS[name] = fn
        _LAYOUTS[name] = layout
        if recipe_from:
            _RECIPES[name] = recipe_from
        if image_side:
            _SIDES[name] = image_side
        return fn

    return deco


def image_side(name: str, data: Dataset | None) -> int | None:
    """The largest side, in pixels, of a dataset's images (the first image of each domain and split; a built-in
    dataset's declared side when `data` is None, as `dataset_identity` leaves it); None when unknown."""
    return _SIDES.get(name) if data is None else data.side()


def dataset_identity(
    name: str, root: str | Path | None = None, download: bool = False, contents: Contents | None = None
) -> tuple[dict, Dataset | None]:
    """What determines a dataset's pixels, and the loaded dataset when identifying it needed loading it.

    Built-in recipes are identified by their code and package versions (cheap, so a cache hit needs no images);
    data on disk by its content (`Dataset.fingerprint`: array bytes, or the files' names relative to the dataset
    folder, sizes and sha256s, which `contents` remembers by stat), never by how or where `root` is given."""
    _import_readers()
    if name in _RECIPES:
        return json.loads(_recipe_identity(name)), None
    data = load_dataset(name, root, download=download)
    return {"name": name, "fingerprint": data.fingerprint(contents), "by": "content"}, data


@functools.lru_cache(maxsize=None)
def _recipe_identity(name: str) -> str:
    """A built-in dataset's identity as JSON, found once per process (an extraction asks up to three times)."""
    code = inspect.getsource(sys.modules[_READERS[name].__module__])
    recipe = hashlib.sha256(code.encode()).hexdigest()
    return json.dumps({"name": name, "recipe": recipe, "packages": installed_versions(_RECIPES[name])})


def list_datasets() -> dict[str, str]:
    _import_readers()
    return dict(_LAYOUTS)


def load_dataset(
    name: str, root: str | Path | None = None, download: bool = False, store: str | Path | None = None, **options
) -> Dataset:
    """Load a registered dataset. `root` is the folder holding it (ignored by built-in offline data). A built-in
    dataset that `keep_dataset` saved in the folder `store` is read from there instead of being built again."""
    _import_readers()
    if name not in _READERS:
        raise UserError(f"unknown dataset {name!r}{suggest(name, _READERS)}; known: {', '.join(sorted(_READERS))}")
    if name in _RECIPES and store is not None and (file := _stored(name, Path(store), options)).is_file():
        try:
            return _read_stored(file, name)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # damaged: build it again (and replace it)
            file.unlink(missing_ok=True)
    return _READERS[name](root=Path(root) if root is not None else None, download=download, **options)


def keep_dataset(data: Dataset, store: str | Path, **options) -> None:
    """Save a built-in dataset's arrays in `store` as `.NAME-KEY.npz`, KEY the hash of its recipe's identity and
    `options` (a changed recipe or package version is a new file): a later `load_dataset(..., store=)` reads it in
    a fraction of the build time. Data read from disk is not kept (it is already on disk)."""
    if data.name not in _RECIPES or (file := _stored(data.name, Path(store), options)).is_file():
        return
    arrays = {
        f"{d}/{s}/{k}": getattr(images, k)
        for d, splits in data.domains.items()
        for s, images in splits.items()
        for k in ("images", "labels")
    }
    extra = dict(classes=np.array(data.classes), source=np.array(data.source))
    write_atomic(file, lambda f: np.savez(f, **extra, **arrays))  # streamed: tens of MB never held twice


def _stored(name: str, store: Path, options: dict) -> Path:
    identity = dataset_identity(name)[0] | {"options": options}
    return store / f".{name}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]}.npz"


def _read_stored(file: Path, name: str) -> Dataset:
    with np.load(file, allow_pickle=False) as z:
        domains: dict[str, dict[str, ImageSet]] = {}
        for key in z.files:
            if key.endswith("/images"):
                d, s, _ = key.split("/")
                domains.setdefault(d, {})[s] = _SavedImages(file, key, z[f"{d}/{s}/labels"])
        return Dataset(name, [str(c) for c in z["classes"]], domains, source=str(z["source"]))


class _SavedImages(ArrayImages):
    """One split of a dataset `keep_dataset` saved, its images read from the file when first asked for: a partition
    through filled stores reads the labels alone."""

    def __init__(self, file: Path, key: str, labels) -> None:
        self.file, self.key, self._images = file, key, None
        self.labels = np.asarray(labels, dtype=np.int64)

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            try:
                with np.load(self.file, allow_pickle=False) as z:
                    self._images = ArrayImages(z[self.key], self.labels).images
            except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                with suppress(OSError):  # the next run builds the dataset again
                    self.file.unlink()
                raise UserError(
                    f"the saved copy of dataset images {self.file} was damaged ({first_line(e)}) and is removed: "
                    "run the same command again"
                ) from None
            except OSError as e:  # unreadable now (gone, permissions, I/O): not proof of damage, nothing removed
                raise UserError(
                    f"cannot read the saved copy of dataset images {self.file} ({first_line(e)}): check the store "
                    "folder, or remove the file to build the dataset again"
                ) from None
        return self._images


def _import_readers() -> None:
    from . import disk, offline_digits, torchvision_sets  # noqa: F401  (they register; cycle: they import this package)


__all__ = [
    "ArrayImages",
    "Dataset",
    "ImageSet",
    "PathImages",
    "dataset_identity",
    "image_side",
    "keep_dataset",
    "load_dataset",
    "list_datasets",
    "register_dataset",
]
