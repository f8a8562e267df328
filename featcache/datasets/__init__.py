"""Dataset registry: `load_dataset(name, root, ...)` returns a `Dataset`; readers register themselves by name.

Like timm's model registry: a reader module decorates its loader with `@register_dataset("name", layout=...)`;
`layout` is the one-line description of the expected files shown when data is missing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from ..errors import UserError, suggest
from .base import ArrayImages, Dataset, ImageSet, PathImages

_READERS: dict[str, Callable[..., Dataset]] = {}
_LAYOUTS: dict[str, str] = {}
_RECIPES: dict[str, tuple[str, ...]] = {}  # built-in datasets generated from installed packages -> those packages


def register_dataset(name: str, layout: str = "", recipe_from: tuple[str, ...] = ()):
    """Register a reader. `recipe_from` marks a dataset built deterministically from these installed distributions:
    its identity is then the reader's source code plus their versions, known without building a single image."""

    def deco(fn):
        _READERS[name] = fn
        _LAYOUTS[name] = layout
        if recipe_from:
            _RECIPES[name] = recipe_from
        return fn

    return deco


def dataset_identity(name: str, root: str | Path | None = None, download: bool = False) -> tuple[dict, Dataset | None]:
    """What determines a dataset's pixels, and the loaded dataset when identifying it needed loading it.

    Built-in recipes are identified by their code and package versions (cheap, so a cache hit needs no images);
    data on disk by its files (paths, sizes, modification times)."""
    _import_readers()
    if name in _RECIPES:
        import importlib.metadata as md
        import inspect
        import sys

        code = inspect.getsource(sys.modules[_READERS[name].__module__])
        return {"name": name, "recipe": hashlib.sha256(code.encode()).hexdigest(),
                "packages": {d: md.version(d) for d in _RECIPES[name]}}, None
    data = load_dataset(name, root, download=download)
    return {"name": name, "fingerprint": data.fingerprint()}, data


def list_datasets() -> dict[str, str]:
    _import_readers()
    return dict(_LAYOUTS)


def load_dataset(name: str, root: str | Path | None = None, download: bool = False, **options) -> Dataset:
    """Load a registered dataset. `root` is the folder holding it (ignored by built-in offline data)."""
    _import_readers()
    if name not in _READERS:
        raise UserError(f"unknown dataset {name!r}{suggest(name, _READERS)}; known: {', '.join(sorted(_READERS))}")
    return _READERS[name](root=Path(root) if root is not None else None, download=download, **options)


def _import_readers() -> None:
    from . import disk, offline_digits, torchvision_sets  # noqa: F401  (registration side effects)


__all__ = ["ArrayImages", "Dataset", "ImageSet", "PathImages", "dataset_identity", "load_dataset", "list_datasets", "register_dataset"]
