"""The HDF5 feature cache: its schema, its fingerprint, atomic writing, and reading clients back as padded tensors.

Schema (format 1; every attribute that is not a number or string is a JSON string):

    /                                   attrs: featcache_format, featcache_version, key, manifest (JSON: everything
                                               that determines the embeddings), backbones (JSON list = concat order),
                                               classes, domains, partition, counts, versions, created
    /backbones/<bkey>                   attrs: name, weights, weights_sha256, dim, preprocessing (JSON)
    /clients/<c:03d>                    attrs: domain
    /clients/<c>/<split>/labels         [n] int64           split is 'train' or 'test'
    /clients/<c>/<split>/source_index   [n] int64           index into the dataset's domain split
    /clients/<c>/<split>/domain         [n] int16           index into root attr `domains`
    /clients/<c>/<split>/features/<bkey>  [n, D_b] float32  one per backbone
    /clients/<c>/<split>/features/concat  [n, sum D_b] float32, columns in `backbones` order
    /clients/<c>/train/views/<bkey>     [n, V, D_b] float32  only with --views V (augmented training views)
    /clients/<c>/train/views/concat     [n, V, sum D_b] float32
    /clients/<c>/train/val_index        [v] int64            positions in train held out for validation
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from . import __version__
from .errors import UserError

FORMAT = 1


def cache_key(manifest: dict) -> str:
    """sha256 of the canonical JSON of everything that determines the embeddings."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def cache_path(out: Path, dataset: str, key: str) -> Path:
    return Path(out) / f"{dataset}-{key[:16]}.h5"


def write_attrs(obj, attrs: dict) -> None:
    for name, value in attrs.items():
        obj.attrs[name] = value if isinstance(value, (int, float, str)) else json.dumps(value, sort_keys=True)


def read_attrs(obj) -> dict:
    out = {}
    for name, value in obj.attrs.items():
        value = value.decode() if isinstance(value, bytes) else value
        if isinstance(value, str) and value[:1] in "[{":
            value = json.loads(value)
        out[name] = value.item() if isinstance(value, np.generic) else value
    return out


def open_cache(path: str | Path) -> h5py.File:
    """Open a finished cache read-only, refusing files that are not featcache caches of this format."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"cache {path} does not exist: run `featcache extract` first (it prints the cache path)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"cache {path} is not a readable HDF5 file ({e}); delete it and run `featcache extract` again")
    fmt = f.attrs.get("featcache_format")
    if fmt != FORMAT:
        f.close()
        raise UserError(f"{path} has cache format {fmt!r}, this featcache reads format {FORMAT}: re-run `featcache extract`")
    return f


def info(path: str | Path) -> dict:
    """Metadata and per-client counts of a cache, JSON-able."""
    with open_cache(path) as f:
        meta = read_attrs(f)
        meta["backbone_info"] = {k: read_attrs(g) for k, g in f["backbones"].items()}
        meta["path"] = str(path)
        meta["bytes"] = os.path.getsize(path)
    return meta


@dataclass
class ClientData:
    """All clients of one split as padded tensors, with a leading client axis C."""

    features: torch.Tensor  # [C, Nmax, D] float32 (zeros past counts)
    labels: torch.Tensor  # [C, Nmax] int64 (-1 past counts)
    counts: torch.Tensor  # [C] int64
    num_classes: int
    views: torch.Tensor | None = None  # [C, Nmax, V, D] float32 augmented views, when cached and asked for

    def to(self, device) -> "ClientData":
        move = lambda t: None if t is None else t.to(device)
        return ClientData(move(self.features), move(self.labels), move(self.counts), self.num_classes, move(self.views))

    @property
    def mask(self) -> torch.Tensor:  # [C, Nmax] bool
        return torch.arange(self.features.shape[1], device=self.counts.device) < self.counts[:, None]


def _pad(arrays: list[np.ndarray], fill) -> torch.Tensor:
    n = max(len(a) for a in arrays)
    out = np.full((len(arrays), n, *arrays[0].shape[1:]), fill, dtype=arrays[0].dtype)  # [C, Nmax, ...]
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return torch.from_numpy(out)


def load_clients(
    path: str | Path, split: str = "train", backbones: list[str] | None = None, views: bool = False, holdout: str = "none"
) -> ClientData:
    """Read one split of every client as padded tensors.

    `backbones` picks a subset of cached backbones (default: all, i.e. the stored concatenation).
    `holdout` uses the validation positions of the train split: 'none' = all of train, 'fit' = train without the
    validation rows, 'val' = only the validation rows (split must be 'train' for the last two).
    """
    with open_cache(path) as f:
        order = json.loads(f.attrs["backbones"])
        wanted = backbones or order
        unknown = [b for b in wanted if b not in order]
        if unknown:
            raise UserError(f"cache {path} has no backbone {unknown[0]!r}; it holds {', '.join(order)}")
        group = "views" if views else "features"
        feats, labels = [], []
        view_list = []
        for name in sorted(f["clients"]):
            g = f["clients"][name][split]
            rows = _rows(g, holdout, split)
            x = g["features/concat"][...] if wanted == order else np.concatenate([g[f"features/{b}"][...] for b in wanted], -1)
            feats.append(x[rows])  # [n, D]
            labels.append(g["labels"][...][rows])  # [n]
            if views:
                if "views" not in g:
                    raise UserError(f"cache {path} has no augmented views: re-extract with --views 2")
                v = g["views/concat"][...] if wanted == order else np.concatenate([g[f"{group}/{b}"][...] for b in wanted], -1)
                view_list.append(v[rows])  # [n, V, D]
        counts = torch.tensor([len(y) for y in labels])
        return ClientData(
            features=_pad(feats, 0.0),
            labels=_pad(labels, -1),
            counts=counts,
            num_classes=len(json.loads(f.attrs["classes"])),
            views=_pad(view_list, 0.0) if views else None,
        )


def _rows(g, holdout: str, split: str) -> np.ndarray:
    n = g["labels"].shape[0]
    if holdout == "none":
        return np.arange(n)
    if split != "train":
        raise UserError(f"holdout={holdout!r} needs split 'train', got {split!r}")
    val = g["val_index"][...]
    if holdout == "val":
        return np.sort(val)
    if holdout == "fit":
        return np.setdiff1d(np.arange(n), val)
    raise UserError(f"holdout must be one of none, fit, val (got {holdout!r})")


def versions() -> dict:
    """Versions of the libraries whose numerics determine the embeddings."""
    import importlib.metadata as md

    out = {"featcache": __version__, "cache_format": FORMAT}
    for dist in ("torch", "torchvision", "timm", "numpy", "pillow"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out
