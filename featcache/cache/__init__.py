"""The HDF5 feature cache: the one place that knows its schema. It writes a cache (`write`, used by `extract` and
the test fixtures), reads it back as padded client tensors with its metadata (`load_clients`), checks it (`verify`,
`info`) and converts older formats (`migrate`).

Schema (format 3; every attribute that is not a number or string is a JSON string):

    /                                   attrs: featcache_format, featcache_version, key, manifest (JSON: everything
                                               that determines the embeddings), backbones (JSON list = column order),
                                               classes, domains, dataset, partition, counts, views, versions, images,
                                               meta_sha256
    /backbones/<bkey>                   attrs: name, weights, weights_sha256, dim, columns ([start, stop) of its
                                               features in `concat`), preprocessing (JSON)
    /clients/<c:03d>                    attrs: domain
    /clients/<c>/<split>/labels         [n] int64           split is 'train' or 'test'
    /clients/<c>/<split>/source_index   [n] int64           index into the dataset's domain split
    /clients/<c>/<split>/domain         [n] int16           index into root attr `domains`
    /clients/<c>/<split>/features/concat  [n, sum D_b] float32  every backbone's features side by side
    /clients/<c>/train/views/concat     [n, V, sum D_b] float32  only with --views V (augmented training views)
    /clients/<c>/train/val_index        [v] int64            positions in train held out for validation

The features exist once, as `concat`; backbone b is its columns `columns` (`x[..., start:stop]`). Of the layouts
that keep `f[".../features/concat"][...]` working (this one; per-backbone datasets concatenated at load time; an
HDF5 virtual dataset over per-backbone datasets) it reads all backbones, what training reads by default, fastest: one
contiguous read per client and no copy. One backbone's columns are a strided read, slower than a dataset of their
own would be, still faster than reading every column (bench/extract.py, figure 5, measures all of them). Format 2
stored every backbone's features twice (a dataset of its own, and in `concat`); `migrate` converts it.

Every dataset carries `sha256`, the sha256 of its array bytes (C order), computed by the writer from the bytes it
writes, and the root `meta_sha256` covers the rest: every object's path, kind, dtype, shape and attributes. `verify`
recomputes both and checks the schema, the counts against the stored partition counts, the column ranges, and that
features are finite. `load_clients` checks the same on the first load of a file in a process, the feature arrays on
the very read that fills the tensors, so every feature byte is read once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np
import torch

from .. import __version__
from ..atomic import output_errors
from ..errors import UserError
from ..extraction.identity import content_key

FORMAT = 3  # 2: checksums (`sha256` on every dataset, `meta_sha256` on the root); 3: features stored once (`concat`)
_CHECKSUM_ATTRS = ("sha256", "meta_sha256")
_READ_BYTES = 1 << 24  # rows are written, hashed and checked in slices of about 16 MiB
SPLITS = ("train", "test")
FEATURE_GROUPS = ("features", "views")  # each holds one dataset, `concat`
_HEADER = ("key", "manifest", "dataset", "classes", "domains", "partition", "counts", "views", "versions")
_ROOT_ATTRS = ("featcache_format", "featcache_version", *_HEADER, "backbones", "images", "meta_sha256")
_BACKBONE_ATTRS = ("name", "weights", "weights_sha256", "dim", "columns", "preprocessing")
_INDEX_DTYPES = {"labels": "int64", "source_index": "int64", "domain": "int16"}


def cache_path(out: Path, dataset: str, key: str) -> Path:
    return Path(out) / f"{dataset}-{key[:16]}.h5"


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


def read_meta(f: h5py.File) -> dict:
    """The root attributes, plus `backbone_info`: each backbone's attributes by key."""
    return read_attrs(f) | {"backbone_info": {k: read_attrs(g) for k, g in f["backbones"].items()}}


def _read_only(path: Path, missing_fix: str) -> h5py.File:
    """`path` opened read-only with h5py; a missing file (`missing_fix` says what to do) or one that is not HDF5 is
    one UserError line."""
    if not path.is_file():
        raise UserError(f"cache {path} does not exist: {missing_fix}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"cache {path} is not a readable HDF5 file ({e}); delete it and run `featcache extract` again")


def open_cache(path: str | Path) -> h5py.File:
    """Open a finished cache read-only, refusing files that are not featcache caches of this format."""
    path = Path(path)
    f = _read_only(path, "run `featcache extract` first (it prints the cache path)")
    fmt = _plain(f.attrs.get("featcache_format"))
    if fmt != FORMAT:
        wrote = _plain(f.attrs.get("featcache_version", "an unknown version"))
        f.close()
        how = f"run `featcache migrate {path}` to convert it in place, or " if fmt in _MIGRATIONS else ""
        raise UserError(f"{path} has cache format {fmt!r} (written by featcache {wrote}), this featcache {__version__} "
                        f"reads format {FORMAT}: {how}re-run `featcache extract` with the same options to rebuild it")
    return f


def _plain(value):
    value = value.decode() if isinstance(value, bytes) else value
    return value.item() if isinstance(value, np.generic) else value


def info(path: str | Path) -> dict:
    """Metadata and per-client counts of a cache, JSON-able. A cache whose metadata is damaged (no `backbones`
    group, an attribute that is not JSON or is an array, counts of the wrong shape) is one UserError line."""
    with open_cache(path) as f:
        try:
            if "backbones" not in f or not isinstance(f["backbones"], h5py.Group):
                raise ValueError("it has no backbones group")
            meta = read_meta(f)
            problem = _info_problem(meta)
        except json.JSONDecodeError as e:
            problem = f"an attribute is not valid JSON ({e})"
        except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
            problem = (str(e).splitlines() or [type(e).__name__])[0]
        if problem:
            raise UserError(f"cache {path} is damaged: {problem}; run `featcache verify {path}`, then delete it and "
                            "re-run `featcache extract`")
        meta["path"] = str(path)
        meta["bytes"] = os.path.getsize(path)
    return meta


def _info_problem(meta: dict) -> str | None:
    """What `featcache info` cannot render in a cache's metadata (None when nothing)."""
    for k, v in meta.items():
        if isinstance(v, (np.ndarray, np.generic)):
            return f"attribute {k!r} is an array, not a number, string or JSON"
        if k != "backbone_info":
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                return f"attribute {k!r} is not JSON"
    for k, b in meta["backbone_info"].items():
        if not isinstance(b, dict) or any(not isinstance(b.get(a), t) for a, t in
                                           (("name", str), ("dim", int), ("weights", str), ("weights_sha256", str))):
            return f"backbones/{k} lacks one of name, dim, weights, weights_sha256"
        if isinstance(b.get("dim"), bool):
            return f"backbones/{k} has a dim that is not a number"
        for a, v in b.items():
            if isinstance(v, (np.ndarray, np.generic)):
                return f"backbones/{k} attribute {a!r} is an array"
    counts = meta.get("counts")
    rows = counts.get("clients") if isinstance(counts, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(c in r for c in
                                             ("client", "domain", "train", "val", "test")) for r in rows):
        return "attribute 'counts' is not {clients: [{client, domain, train, val, test}, ...]}"
    return None


# -- writing ------------------------------------------------------------------------------------------------------


@dataclass
class Split:
    """One client's split as `write` takes it. `features` are column blocks that `write` puts side by side into
    `concat`: one per backbone (extract), or one holding every column (fixtures, `migrate`). Each is anything sliced
    by rows into a numpy array: an array, a memory map, an h5py dataset."""

    labels: np.ndarray  # [n] int
    source_index: np.ndarray  # [n] int
    features: Sequence  # each [n, D_j] float32, sum D_j = the backbones' dims
    views: Sequence | None = None  # each [n, V, D_j] float32 (train, with --views V)


@dataclass
class Client:
    domain: str
    train: Split
    test: Split
    val_index: np.ndarray  # [v] int: positions in train held out for validation


def write(path: str | Path, header: dict, backbones: list[dict], clients: Iterable[Client],
          partial: str | Path | None = None, replace: bool = False) -> int:
    """Write a cache: into `partial` (default `.NAME.partial` beside `path`), hashing every array from the bytes it
    writes, then synced and renamed to `path`, so `path` exists only complete; returns the number of images.

    `header` holds the root attributes `_HEADER` (and may add others); `backbones` each backbone's `key`, `name`,
    `weights`, `weights_sha256`, `dim` and `preprocessing`, in column order; `clients` may be a generator, consumed
    once in client order. An existing `path` is refused unless `replace`. No timestamps: the same inputs give a
    byte-identical file."""
    path = Path(path)
    partial = Path(partial) if partial else path.with_name(f".{path.name}.partial")
    if path.exists() and not replace:
        raise UserError(f"{path} already exists: delete it or write the cache elsewhere")
    missing = [k for k in _HEADER if k not in header]
    if missing:
        raise ValueError(f"cache header lacks {', '.join(missing)}")
    try:
        with _create_h5(partial) as f:
            images = _write_file(f, header, backbones, clients)
        with open(partial, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)
    return images


def _write_file(f: h5py.File, header: dict, backbones: list[dict], clients: Iterable[Client]) -> int:
    width = sum(int(b["dim"]) for b in backbones)
    write_attrs(f, header | {"featcache_format": FORMAT, "featcache_version": __version__,
                             "backbones": [b["key"] for b in backbones]})
    start = 0
    for b in backbones:
        attrs = {k: v for k, v in b.items() if k != "key"} | {"columns": [start, start + int(b["dim"])]}
        write_attrs(f.create_group(f"backbones/{b['key']}"), attrs)
        start += int(b["dim"])
    domains, images = list(header["domains"]), 0
    for c, client in enumerate(clients):
        g = f.create_group(f"clients/{c:03d}")
        g.attrs["domain"] = client.domain
        for split in SPLITS:
            s = getattr(client, split)
            n = len(s.labels)
            index = {"labels": s.labels, "source_index": s.source_index,
                     "domain": np.full(n, domains.index(client.domain))}
            for name, dtype in _INDEX_DTYPES.items():
                _write_array(g, f"{split}/{name}", np.asarray(index[name], dtype))
            _write_columns(g, f"{split}/features/concat", s.features, (n,), width)
            if s.views is not None:
                _write_columns(g, f"{split}/views/concat", s.views, (n, int(header["views"])), width)
            images += n
        _write_array(g, "train/val_index", np.asarray(client.val_index, np.int64))
    f.attrs["images"] = images
    f.attrs["meta_sha256"] = _meta_sha256(f)
    return images


def _write_array(g: h5py.Group, name: str, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data)
    ds = g.create_dataset(name, data=data, track_times=False)
    ds.attrs["sha256"] = hashlib.sha256(data).hexdigest()


def _write_columns(g: h5py.Group, name: str, blocks: Sequence, lead: tuple[int, ...], width: int) -> None:
    """`name` [*lead, width] float32: the column blocks side by side, written (and hashed) in slices of rows."""
    if [b.shape[:-1] for b in blocks] != [lead] * len(blocks) or sum(b.shape[-1] for b in blocks) != width:
        raise ValueError(f"{name}: column blocks {[b.shape for b in blocks]} do not make [{lead}, {width}]")
    ds = g.create_dataset(name, (*lead, width), "<f4", track_times=False)
    digest, step = hashlib.sha256(), _rows_per_slice(ds)
    for r in range(0, lead[0], step):
        rows = np.concatenate([np.asarray(b[r : r + step], "<f4") for b in blocks], -1)  # [k, ..., D]
        ds[r : r + len(rows)] = rows
        digest.update(rows)
    ds.attrs["sha256"] = digest.hexdigest()


def _rows_per_slice(ds) -> int:
    return max(_READ_BYTES // max(ds.dtype.itemsize * int(np.prod(ds.shape[1:])), 1), 1)


def _create_h5(path: Path) -> h5py.File:
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


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (the new name survives a power cut, not only a kill)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- checksums and verification -----------------------------------------------------------------------------------

# (path, size, mtime, inode) of each cache file version whose structure passed the checks in this process -> the
# feature arrays of it checked since (each on the read that loaded it)
_VERIFIED: dict[tuple, set[str]] = {}


def seal(f: h5py.File) -> None:
    """Recompute every checksum of a file opened for writing (`sha256` on every dataset, then `meta_sha256`), after
    it was edited in place; `write` computes them as it writes."""
    for _, ds in _objects(f, h5py.Dataset):
        ds.attrs["sha256"] = _scan(ds)[0]
    f.attrs["meta_sha256"] = _meta_sha256(f)


def verify(path: str | Path) -> dict:
    """Check a cache: schema, dtypes, shapes and counts against the stored partition counts, label ranges, column
    ranges, finite features, array and metadata checksums; and compare the library versions it was extracted with to
    this environment's. Returns {path, ok, problems (one line each), stale (version differences: warnings, not
    problems), arrays, bytes, seconds}."""
    t0 = time.perf_counter()
    problems: list[str] = []
    stale: list[str] = []
    arrays = 0
    try:
        with open_cache(path) as f:
            found = _check_structure(f, problems)
            for name, ds in found.items():
                if _is_features(name):
                    digest, finite = _scan(ds)
                    problems += _feature_problems(name, ds, digest, finite)
            arrays = len(found)
            stale = _stale(read_attrs(f)["versions"])
    except UserError as e:
        problems.append(str(e))
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        problems.append(f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
    size = os.path.getsize(path) if Path(path).is_file() else 0
    return {"path": str(path), "ok": not problems, "problems": problems, "stale": stale, "arrays": arrays,
            "bytes": size, "seconds": round(time.perf_counter() - t0, 3)}


def _refused(path: Path, problems: list[str]) -> UserError:
    more = f" (+{len(problems) - 1} more: run `featcache verify {path}`)" if len(problems) > 1 else ""
    return UserError(f"cache {path} failed verification: {problems[0]}{more}; delete it and re-run `featcache extract`")


def _checked(path: Path, f: h5py.File) -> set[str]:
    """The feature arrays of this version of the file (path, size, mtime, inode) already checked in this process.
    A version not seen before has its structure checked first (everything `verify` checks but the feature bytes):
    one UserError line when it fails, one warning when it was extracted with other library versions."""
    st = path.stat()
    ident = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if ident not in _VERIFIED:
        problems: list[str] = []
        try:
            _check_structure(f, problems)
            stale = _stale(read_attrs(f)["versions"])
        except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
            problems.append(f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
        if problems:
            raise _refused(path, problems)
        if stale:
            warnings.warn(f"cache {path} was extracted with {', '.join(stale)}: a fresh `featcache extract` "
                          "may give other features", UserWarning, stacklevel=3)
        _VERIFIED[ident] = set()
    return _VERIFIED[ident]


def _check_structure(f: h5py.File, problems: list[str]) -> dict[str, h5py.Dataset]:
    """Append one line per problem of everything but the feature bytes: attributes, metadata checksum, key, column
    ranges, the datasets the counts call for with their dtypes and shapes, the index arrays' checksums and values.
    Returns the datasets found (path -> dataset) whose dtype and shape are right."""
    missing = [a for a in _ROOT_ATTRS if a not in f.attrs]
    if missing:
        problems.append(f"root attributes missing: {', '.join(missing)}")
        return {}
    meta = read_attrs(f)
    if meta["meta_sha256"] != _meta_sha256(f):
        problems.append("metadata checksum mismatch: names, shapes, dtypes, attributes or placement of arrays changed after writing")
    if content_key(meta["manifest"]) != meta["key"]:
        problems.append("the stored key is not the hash of the stored manifest")
    dims = _column_problems(f, meta["backbones"], problems)
    if dims is None:
        return {}
    rows = meta["counts"]["clients"]
    if not rows or "clients" not in f:
        problems.append("no clients: the cache has no clients/ group or its counts list no client")
        return {}
    empty = [f"{c:03d}" for c, row in enumerate(rows) if int(row.get("train", 0)) - int(row.get("val", 0)) < 1]
    if empty:
        problems.append(f"client {empty[0]} has no training rows (outside validation)"
                        + (f" (+{len(empty) - 1} more clients)" if len(empty) > 1 else ""))
    expected = _expected_datasets(rows, sum(dims), int(meta["views"]))
    found = dict(_objects(f, h5py.Dataset))
    problems += [f"{name}: missing" for name in sorted(set(expected) - set(found))]
    problems += [f"{name}: not part of the schema" for name in sorted(set(found) - set(expected))]
    good = {}
    for name in sorted(set(expected) & set(found)):
        ds, (dtype, shape) = found[name], expected[name]
        if ds.dtype != np.dtype(dtype) or ds.shape != shape:
            problems.append(f"{name}: {ds.dtype} {list(ds.shape)}, but the stored counts say {dtype} {list(shape)}")
            continue
        good[name] = ds
        if not _is_features(name) and ds.attrs.get("sha256") != _scan(ds)[0]:
            problems.append(f"{name}: sha256 mismatch (the array bytes changed after writing)")
    if not problems:
        problems += _value_problems(f, rows, len(meta["classes"]), len(meta["domains"]), int(meta["images"]))
    return good


def _column_problems(f: h5py.File, order: list[str], problems: list[str]) -> list[int] | None:
    """Each backbone's dim, in `backbones` order, after checking that their `columns` tile `concat` in that order;
    None when a backbone is missing or lacks an attribute."""
    dims, start = [], 0
    for b in order:
        g = f.get(f"backbones/{b}")
        if g is None or any(a not in g.attrs for a in _BACKBONE_ATTRS):
            problems.append(f"backbones/{b} is missing or lacks one of {', '.join(_BACKBONE_ATTRS)}")
            return None
        dims.append(int(g.attrs["dim"]))
        columns = read_attrs(g)["columns"]
        if columns != [start, start + dims[-1]]:
            problems.append(f"backbones/{b}: columns {columns} do not follow the backbones before it in `backbones` "
                            f"order (expected {[start, start + dims[-1]]})")
        start += dims[-1]
    return dims


def _is_features(name: str) -> bool:
    return name.rsplit("/", 2)[-2] in FEATURE_GROUPS


def _feature_problems(name: str, ds: h5py.Dataset, digest: str, finite: bool) -> list[str]:
    return ([f"{name}: sha256 mismatch (the array bytes changed after writing)"] if ds.attrs.get("sha256") != digest
            else []) + ([] if finite else [f"{name}: NaN or Inf values"])


def _expected_datasets(rows: list[dict], width: int, views: int) -> dict[str, tuple[str, tuple]]:
    """Path -> (dtype, shape) of every dataset the schema and the stored per-client counts call for."""
    out = {}
    for c, row in enumerate(rows):
        for split in SPLITS:
            base, n = f"clients/{c:03d}/{split}", row[split]
            out |= {f"{base}/{k}": (dtype, (n,)) for k, dtype in _INDEX_DTYPES.items()}
            out[f"{base}/features/concat"] = ("float32", (n, width))
            if views and split == "train":
                out[f"{base}/views/concat"] = ("float32", (n, views, width))
        out[f"clients/{c:03d}/train/val_index"] = ("int64", (row["val"],))
    return out


def _value_problems(f: h5py.File, rows: list[dict], classes: int, domains: int, images: int) -> list[str]:
    """Labels and domain indices in range, validation positions increasing inside train, the image total."""
    problems = []
    for c in range(len(rows)):
        for split in SPLITS:
            for name, bound in (("labels", classes), ("domain", domains)):
                v = f[f"clients/{c:03d}/{split}/{name}"][...]  # [n]
                if v.size and not 0 <= v.min() <= v.max() < bound:
                    problems.append(f"clients/{c:03d}/{split}/{name}: values outside 0..{bound - 1}")
        val = f[f"clients/{c:03d}/train/val_index"][...]  # [v]
        if val.size and not (np.all(np.diff(val) > 0) and 0 <= val[0] and val[-1] < rows[c]["train"]):
            problems.append(f"clients/{c:03d}/train/val_index: not increasing positions inside train")
    total = sum(row[split] for row in rows for split in SPLITS)
    if total != images:
        problems.append(f"images attribute says {images}, the clients hold {total}")
    return problems


def _stale(stored: dict) -> list[str]:
    """'torch 2.14.1 (now 2.15.0)' for each library whose version differs from the one the cache was made with (the
    cache format is not one: `open_cache` refuses another format, and a migrated cache keeps its versions)."""
    from ..extraction.identity import versions

    return [f"{k} {stored.get(k)} (now {v})" for k, v in versions().items()
            if stored.get(k) != v and k != "cache_format"]


def _objects(f: h5py.File, kind: type | None = None) -> list[tuple[str, object]]:
    """(path, object) of every group and dataset below the root (or only those of `kind`), sorted by path."""
    found = []

    def visit(name: str, obj) -> None:
        if kind is None or isinstance(obj, kind):
            found.append((name, obj))

    f.visititems(visit)
    return sorted(found, key=lambda item: item[0])


def _scan(ds: h5py.Dataset) -> tuple[str, bool]:
    """(sha256 of the array bytes in C order, whether every value is finite), reading slices of rows."""
    h = hashlib.sha256()
    finite = True
    step = _rows_per_slice(ds)
    for r in range(0, ds.shape[0], step):
        block = ds[r : r + step]  # [rows, ...]
        h.update(np.ascontiguousarray(block).tobytes())
        finite = finite and (block.dtype.kind != "f" or bool(np.isfinite(block).all()))
    return h.hexdigest(), finite


def _meta_sha256(f: h5py.File, bind_data: bool = True) -> str:
    """sha256 over every object's path, kind (dtype and shape for datasets) and attributes; with `bind_data` each
    dataset's own `sha256` is part of its entry, so an array moved to another path (one client's features swapped
    with another's of the same shape) no longer matches. (Format 2 hashed the entries without it.)"""
    entries = [["/", "group", _plain_attrs(f)]]
    for name, obj in _objects(f):
        kind = f"dataset {obj.dtype.str} {list(obj.shape)}" if isinstance(obj, h5py.Dataset) else "group"
        if bind_data and isinstance(obj, h5py.Dataset):
            kind += f" {_plain(obj.attrs.get('sha256'))}"
        entries.append([name, kind, _plain_attrs(obj)])
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def _plain_attrs(obj) -> dict:
    out = {}
    for name, value in obj.attrs.items():
        if name not in _CHECKSUM_ATTRS:
            value = value.decode() if isinstance(value, bytes) else value
            out[name] = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    return out


# -- reading ------------------------------------------------------------------------------------------------------


@dataclass
class ClientData:
    """All clients of one split as padded tensors, with a leading client axis C, and the cache's metadata."""

    features: torch.Tensor  # [C, Nmax, D] float32 (zeros past counts)
    labels: torch.Tensor  # [C, Nmax] int64 (-1 past counts)
    counts: torch.Tensor  # [C] int64
    num_classes: int
    views: torch.Tensor | None = None  # [C, Nmax, V, D] float32 augmented views, when cached and asked for
    meta: dict = field(default_factory=dict)  # root attributes and backbone_info (`read_meta`); {} when not loaded

    def to(self, device) -> "ClientData":
        move = lambda t: None if t is None else t.to(device)
        return ClientData(move(self.features), move(self.labels), move(self.counts), self.num_classes,
                          move(self.views), self.meta)

    @property
    def mask(self) -> torch.Tensor:  # [C, Nmax] bool
        return torch.arange(self.features.shape[1], device=self.counts.device) < self.counts[:, None]


def load_clients(
    path: str | Path, split: str = "train", backbones: list[str] | None = None, views: bool = False, holdout: str = "none"
) -> ClientData:
    """Read one split of every client as padded tensors, with the cache's metadata in `.meta`.

    `backbones` picks a subset of cached backbones, in the order given (default: all, i.e. the stored `concat`).
    `holdout` uses the validation positions of the train split: 'none' = all of train, 'fit' = train without the
    validation rows, 'val' = only the validation rows (split must be 'train' for the last two). The first load of a
    file in a process checks it as `verify` does (the feature arrays on the read that fills the tensors), and refuses
    a damaged cache in one line.
    """
    path = Path(path)
    if split not in SPLITS:
        raise UserError(f"split must be one of {', '.join(SPLITS)} (got {split!r})")
    with open_cache(path) as f:
        checked = _checked(path, f)
        meta = read_meta(f)
        ranges = _column_ranges(meta, backbones, path)
        groups = [f["clients"][name][split] for name in sorted(f["clients"])]
        if views and any("views" not in g for g in groups):
            raise UserError(f"cache {path} has no augmented views: re-extract with --views 2")
        rows = [_rows(g, holdout, split) for g in groups]  # C x [n_c] increasing positions
        counts = [len(r) for r in rows]
        labels = np.full((len(groups), max(counts, default=0)), -1, np.int64)  # [C, Nmax]
        for c, (g, r) in enumerate(zip(groups, rows)):
            labels[c, : len(r)] = g["labels"][...][r]
        read = lambda group: _read_padded(path, [g[f"{group}/concat"] for g in groups], rows, ranges, checked)
        return ClientData(features=read("features"), labels=torch.from_numpy(labels),
                          counts=torch.tensor(counts, dtype=torch.int64),
                          num_classes=len(meta["classes"]), views=read("views") if views else None, meta=meta)


def _column_ranges(meta: dict, wanted: list[str] | None, path: Path) -> list[tuple[int, int]] | None:
    """The [start, stop) column ranges of the `wanted` backbones, in that order; None for all in stored order."""
    order = meta["backbones"]
    if not wanted or list(wanted) == order:
        return None
    unknown = [b for b in wanted if b not in order]
    if unknown:
        raise UserError(f"cache {path} has no backbone {unknown[0]!r}; it holds {', '.join(order)}")
    return [tuple(meta["backbone_info"][b]["columns"]) for b in wanted]


def _read_padded(path: Path, datasets: list[h5py.Dataset], rows: list[np.ndarray],
                 ranges: list[tuple[int, int]] | None, checked: set[str]) -> torch.Tensor:
    """[C, Nmax, ..., D'] float32, zeros past each client's rows: client c's `rows[c]` of `datasets[c]`, the columns
    of `ranges` side by side (all when None)."""
    width = datasets[0].shape[-1] if ranges is None else sum(b - a for a, b in ranges)
    n = max((len(r) for r in rows), default=0)
    out = np.zeros((len(datasets), n, *datasets[0].shape[1:-1], width), np.float32)  # [C, Nmax, ..., D']
    for c, (ds, r) in enumerate(zip(datasets, rows)):
        _read_into(path, ds, r, ranges, out[c, : len(r)], checked)
    return torch.from_numpy(out)


def _read_into(path: Path, ds: h5py.Dataset, rows: np.ndarray, ranges: list[tuple[int, int]] | None,
               out: np.ndarray, checked: set[str]) -> None:
    """out[:] = ds[rows] (the columns of `ranges` side by side, all when None), reading `ds` once, in slices of
    rows. Unless `checked` already holds it, the same read checks `ds`: its sha256 against the stored one, and that
    every value is finite."""
    name = ds.name.lstrip("/")
    check = name not in checked
    whole = ranges is None and len(rows) == ds.shape[0]  # rows are increasing: all of them, in order
    digest, finite = hashlib.sha256(), True
    step = _rows_per_slice(ds)
    for r in range(0, ds.shape[0], step):
        stop = min(r + step, ds.shape[0])
        lo, hi = np.searchsorted(rows, (r, stop))  # rows[lo:hi] fall in this slice
        if whole:
            block = out[r:stop]  # [k, ..., D] filled in place
            ds.read_direct(block, np.s_[r:stop])
        elif not check and lo == hi:
            continue  # already checked, and none of its rows is asked for
        elif check or ranges is None:
            block = ds[r:stop]  # [k, ..., D]
        else:  # already checked: read only the columns asked for
            block = np.concatenate([ds[r:stop, ..., a:b] for a, b in ranges], -1)  # [k, ..., D']
        if check:
            digest.update(block)
            finite = finite and bool(np.isfinite(block).all())
        if not whole:
            picked = block[rows[lo:hi] - r]  # [m, ..., D or D']
            cut = check and ranges is not None
            out[lo:hi] = np.concatenate([picked[..., a:b] for a, b in ranges], -1) if cut else picked
    if check:
        problems = _feature_problems(name, ds, digest.hexdigest(), finite)
        if problems:
            raise _refused(path, problems)
        checked.add(name)


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


# -- older formats --------------------------------------------------------------------------------------------------


def migrate(path: str | Path) -> dict:
    """Convert a cache of an older format to this one, in place: the new file is written beside it and renamed over
    it only once complete and every array's checksum equals the stored one (the feature bytes are copied, not
    recomputed). Returns {path, from_format, to_format, bytes_before, bytes}."""
    path = Path(path)
    old = _read_only(path, "pass the path of a cache file")
    with old:
        fmt = _plain(old.attrs.get("featcache_format"))
        if fmt == FORMAT:
            raise UserError(f"{path} is already cache format {FORMAT}: nothing to migrate")
        if fmt not in _MIGRATIONS:
            known = ", ".join(map(str, _MIGRATIONS))
            raise UserError(f"{path} has cache format {fmt!r}; `featcache migrate` converts format {known}: re-run "
                            "`featcache extract` with the same options to rebuild it")
        if old.attrs.get("meta_sha256") != _meta_sha256(old, bind_data=False):
            raise UserError(f"cache {path} is damaged (metadata checksum mismatch): delete it and re-run "
                            "`featcache extract`")
        staged = path.with_name(f".{path.name}.format{FORMAT}")
        before = os.path.getsize(path)
        try:
            with output_errors(staged):  # a full disk or a size limit: one line, the original untouched
                _MIGRATIONS[fmt](old, staged)  # `write` with replace=True: a staged file of a killed run is ours
            _same_arrays(path, old, staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
    os.replace(staged, path)
    _sync_folder(path.parent)
    return {"path": str(path), "from_format": fmt, "to_format": FORMAT, "bytes_before": before,
            "bytes": os.path.getsize(path)}


def _from_format_2(old: h5py.File, staged: Path) -> None:
    """Format 2 held each backbone's features twice: as a dataset of its own and inside `concat`; keep `concat`."""
    meta = read_attrs(old)
    header = {k: meta[k] for k in _HEADER} | {"migrated_from": {"format": 2, "featcache": meta["featcache_version"]}}
    backbones = [{"key": b} | read_attrs(old[f"backbones/{b}"]) for b in meta["backbones"]]
    views = int(meta["views"])

    def split(g: h5py.Group, name: str) -> Split:
        s = g[name]
        return Split(s["labels"][...], s["source_index"][...], [s["features/concat"]],
                     [s["views/concat"]] if views and name == "train" else None)

    clients = (Client(_plain(g.attrs["domain"]), split(g, "train"), split(g, "test"), g["train/val_index"][...])
               for g in (old["clients"][name] for name in sorted(old["clients"])))
    write(staged, header, backbones, clients, replace=True)


def _same_arrays(path: Path, old: h5py.File, staged: Path) -> None:
    """Refuse the migration when an array copied into `staged` differs from the bytes `old` says it holds."""
    with h5py.File(staged, "r") as new:
        for name, ds in _objects(new, h5py.Dataset):
            if old[name].attrs.get("sha256") != ds.attrs["sha256"]:
                raise UserError(f"cache {path} is damaged ({name}: sha256 mismatch), nothing was changed: delete it "
                                "and re-run `featcache extract`")


_MIGRATIONS = {2: _from_format_2}  # format -> converter(old file, new path)
