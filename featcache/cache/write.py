"""Writing a client cache (`write`, used by `extract` and the test fixtures) in the schema the package docstring
(featcache/cache/__init__.py) states."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from .. import __version__
from ..errors import UserError
from .h5 import Rows, Tree, rows_per_slice, write_attrs, written

MARKER = "featcache_format"  # the root attribute that marks a file as featcache's client cache; its value: the format
# 2: checksums (`sha256` on every dataset, `meta_sha256` on the root); 3: features stored once (`concat`); 4: every
# client's rows of a split in one dataset, a client's rows found by `offsets`
FORMAT = 4
SPLITS = ("train", "test")
FEATURE_GROUPS = ("features", "views")  # each holds one dataset, `concat`
HEADER = ("key", "manifest", "dataset", "classes", "domains", "partition", "counts", "views", "versions")
ROOT_ATTRS = (MARKER, "featcache_version", *HEADER, "backbones", "images", "meta_sha256")
BACKBONE_ATTRS = ("name", "weights", "weights_sha256", "dim", "columns", "preprocessing")
INDEX_DTYPES = {"labels": "int64", "source_index": "int64", "domain": "int16"}


def cache_path(out: Path, dataset: str, key: str) -> Path:
    return Path(out) / f"{dataset}-{key[:16]}.h5"


@dataclass
class Split:
    """One client's split as `write` takes it. `features` are column blocks that `write` puts side by side into
    `concat`: one per backbone (extract), or one holding every column (fixtures, `migrate`). Each is anything sliced
    by rows into a numpy array: an array, a memory map, an h5py dataset."""

    labels: np.ndarray  # [n] int
    source_index: np.ndarray  # [n] int
    features: Sequence  # each [n, D_j] float32, sum D_j = the backbones' dims
    views: Sequence | None = None  # each [n, V, D_j] float32 (train, with --views V)
    domain: str | None = None  # the rows' domain when not the client's (a held-out test domain)


@dataclass
class Client:
    domain: str
    train: Split
    test: Split
    val_index: np.ndarray  # [v] int: positions in train held out for validation


def write(
    path: str | Path,
    header: dict,
    backbones: list[dict],
    clients: Iterable[Client],
    partial: str | Path | None = None,
    replace: bool = False,
) -> int:
    """Write a cache: into `partial` (default `.NAME.partial` beside `path`), hashing every array from the bytes it
    writes, then synced and renamed to `path`, so `path` exists only complete; returns the number of images.

    `header` holds the root attributes `HEADER` (and may add others), its `counts` each client's rows by split (the
    datasets' sizes: a client that holds other counts is refused); `backbones` each backbone's `key`, `name`,
    `weights`, `weights_sha256`, `dim` and `preprocessing`, in column order; `clients` may be a generator, consumed
    once in client order, each client's rows written as it comes. An existing `path` is refused unless `replace`. No
    timestamps: the same inputs give a byte-identical file."""
    path = Path(path)
    partial = Path(partial) if partial else path.with_name(f".{path.name}.partial")
    if path.exists() and not replace:
        raise UserError(f"{path} already exists: delete it or write the cache elsewhere")
    missing = [k for k in HEADER if k not in header]
    if missing:
        raise ValueError(f"cache header lacks {', '.join(missing)}")
    with written(path, partial) as f:
        images = _write_file(f, header, backbones, clients)
    return images


def _write_file(f: h5py.File, header: dict, backbones: list[dict], clients: Iterable[Client]) -> int:
    width = sum(int(b["dim"]) for b in backbones)
    write_attrs(
        f, header | {MARKER: FORMAT, "featcache_version": __version__, "backbones": [b["key"] for b in backbones]}
    )
    tree = Tree(f)
    start = 0
    for b in backbones:
        attrs = {k: v for k, v in b.items() if k != "key"} | {"columns": [start, start + int(b["dim"])]}
        tree.group(f"backbones/{b['key']}", attrs)
        start += int(b["dim"])
    rows = header["counts"]["clients"]  # the rows each client holds, by split: the datasets' sizes
    views = int(header["views"])
    streams = {}
    for split in SPLITS:
        n = sum(int(row[split]) for row in rows)
        streams[split, "features"] = _Batched(tree.rows(f"{split}/features/concat", (n, width), "<f4"))
        if views and split == "train":
            streams[split, "views"] = _Batched(tree.rows(f"{split}/views/concat", (n, views, width), "<f4"))
    domains = list(header["domains"])
    index: dict[tuple[str, str], list] = {(s, k): [] for s in SPLITS for k in INDEX_DTYPES} | {
        ("train", "val_index"): []
    }
    c = -1
    for c, client in enumerate(clients):
        if c >= len(rows):
            raise ValueError(f"more clients than the header's counts list ({len(rows)})")
        for split in SPLITS:
            s = getattr(client, split)
            n = len(s.labels)
            if n != int(rows[c][split]):
                raise ValueError(f"client {c} holds {n} {split} rows, the header's counts say {rows[c][split]}")
            index[split, "labels"].append(s.labels)
            index[split, "source_index"].append(s.source_index)
            index[split, "domain"].append(np.full(n, domains.index(s.domain or client.domain)))
            streams[split, "features"].add(s.features, n)
            if (split, "views") in streams:
                streams[split, "views"].add(s.views, n)
        if len(client.val_index) != int(rows[c]["val"]):
            raise ValueError(
                f"client {c} holds {len(client.val_index)} validation rows, the counts say {rows[c]['val']}"
            )
        index["train", "val_index"].append(client.val_index)
    if c + 1 != len(rows):
        raise ValueError(f"{c + 1} clients, the header's counts list {len(rows)}")
    for stream in streams.values():
        stream.close()
    for (split, name), parts in index.items():
        dtype = INDEX_DTYPES.get(name, "int64")
        tree.array(f"{split}/{name}", np.concatenate([np.asarray(p, dtype) for p in parts] or [np.empty(0, dtype)]))
    for split in SPLITS:
        tree.array(f"{split}/offsets", offsets([int(row[split]) for row in rows]))
    tree.array("train/val_offsets", offsets([len(v) for v in index["train", "val_index"]]))
    images = sum(int(row[split]) for row in rows for split in SPLITS)
    f.attrs["images"] = images
    f.attrs["meta_sha256"] = tree.meta_sha256()
    return images


def offsets(counts: list[int]) -> np.ndarray:
    """[C + 1] int64: client c's rows of a split are rows offsets[c]:offsets[c + 1] of its datasets."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


class _Batched:
    """A `Rows` dataset filled client after client, the rows of consecutive small clients written as one slice of
    about `h5.READ_BYTES` (one HDF5 write and hash update per slice, not per client: 1,000 clients cost what their
    bytes cost); a client of a slice or more is written alone, slice by slice. The bytes are the same either way."""

    def __init__(self, rows: Rows) -> None:
        self.rows, self.step = rows, rows_per_slice(rows.ds)
        self.waiting: list[tuple[Sequence, int]] = []  # (column blocks, rows) of the clients not written yet
        self.held = 0  # their rows

    def add(self, blocks: Sequence, n: int) -> None:
        """Queue `n` rows made of the column blocks side by side (each [n, ..., D_j]); written when a slice is full."""
        lead, width = (n, *self.rows.shape[1:-1]), self.rows.shape[-1]
        if [tuple(b.shape[:-1]) for b in blocks] != [lead] * len(blocks) or sum(b.shape[-1] for b in blocks) != width:
            raise ValueError(f"{self.rows.path}: column blocks {[b.shape for b in blocks]} do not make {n} rows of it")
        if n >= self.step or not self.rows.at:  # HDF5 places a dataset's bytes at its first write: done at once, as
            self.flush()  # the per-client writer did, the file's layout is that writer's
            self.rows.add_columns(blocks, n)
            return
        self.waiting.append((blocks, n))
        self.held += n
        if self.held >= self.step:
            self.flush()

    def flush(self) -> None:
        out = np.empty((self.held, *self.rows.shape[1:]), self.rows.dtype)  # [k, ..., D] the waiting clients' rows
        at = 0
        for blocks, n in self.waiting:
            col = 0
            for b in blocks:
                out[at : at + n, ..., col : col + b.shape[-1]] = np.asarray(b[:n])
                col += b.shape[-1]
            at += n
        self.rows.add(out)
        self.waiting, self.held = [], 0

    def close(self) -> str:
        self.flush()
        return self.rows.close()
