"""HDF5 primitives shared by the client cache and the embedding store: attributes as numbers, strings or JSON, files
created without timestamps (the same inputs give the same bytes), arrays written and hashed in slices of rows, and
the checksums: `sha256` on every dataset (its array bytes in C order) and `meta_sha256` over everything else.
Nothing here knows a schema."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

from ..atomic import sync

CHECKSUM_ATTRS = ("sha256", "meta_sha256")
READ_BYTES = 1 << 24  # rows are written, hashed and checked in slices of about 16 MiB


def write_attrs(obj, attrs: dict) -> None:
    for name, value in attrs.items():
        obj.attrs[name] = value if isinstance(value, (int, float, str)) else json.dumps(value, sort_keys=True)


def read_attrs(obj) -> dict:
    out = {}
    for name, value in obj.attrs.items():
        value = value.decode() if isinstance(value, bytes) else value
        if isinstance(value, str) and value[:1] in ("[", "{"):
            value = json.loads(value)
        out[name] = value.item() if isinstance(value, np.generic) else value
    return out


def plain(value):
    """An attribute value as a Python str or number (arrays are left as they are)."""
    value = value.decode() if isinstance(value, bytes) else value
    return value.item() if isinstance(value, np.generic) else value


def plain_attrs(obj) -> dict:
    """The attributes of `obj` but the checksums, JSON-able: arrays as lists, JSON left as its string."""
    out = {}
    for name, value in obj.attrs.items():
        if name not in CHECKSUM_ATTRS:
            value = value.decode() if isinstance(value, bytes) else value
            out[name] = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    return out


def peek_attrs(path: Path, names: tuple[str, ...], follow: bool = True) -> dict | None:
    """Those of the root attributes `names` that the HDF5 file `path` has, as `plain` values; None when `path` is not
    a regular file (a folder, a FIFO or device: nothing is opened that could block; a symbolic link unless `follow`)
    or not an HDF5 file this library can open."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
        if not stat.S_ISREG(mode):
            return None
        with h5py.File(path, "r") as f:
            return {name: plain(f.attrs[name]) for name in names if name in f.attrs}
    except Exception:  # not HDF5, truncated, locked by a writer: a file nobody can show to be featcache's
        return None


def create_h5(path: Path) -> h5py.File:
    """A new HDF5 file as `h5py.File(path, "w", track_order=True)` creates it, but without HDF5's sieve buffer: raw
    data reaches the disk when a dataset is written, so a full disk fails that write. With the buffer the failure
    surfaces while datasets close, leaving them half-closed, and freeing them later crashes the interpreter."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_sieve_buf_size(0)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    order = h5py.h5p.CRT_ORDER_TRACKED | h5py.h5p.CRT_ORDER_INDEXED
    fcpl.set_link_creation_order(order)
    fcpl.set_attr_creation_order(order)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


@contextmanager
def written(path: Path, partial: Path) -> Iterator[h5py.File]:
    """A new file (`create_h5`) at `partial`; when the block ends without error it is synced and renamed to `path`,
    so `path` exists only complete; on any error `partial` is removed."""
    try:
        with create_h5(partial) as f:
            yield f
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    sync(path.parent)


def write_array(group: h5py.Group, name: str, data: np.ndarray) -> None:
    """`name` in `group` holding `data`, with its `sha256`."""
    data = np.ascontiguousarray(data)
    ds = group.create_dataset(name, data=data, track_times=False)
    ds.attrs["sha256"] = hashlib.sha256(data).hexdigest()


def write_columns(group: h5py.Group, name: str, blocks: Sequence, lead: tuple[int, ...], width: int) -> None:
    """`name` [*lead, width] float32: the column blocks side by side, written (and hashed) in slices of rows. Each
    block is anything sliced by rows into a numpy array: an array, a memory map, an h5py dataset."""
    if [b.shape[:-1] for b in blocks] != [lead] * len(blocks) or sum(b.shape[-1] for b in blocks) != width:
        raise ValueError(f"{name}: column blocks {[b.shape for b in blocks]} do not make [{lead}, {width}]")
    ds = group.create_dataset(name, (*lead, width), "<f4", track_times=False)
    digest, step = hashlib.sha256(), rows_per_slice(ds)
    for r in range(0, lead[0], step):
        rows = np.concatenate([np.asarray(b[r : r + step], "<f4") for b in blocks], -1)  # [k, ..., D]
        ds[r : r + len(rows)] = rows
        digest.update(rows)
    ds.attrs["sha256"] = digest.hexdigest()


def rows_per_slice(ds) -> int:
    """How many leading rows of `ds` make about `READ_BYTES` (at least one)."""
    return max(READ_BYTES // max(ds.dtype.itemsize * int(np.prod(ds.shape[1:])), 1), 1)


def objects(f: h5py.File, kind: type | None = None) -> list[tuple[str, object]]:
    """(path, object) of every group and dataset below the root (or only those of `kind`), sorted by path."""
    found = []

    def visit(name: str, obj) -> None:
        if kind is None or isinstance(obj, kind):
            found.append((name, obj))

    f.visititems(visit)
    return sorted(found, key=lambda item: item[0])


def scan(ds: h5py.Dataset) -> tuple[str, bool]:
    """(sha256 of the array bytes in C order, whether every value is finite), reading slices of rows."""
    h = hashlib.sha256()
    finite = True
    step = rows_per_slice(ds)
    for r in range(0, ds.shape[0], step):
        block = ds[r : r + step]  # [rows, ...]
        h.update(np.ascontiguousarray(block).tobytes())
        finite = finite and (block.dtype.kind != "f" or bool(np.isfinite(block).all()))
    return h.hexdigest(), finite


def meta_sha256(f: h5py.File, bind_data: bool = True) -> str:
    """sha256 over every object's path, kind (dtype and shape for datasets) and attributes; with `bind_data` each
    dataset's own `sha256` is part of its entry, so an array moved to another path (one client's features swapped
    with another's of the same shape) no longer matches. Without it: the metadata checksum of cache format 2."""
    entries = [["/", "group", plain_attrs(f)]]
    for name, obj in objects(f):
        kind = f"dataset {obj.dtype.str} {list(obj.shape)}" if isinstance(obj, h5py.Dataset) else "group"
        if bind_data and isinstance(obj, h5py.Dataset):
            kind += f" {plain(obj.attrs.get('sha256'))}"
        entries.append([name, kind, plain_attrs(obj)])
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def seal(f: h5py.File) -> None:
    """Recompute every checksum of a file opened for writing (`sha256` on every dataset, then `meta_sha256`), after
    it was edited in place; the writers compute them as they write."""
    for _, ds in objects(f, h5py.Dataset):
        ds.attrs["sha256"] = scan(ds)[0]
    f.attrs["meta_sha256"] = meta_sha256(f)
