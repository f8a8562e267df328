"""HDF5 primitives shared by the client cache and the embedding store: attributes as numbers, strings or JSON, files
created without timestamps (the same inputs give the same bytes), arrays written and hashed in slices of rows, and
the checksums: `sha256` on every dataset (its array bytes in C order) and `meta_sha256` over everything else.
Nothing here knows a schema.

`walk` reads every object's metadata in one visit and `Tree` keeps each new object's entry as it creates it (`Rows`
fills a dataset row block by row block, hashing as it writes), both with h5py's low-level calls (a high-level `Group`
or `Dataset` per object costs several times the HDF5 work); the embedding store holds a group per block."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5o, h5p, h5s, h5t

from ..atomic import sync

CHECKSUM_ATTRS = ("sha256", "meta_sha256")
READ_BYTES = 1 << 24  # rows are written, hashed and checked in slices of about 16 MiB


def stored(value):
    """An attribute value as `write_attrs` stores it: numbers and strings as they are, anything else as JSON."""
    return value if isinstance(value, (int, float, str)) else json.dumps(value, sort_keys=True)


def write_attrs(obj, attrs: dict) -> None:
    for name, value in attrs.items():
        obj.attrs[name] = stored(value)


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
    return _plain(dict(obj.attrs.items()))


def _plain(attrs: dict) -> dict:
    out = {}
    for name, value in attrs.items():
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


SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the first bytes of an HDF5 file (no user block: featcache writes none)


def unopenable(path: Path) -> bool:
    """Whether the regular file `path` (a symbolic link is not followed) starts as an HDF5 file but HDF5 cannot open
    it: truncated or damaged, so whose it is (its root attributes) cannot be read."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            if f.read(len(SIGNATURE)) != SIGNATURE:
                return False
        with h5py.File(path, "r"):
            return False
    except Exception:
        return True


def create_h5(path: Path, align: int = 0) -> h5py.File:
    """A new HDF5 file as `h5py.File(path, "w", track_order=True)` creates it, but without HDF5's sieve buffer: raw
    data reaches the disk when a dataset is written, so a full disk fails that write. With the buffer the failure
    surfaces while datasets close, leaving them half-closed, and freeing them later crashes the interpreter. `align`:
    objects of that many bytes or more start at a multiple of it (rows read in place need their dtype's alignment)."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_sieve_buf_size(0)
    if align:
        fapl.set_alignment(align, align)
    fcpl = h5p.create(h5p.FILE_CREATE)
    order = h5p.CRT_ORDER_TRACKED | h5p.CRT_ORDER_INDEXED
    fcpl.set_link_creation_order(order)
    fcpl.set_attr_creation_order(order)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


@contextmanager
def written(path: Path, partial: Path, align: int = 0) -> Iterator[h5py.File]:
    """A new file (`create_h5`) at `partial`; when the block ends without error it is synced and renamed to `path`,
    so `path` exists only complete; on any error `partial` is removed."""
    try:
        with create_h5(partial, align) as f:
            yield f
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    sync(path.parent)


# -- creating objects ------------------------------------------------------------------------------------------------


@functools.cache
def _plists() -> tuple:
    """(group, dataset) creation property lists as h5py's `create_group` / `create_dataset(track_times=False)` make
    them: no timestamps, attributes not tracked by creation order."""
    gcpl = h5p.create(h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    dcpl.set_attr_creation_order(0)
    return gcpl, dcpl


@functools.cache
def _link_plist(cset: int):
    lcpl = h5p.create(h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(cset)
    return lcpl


def _new_group(loc, name: str):
    """A group as h5py's `create_group` makes it: its name ASCII where it can be, else UTF-8; missing groups on the
    way (`name` a path) made by HDF5."""
    try:
        data, cset = name.encode("ascii"), h5t.CSET_ASCII
    except UnicodeEncodeError:
        data, cset = name.encode("utf8"), h5t.CSET_UTF8
    return h5g.create(loc, data, lcpl=_link_plist(cset), gcpl=_plists()[0])


def _new_dataset(loc, name: str, shape: tuple, dtype: np.dtype):
    """An empty contiguous dataset, made as h5py's `create_dataset(name, shape, dtype, track_times=False)` makes it."""
    return h5d.create(loc, name.encode("utf8"), _type(dtype), h5s.create_simple(shape), dcpl=_plists()[1])


@functools.cache
def _type(dtype: np.dtype):
    return h5t.py_create(dtype, logical=1)


_STRING = h5py.string_dtype()  # a Python str as h5py stores it: variable-length UTF-8


@functools.cache
def _string_type(cset: int = h5t.CSET_UTF8, logical: bool = False):
    """The HDF5 type of a variable-length string in `cset`: in memory, or (`logical`) as stored."""
    return h5t.py_create(h5py.string_dtype("utf-8" if cset == h5t.CSET_UTF8 else "ascii"), logical=logical)


@functools.cache
def _scalar():
    return h5s.create_simple(())


def _string_attr(oid, name: str, value: str) -> None:
    """`obj.attrs[name] = value` for a str on an object that has no attribute `name`, as h5py stores it."""
    attr = h5a.create(oid, name.encode(), _string_type(logical=True), _scalar())
    try:
        attr.write(np.array(value, dtype=_STRING), mtype=_string_type())
    finally:
        attr.close()


def write_array(group: h5py.Group, name: str, data: np.ndarray) -> str:
    """`name` in `group` holding `data`, with its `sha256` (returned); missing groups on the way are made."""
    return _array(_parent(group.id, name), name.rpartition("/")[2], np.ascontiguousarray(data))


def write_columns(group: h5py.Group, name: str, blocks: Sequence, lead: tuple[int, ...], width: int) -> str:
    """`name` [*lead, width] float32: the column blocks side by side, written (and hashed) in slices of rows; returns
    its `sha256`. Each block is anything sliced by rows into a numpy array: an array, a memory map, an h5py dataset."""
    return _columns(_parent(group.id, name), name.rpartition("/")[2], blocks, lead, width)


def _array(loc, name: str, data: np.ndarray) -> str:
    ds = _new_dataset(loc, name, data.shape, data.dtype)
    ds.write(h5s.ALL, h5s.ALL, data)
    digest = hashlib.sha256(data).hexdigest()
    _string_attr(ds, "sha256", digest)
    return digest


def _columns(loc, name: str, blocks: Sequence, lead: tuple[int, ...], width: int) -> str:
    if [b.shape[:-1] for b in blocks] != [lead] * len(blocks) or sum(b.shape[-1] for b in blocks) != width:
        raise ValueError(f"{name}: column blocks {[b.shape for b in blocks]} do not make [{lead}, {width}]")
    shape = (*lead, width)
    ds = _new_dataset(loc, name, shape, np.dtype("<f4"))
    digest, step = hashlib.sha256(), _rows_per_slice(shape, 4)
    for r in range(0, lead[0], step):
        rows = np.concatenate([np.asarray(b[r : r + step], "<f4") for b in blocks], -1)  # [k, ..., D]
        if len(rows) == lead[0]:  # all of it at once
            ds.write(h5s.ALL, h5s.ALL, rows)
        else:
            space = ds.get_space()
            space.select_hyperslab((r,) + (0,) * len(lead), rows.shape)
            ds.write(h5s.create_simple(rows.shape), space, rows)
        digest.update(rows)
    _string_attr(ds, "sha256", digest.hexdigest())
    return digest.hexdigest()


def _parent(loc, name: str):
    """The group that holds `name` (a path relative to `loc`), its missing groups made on the way."""
    for part in name.split("/")[:-1]:
        data = part.encode("utf8")
        loc = h5g.open(loc, data) if loc.links.exists(data) else _new_group(loc, part)
    return loc


class _Held:
    """A low-level object id where h5py's `AttributeManager` takes an object."""

    def __init__(self, oid) -> None:
        self.id = oid

    @property
    def attrs(self) -> h5py.AttributeManager:
        return h5py.AttributeManager(self)


class Tree:
    """Builds a new file: groups and datasets made with h5py's low-level calls, each object's `meta_sha256` entry kept
    as it is made, so the metadata checksum of what was written needs no second pass over the file (only the root's
    attributes are read back). Paths are relative to the root; missing parent groups are made on the way."""

    def __init__(self, f: h5py.File) -> None:
        self.f = f
        self.entries: dict[str, list] = {}  # path -> [kind, attributes as `plain_attrs` reads them]
        self._open: dict[str, object] = {}  # path -> GroupID: the last group made and its parents

    def group(self, path: str, attrs: dict | None = None) -> None:
        """A new group at `path` holding `attrs` (`write_attrs`' values), its missing parents made with it in one call,
        as h5py's `create_group(path)` makes them."""
        known = path.rpartition("/")[0]
        while known and known not in self.entries:
            known = known.rpartition("/")[0]
        gid = _new_group(self._group(known), path[len(known) + 1 :] if known else path)
        write_attrs(_Held(gid), attrs or {})
        self._open = {p: g for p, g in self._open.items() if path.startswith(p + "/")} | {path: gid}
        parts = path.split("/")
        for i in range(len(known.split("/")) + 1 if known else 1, len(parts)):
            self.entries["/".join(parts[:i])] = ["group", {}]
        self.entries[path] = ["group", {k: stored(v) for k, v in (attrs or {}).items()}]

    def array(self, path: str, data: np.ndarray) -> None:
        """A dataset at `path` holding `data`, with its `sha256` (`write_array`)."""
        data = np.ascontiguousarray(data)
        parent, _, name = path.rpartition("/")
        digest = _array(self._group(parent), name, data)
        self.entries[path] = [f"dataset {data.dtype.str} {list(data.shape)} {digest}", {}]

    def columns(self, path: str, blocks: Sequence, lead: tuple[int, ...], width: int) -> None:
        """A float32 dataset at `path`, the column blocks side by side (`write_columns`)."""
        parent, _, name = path.rpartition("/")
        digest = _columns(self._group(parent), name, blocks, lead, width)
        self.entries[path] = [f"dataset {np.dtype('<f4').str} {[*lead, width]} {digest}", {}]

    def rows(self, path: str, shape: tuple, dtype) -> "Rows":
        """An empty dataset at `path` of `shape`, filled in order of its leading rows (`Rows`)."""
        parent, _, name = path.rpartition("/")
        return Rows(self, path, _new_dataset(self._group(parent), name, tuple(shape), np.dtype(dtype)))

    def meta_sha256(self) -> str:
        """`meta_sha256` of the file as built so far."""
        return _digest(["/", "group", plain_attrs(self.f)], sorted(self.entries.items()))

    def _group(self, path: str):
        if not path:
            return self.f.id
        if path not in self._open:
            if path in self.entries:
                self._open[path] = h5g.open(self.f.id, path.encode("utf8"))
            else:
                self.group(path)
        return self._open[path]


class Rows:
    """A new dataset (`Tree.rows`) filled by `add` in order of its leading rows, hashed as they are written; `close`
    checks it is full and stores its `sha256` (and its `meta_sha256` entry in the Tree)."""

    def __init__(self, tree: Tree, path: str, ds) -> None:
        self.tree, self.path, self.ds = tree, path, ds
        self.shape, self.dtype = ds.shape, ds.dtype
        self.at = 0  # rows written
        self.digest = hashlib.sha256()

    def add(self, rows: np.ndarray) -> None:
        """Write `rows` [k, ...] after the rows written so far."""
        rows = np.ascontiguousarray(rows, self.dtype)
        if rows.shape[1:] != self.shape[1:] or self.at + len(rows) > self.shape[0]:
            raise ValueError(f"{self.path}: rows {rows.shape} do not fit {self.shape} after {self.at} rows")
        if len(rows):
            space = self.ds.get_space()
            space.select_hyperslab((self.at,) + (0,) * (len(self.shape) - 1), rows.shape)
            self.ds.write(h5s.create_simple(rows.shape), space, rows)
            self.digest.update(rows)
            self.at += len(rows)

    def add_columns(self, blocks: Sequence, n: int) -> None:
        """Write `n` rows made of the column blocks side by side (each [n, ..., D_j], anything sliced by rows into a
        numpy array), in slices of about `READ_BYTES`."""
        if [b.shape[0] for b in blocks] != [n] * len(blocks) or sum(b.shape[-1] for b in blocks) != self.shape[-1]:
            raise ValueError(f"{self.path}: column blocks {[b.shape for b in blocks]} do not make {n} rows of it")
        step = _rows_per_slice(self.shape, self.dtype.itemsize)
        for r in range(0, n, step):
            self.add(np.concatenate([np.asarray(b[r : r + step], self.dtype) for b in blocks], -1))  # [k, ..., D]

    def close(self) -> str:
        """Store the `sha256` of a full dataset; returns it."""
        if self.at != self.shape[0]:
            raise ValueError(f"{self.path}: {self.at} rows written of {self.shape[0]}")
        digest = self.digest.hexdigest()
        _string_attr(self.ds, "sha256", digest)
        self.tree.entries[self.path] = [f"dataset {self.dtype.str} {list(self.shape)} {digest}", {}]
        return digest


def rows_per_slice(ds) -> int:
    """How many leading rows of `ds` (an h5py dataset or its low-level id) make about `READ_BYTES` (at least one)."""
    return _rows_per_slice(ds.shape, ds.dtype.itemsize)


def _rows_per_slice(shape: tuple, itemsize: int) -> int:
    return max(READ_BYTES // max(itemsize * int(np.prod(shape[1:])), 1), 1)


# -- reading ---------------------------------------------------------------------------------------------------------


def objects(f: h5py.File, kind: type | None = None) -> list[tuple[str, object]]:
    """(path, object) of every group and dataset below the root (or only those of `kind`), sorted by path."""
    found = []

    def visit(name: str, obj) -> None:
        if kind is None or isinstance(obj, kind):
            found.append((name, obj))

    f.visititems(visit)
    return sorted(found, key=lambda item: item[0])


@dataclass
class Node:
    """One object as `walk` reads it: whether it is a dataset, its dtype and shape (datasets), its attributes as h5py
    reads them, and its low-level id (None for a group without attributes, which is not opened)."""

    dataset: bool
    dtype: np.dtype | None
    shape: tuple | None
    attrs: dict
    id: object = None
    data: np.ndarray | None = None  # the array, once `read`

    def read(self) -> np.ndarray:
        """The whole array of a dataset in its stored dtype, read once and kept (for small arrays: the index arrays
        a check reads and the load that follows uses)."""
        if self.data is None:
            self.data = np.empty(self.shape, self.dtype)
            if self.data.size:
                self.id.read(h5s.ALL, h5s.ALL, self.data)
        return self.data


def dataset_id(f: h5py.File, path: str):
    """The low-level id of the dataset at `path`."""
    return h5d.open(f.id, path.encode("utf8"))


def walk(f: h5py.File) -> dict[str, Node]:
    """Every object of `f` by path, sorted ('/' the root first): one visit of the file (the objects `objects` and
    `visititems` reach, as `visititems` names them), each dataset or object with attributes opened once and its
    attributes read once."""
    found: list[tuple[bytes, int, int]] = []
    h5o.visit(f.id, lambda name, info: found.append((name, info.type, info.num_attrs)), info=True)
    nodes = {"/": Node(False, None, None, _attrs(f.id), f.id)}
    for name, raw, kind, count in sorted((f._d(raw), raw, kind, count) for raw, kind, count in found):
        if kind == h5o.TYPE_DATASET:
            oid = h5o.open(f.id, raw)
            nodes[name] = Node(True, oid.dtype, oid.shape, _attrs(oid, count) if count else {}, oid)
        elif count:
            oid = h5o.open(f.id, raw)
            nodes[name] = Node(False, None, None, _attrs(oid, count), oid)
        else:
            nodes[name] = Node(False, None, None, {})
    return nodes


def _attrs(oid, count: int | None = None) -> dict:
    """Every attribute of the object `oid` (`count` of them, when known), as h5py's `obj.attrs[name]` reads it."""
    out = {}
    for i in range(h5a.get_num_attrs(oid) if count is None else count):
        attr = h5a.open(oid, index=i)
        name = attr.name
        try:
            name = name.decode("utf8")
        except UnicodeDecodeError:
            pass
        out[name] = _attr_value(attr)
    return out


def _attr_value(attr):
    """h5py's `AttributeManager.__getitem__` on an open attribute (a scalar variable-length string, what featcache
    writes, read with fewer calls)."""
    tid = attr.get_type()
    if (
        isinstance(tid, h5t.TypeStringID)
        and tid.is_variable_str()
        and attr.get_space().get_simple_extent_type() == h5s.SCALAR
    ):
        arr = np.empty((), _STRING)
        attr.read(arr, mtype=_string_type(tid.get_cset()))
        value = arr[()]
        return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
    shape = attr.shape
    if shape is None:
        return h5py.Empty(attr.dtype)
    dtype = attr.dtype
    htype = h5t.py_create(dtype)
    if dtype.subdtype is not None:
        dtype, sub = dtype.subdtype
        shape = shape + sub
    arr = np.zeros(shape, dtype=dtype, order="C")
    attr.read(arr, mtype=htype)
    string = h5t.check_string_dtype(dtype)
    if string and string.length is None:
        arr = np.array([b.decode("utf-8", "surrogateescape") for b in arr.flat], dtype=dtype).reshape(arr.shape)
    return arr[()] if arr.ndim == 0 else arr


def scan(ds) -> tuple[str, bool]:
    """(sha256 of the array bytes in C order, whether every value is finite), reading slices of rows; `ds` is an h5py
    dataset or its low-level id."""
    dsid = ds.id if isinstance(ds, h5py.Dataset) else ds
    h = hashlib.sha256()
    finite = True
    step = rows_per_slice(dsid)
    for r in range(0, dsid.shape[0], step):
        block = read_rows(dsid, r, min(r + step, dsid.shape[0]))  # [rows, ...]
        h.update(block)
        finite = finite and (block.dtype.kind != "f" or bool(np.isfinite(block).all()))
    return h.hexdigest(), finite


def read_into(dsid, start: int, out: np.ndarray) -> None:
    """out[:] = rows [start, start + len(out)) of the low-level dataset `dsid` (`out` C-contiguous, its dtype)."""
    if out.size:
        space = dsid.get_space()
        space.select_hyperslab((start,) + (0,) * (out.ndim - 1), out.shape)
        dsid.read(h5s.create_simple(out.shape), space, out)


def read_rows(dsid, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the low-level dataset `dsid`, in its stored dtype."""
    shape = (stop - start, *dsid.shape[1:])
    out = np.empty(shape, dsid.dtype)
    if out.size:
        space = dsid.get_space()
        space.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
        dsid.read(h5s.create_simple(shape), space, out)
    return out


def meta_sha256(f: h5py.File, bind_data: bool = True, nodes: dict[str, Node] | None = None) -> str:
    """sha256 over every object's path, kind (dtype and shape for datasets) and attributes; with `bind_data` each
    dataset's own `sha256` is part of its entry, so an array moved to another path (one client's features swapped
    with another's of the same shape) no longer matches. Without it: the metadata checksum of cache format 2.
    `nodes`: the file's `walk`, when the caller has it."""
    nodes = walk(f) if nodes is None else nodes
    entries = []
    for name, node in nodes.items():
        if name == "/":
            continue
        kind = "group"
        if node.dataset:
            kind = f"dataset {node.dtype.str} {list(node.shape)}"
            if bind_data:
                kind += f" {plain(node.attrs.get('sha256'))}"
        entries.append((name, [kind, _plain(node.attrs)]))
    return _digest(["/", "group", _plain(nodes["/"].attrs)], entries)


def _digest(root: list, entries: list[tuple[str, list]]) -> str:
    """The metadata checksum of the root's entry and the other objects' (path, [kind, attributes]), sorted by path."""
    rows = [root] + [[name, kind, attrs] for name, (kind, attrs) in entries]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def seal(f: h5py.File) -> None:
    """Recompute every checksum of a file opened for writing (`sha256` on every dataset, then `meta_sha256`), after
    it was edited in place; the writers compute them as they write."""
    for _, ds in objects(f, h5py.Dataset):
        ds.attrs["sha256"] = scan(ds)[0]
    f.attrs["meta_sha256"] = meta_sha256(f)
