"""The HDF5 feature cache: its schema, its fingerprint, its checksums, and reading clients back as padded tensors.

Schema (format 2; every attribute that is not a number or string is a JSON string):

    /                                   attrs: featcache_format, featcache_version, key, manifest (JSON: everything
                                               that determines the embeddings), backbones (JSON list = concat order),
                                               classes, domains, dataset, partition, counts, views, versions, images,
                                               meta_sha256
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

Every dataset carries `sha256`, the sha256 of its array bytes (C order), and the root `meta_sha256` covers the rest:
every object's path, kind, dtype, shape and attributes. `verify` recomputes both and checks the schema, the counts
against the stored partition counts, and that features are finite; `load_clients` refuses a cache that fails it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from . import __version__
from .errors import UserError

FORMAT = 2  # 2: checksums (`sha256` on every dataset, `meta_sha256` on the root)
_CHECKSUM_ATTRS = ("sha256", "meta_sha256")
_READ_BYTES = 1 << 24  # rows are hashed and checked in slices of about 16 MiB


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
        if isinstance(value, str) and value[:1] in ("[", "{"):
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
        fmt = fmt.item() if isinstance(fmt, np.generic) else fmt
        wrote = f.attrs.get("featcache_version", "an unknown version")
        f.close()
        raise UserError(f"{path} has cache format {fmt!r} (written by featcache {wrote}), this featcache {__version__} "
                        f"reads format {FORMAT}: re-run `featcache extract` with the same options to rebuild it")
    return f


def info(path: str | Path) -> dict:
    """Metadata and per-client counts of a cache, JSON-able. A cache whose metadata is damaged (no `backbones`
    group, an attribute that is not JSON or is an array, counts of the wrong shape) is one UserError line."""
    with open_cache(path) as f:
        try:
            meta = read_attrs(f)
            if "backbones" not in f or not isinstance(f["backbones"], h5py.Group):
                raise ValueError("it has no backbones group")
            meta["backbone_info"] = {k: read_attrs(g) for k, g in f["backbones"].items()}
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


# -- checksums and verification -----------------------------------------------------------------------------------

SPLITS = ("train", "test")
_ROOT_ATTRS = ("featcache_version", "key", "manifest", "backbones", "classes", "domains", "dataset", "partition",
               "counts", "views", "versions", "images", "meta_sha256")
_BACKBONE_ATTRS = ("name", "weights", "weights_sha256", "dim", "preprocessing")
_INDEX_DTYPES = {"labels": "int64", "source_index": "int64", "domain": "int16"}
_VERIFIED: set[tuple] = set()  # (path, size, mtime, inode) of cache files that passed `verify` in this process


def seal(f: h5py.File) -> None:
    """Store the checksums of a cache being written: `sha256` on every dataset, then `meta_sha256` on the root."""
    for _, ds in _objects(f, h5py.Dataset):
        ds.attrs["sha256"] = _scan(ds)[0]
    f.attrs["meta_sha256"] = _meta_sha256(f)


def verify(path: str | Path) -> dict:
    """Check a cache: schema, dtypes, shapes and counts against the stored partition counts, label ranges, finite
    features, array and metadata checksums; and compare the library versions it was extracted with to this
    environment's. Returns {path, ok, problems (one line each), stale (version differences: warnings, not
    problems), arrays, bytes, seconds}."""
    t0 = time.perf_counter()
    problems: list[str] = []
    stale: list[str] = []
    arrays = 0
    try:
        with open_cache(path) as f:
            arrays = _check_cache(f, problems)
            stale = _stale(read_attrs(f)["versions"])
    except UserError as e:
        problems.append(str(e))
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        problems.append(f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
    size = os.path.getsize(path) if Path(path).is_file() else 0
    return {"path": str(path), "ok": not problems, "problems": problems, "stale": stale, "arrays": arrays,
            "bytes": size, "seconds": round(time.perf_counter() - t0, 3)}


def check(path: str | Path) -> None:
    """Refuse a cache that fails `verify` with one line, and warn about version differences. Each version of a file
    (path, size, mtime, inode) is verified once per process."""
    path = Path(path)
    open_cache(path).close()  # missing, not HDF5, another format: their own one-line errors
    st = path.stat()
    ident = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if ident in _VERIFIED:
        return
    report = verify(path)
    problems = report["problems"]
    if problems:
        more = f" (+{len(problems) - 1} more: run `featcache verify {path}`)" if len(problems) > 1 else ""
        raise UserError(f"cache {path} failed verification: {problems[0]}{more}; delete it and re-run "
                        "`featcache extract`")
    if report["stale"]:
        warnings.warn(f"cache {path} was extracted with {', '.join(report['stale'])}: a fresh `featcache extract` "
                      "may give other features", UserWarning, stacklevel=3)
    _VERIFIED.add(ident)


def _check_cache(f: h5py.File, problems: list[str]) -> int:
    """Append one line per problem; returns the number of datasets read."""
    missing = [a for a in _ROOT_ATTRS if a not in f.attrs]
    if missing:
        problems.append(f"root attributes missing: {', '.join(missing)}")
        return 0
    meta = read_attrs(f)
    if meta["meta_sha256"] != _meta_sha256(f):
        problems.append("metadata checksum mismatch: names, shapes, dtypes or attributes changed after writing")
    if cache_key(meta["manifest"]) != meta["key"]:
        problems.append("the stored key is not the hash of the stored manifest")
    dims = {}
    for b in meta["backbones"]:
        g = f.get(f"backbones/{b}")
        if g is None or any(a not in g.attrs for a in _BACKBONE_ATTRS):
            problems.append(f"backbones/{b} is missing or lacks one of {', '.join(_BACKBONE_ATTRS)}")
            return 0
        dims[b] = int(g.attrs["dim"])
    rows = meta["counts"]["clients"]
    if not rows or "clients" not in f:
        problems.append("no clients: the cache has no clients/ group or its counts list no client")
        return 0
    empty = [f"{c:03d}" for c, row in enumerate(rows) if int(row.get("train", 0)) - int(row.get("val", 0)) < 1]
    if empty:
        problems.append(f"client {empty[0]} has no training rows (outside validation)"
                        + (f" (+{len(empty) - 1} more clients)" if len(empty) > 1 else ""))
    expected = _expected_datasets(rows, dims, int(meta["views"]))
    found = dict(_objects(f, h5py.Dataset))
    problems += [f"{name}: missing" for name in sorted(set(expected) - set(found))]
    problems += [f"{name}: not part of the schema" for name in sorted(set(found) - set(expected))]
    for name in sorted(set(expected) & set(found)):
        ds, (dtype, shape) = found[name], expected[name]
        if ds.dtype != np.dtype(dtype) or ds.shape != shape:
            problems.append(f"{name}: {ds.dtype} {list(ds.shape)}, but the stored counts say {dtype} {list(shape)}")
            continue
        digest, finite = _scan(ds)
        if ds.attrs.get("sha256") != digest:
            problems.append(f"{name}: sha256 mismatch (the array bytes changed after writing)")
        if not finite:
            problems.append(f"{name}: NaN or Inf values")
    if not problems:
        problems += _value_problems(f, rows, len(meta["classes"]), len(meta["domains"]), int(meta["images"]))
    if not problems:
        problems += _concat_problems(f, rows, list(dims), int(meta["views"]))
    return len(found)


def _concat_problems(f: h5py.File, rows: list[dict], order: list[str], views: int) -> list[str]:
    """`features/concat` (and `views/concat`) must equal the per-backbone blocks side by side, in `backbones` order."""
    problems = []
    for c in range(len(rows)):
        for split in SPLITS:
            for group in ("features", "views") if views and split == "train" else ("features",):
                base = f"clients/{c:03d}/{split}/{group}"
                cat = f[f"{base}/concat"]
                step = max(_READ_BYTES // max(cat.dtype.itemsize * int(np.prod(cat.shape[1:])), 1), 1)
                for r in range(0, cat.shape[0], step):
                    side = np.concatenate([f[f"{base}/{b}"][r : r + step] for b in order], -1)
                    if not np.array_equal(cat[r : r + step], side):
                        problems.append(f"{base}/concat: not equal to the per-backbone blocks side by side")
                        break
    return problems


def _expected_datasets(rows: list[dict], dims: dict[str, int], views: int) -> dict[str, tuple[str, tuple]]:
    """Path -> (dtype, shape) of every dataset the schema and the stored per-client counts call for."""
    out = {}
    for c, row in enumerate(rows):
        for split in SPLITS:
            base, n = f"clients/{c:03d}/{split}", row[split]
            out |= {f"{base}/{k}": (dtype, (n,)) for k, dtype in _INDEX_DTYPES.items()}
            groups = {"features": (n,)} | ({"views": (n, views)} if views and split == "train" else {})
            for group, lead in groups.items():
                out |= {f"{base}/{group}/{b}": ("float32", (*lead, d)) for b, d in dims.items()}
                out[f"{base}/{group}/concat"] = ("float32", (*lead, sum(dims.values())))
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
    """'torch 2.14.1 (now 2.15.0)' for each library whose version differs from the one the cache was made with."""
    return [f"{k} {stored.get(k)} (now {v})" for k, v in versions().items() if stored.get(k) != v]


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
    step = max(_READ_BYTES // max(ds.dtype.itemsize * int(np.prod(ds.shape[1:])), 1), 1)
    for r in range(0, ds.shape[0], step):
        block = ds[r : r + step]  # [rows, ...]
        h.update(np.ascontiguousarray(block).tobytes())
        finite = finite and (block.dtype.kind != "f" or bool(np.isfinite(block).all()))
    return h.hexdigest(), finite


def _meta_sha256(f: h5py.File) -> str:
    """sha256 over every object's path, kind (dtype and shape for datasets) and attributes, checksums excepted."""
    entries = [["/", "group", _plain_attrs(f)]]
    for name, obj in _objects(f):
        kind = f"dataset {obj.dtype.str} {list(obj.shape)}" if isinstance(obj, h5py.Dataset) else "group"
        entries.append([name, kind, _plain_attrs(obj)])
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def _plain_attrs(obj) -> dict:
    out = {}
    for name, value in obj.attrs.items():
        if name not in _CHECKSUM_ATTRS:
            value = value.decode() if isinstance(value, bytes) else value
            out[name] = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    return out


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
    check(path)
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


# featcache's own code that determines the embeddings (relative to the package): which images (dataset readers,
# partition), how they are preprocessed (pipeline), how backbones are built and run, and how blocks are embedded and
# written (extract). Its sha256 is part of every cache key, so a change of any of it gives new caches; `featcache
# 0.1.0` alone could not tell two preprocessings apart.
PREPROCESSING_CODE = ("pipeline.py", "backbones.py", "extract.py", "partition.py", "datasets/*.py")


def _read_source(rel: str) -> bytes:
    return (Path(__file__).resolve().parent / rel).read_bytes()


def code_identity() -> dict:
    """{"files": [...], "sha256": ...}: the sha256 over the names and bytes of `PREPROCESSING_CODE`, in order (a
    file that cannot be read counts as empty, so the key still changes when it comes back)."""
    root = Path(__file__).resolve().parent
    files = []
    for pattern in PREPROCESSING_CODE:
        found = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern)) if "*" in pattern else [pattern]
        files += found
    h = hashlib.sha256()
    for rel in files:
        try:
            data = _read_source(rel)
        except OSError:
            data = b""
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return {"files": files, "sha256": h.hexdigest()}


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
