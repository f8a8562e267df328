"""A backbone's key in the cache: short, unique per weights, and safe as a file name and an HDF5 group name."""

from __future__ import annotations

import re
from pathlib import Path

_CHECKPOINT_SUFFIXES = {".tar", ".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".npz"}
_GENERIC_STEMS = {"model_best", "checkpoint", "model", "best", "last", "weights", "pytorch_model", "state_dict"}


def checkpoint_key(name: str, path: Path) -> str:
    """'resnet18-quickdraw' for .../quickdraw-net/model_best.pth.tar: the file's stem, or its folder's when the stem
    is generic."""
    stem = path.name
    while Path(stem).suffix in _CHECKPOINT_SUFFIXES:
        stem = stem[: -len(Path(stem).suffix)]
    label = path.parent.name if stem in _GENERIC_STEMS else stem
    return safe_key(f"{name}-{re.sub(r'[-_]net$', '', label)}")


def safe_key(text: str) -> str:
    """`text` with every run of characters outside [A-Za-z0-9._-] replaced by one '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)
