"""Checking a client cache: `verify` (schema, counts, column ranges, finite features, checksums, library versions)
and `info` (its metadata, refused in one line when damaged or when verify's structural checks fail; no array is
hashed). The problem finders are shared with the first-load check in `load`."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import h5py
import numpy as np

from ..errors import UserError, first_line
from .identity import content_key, versions
from .h5 import Node, meta_sha256, read_attrs, scan, walk
from .open import open_cache, read_meta
from .write import BACKBONE_ATTRS, FEATURE_GROUPS, INDEX_DTYPES, ROOT_ATTRS, SPLITS, offsets


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
            for name, node in found.items():
                if _is_features(name):
                    digest, finite = scan(node.id)
                    problems += _feature_problems(name, node.attrs.get("sha256"), digest, finite)
            arrays = len(found)
            stale = _stale(read_attrs(f)["versions"])
    except UserError as e:
        problems.append(str(e))
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        problems.append(f"unreadable ({type(e).__name__}: {first_line(e)})")
    return report(path, problems, stale, arrays, t0)


def report(path: str | Path, problems: list[str], stale: list[str], arrays: int, t0: float) -> dict:
    """What `verify` (of a cache or a store) returns: {path, ok, problems, stale, arrays, bytes, seconds since t0}."""
    size = os.path.getsize(path) if Path(path).is_file() else 0
    return {
        "path": str(path),
        "ok": not problems,
        "problems": problems,
        "stale": stale,
        "arrays": arrays,
        "bytes": size,
        "seconds": round(time.perf_counter() - t0, 3),
    }


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
            problem = first_line(e)
        if not problem:
            problems: list[str] = []
            try:
                _check_structure(f, problems, checksums=False)
            except Exception as e:  # as in `verify`: a damaged file fails in many ways inside HDF5 and JSON
                problems.append(f"unreadable ({type(e).__name__}: {first_line(e)})")
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            problem = problems[0] + more if problems else None
        if problem:
            raise UserError(
                f"cache {path} is damaged: {problem}; run `featcache verify {path}`, then delete it and "
                "re-run `featcache extract`"
            )
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
        if not isinstance(b, dict) or any(
            not isinstance(b.get(a), t)
            for a, t in (("name", str), ("dim", int), ("weights", str), ("weights_sha256", str))
        ):
            return f"backbones/{k} lacks one of name, dim, weights, weights_sha256"
        if isinstance(b.get("dim"), bool):
            return f"backbones/{k} has a dim that is not a number"
        for a, v in b.items():
            if isinstance(v, (np.ndarray, np.generic)):
                return f"backbones/{k} attribute {a!r} is an array"
    counts = meta.get("counts")
    rows = counts.get("clients") if isinstance(counts, dict) else None
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and all(c in r for c in ("client", "domain", "train", "val", "test")) for r in rows
    ):
        return "attribute 'counts' is not {clients: [{client, domain, train, val, test}, ...]}"
    return None


def _check_structure(f: h5py.File, problems: list[str], checksums: bool = True) -> dict[str, Node]:
    """Append one line per problem of everything but the feature bytes: attributes, metadata checksum, key, column
    ranges, the datasets the counts call for with their dtypes and shapes, the index arrays' checksums (`checksums`)
    and values. Returns the datasets found (path -> `h5.Node`, the index arrays read) whose dtype and shape are right.
    One walk of the file (`h5.walk`) serves the metadata checksum and every dataset's checks."""
    missing = [a for a in ROOT_ATTRS if a not in f.attrs]
    if missing:
        problems.append(f"root attributes missing: {', '.join(missing)}")
        return {}
    meta = read_attrs(f)
    nodes = walk(f)
    if meta["meta_sha256"] != meta_sha256(f, nodes=nodes):
        problems.append(
            "metadata checksum mismatch: names, shapes, dtypes, attributes or placement of arrays changed after writing"
        )
    if content_key(meta["manifest"]) != meta["key"]:
        problems.append("the stored key is not the hash of the stored manifest")
    dims = _column_problems(f, meta["backbones"], problems)
    if dims is None:
        return {}
    rows = meta["counts"]["clients"]
    if not rows:
        problems.append("no clients: the cache's counts list no client")
        return {}
    empty = [f"{c:03d}" for c, row in enumerate(rows) if int(row.get("train", 0)) - int(row.get("val", 0)) < 1]
    if empty:
        problems.append(
            f"client {empty[0]} has no training rows (outside validation)"
            + (f" (+{len(empty) - 1} more clients)" if len(empty) > 1 else "")
        )
    expected = _expected_datasets(rows, sum(dims), int(meta["views"]))
    found = {name: node for name, node in nodes.items() if node.dataset}
    problems += [f"{name}: missing" for name in sorted(set(expected) - set(found))]
    problems += [f"{name}: not part of the schema" for name in sorted(set(found) - set(expected))]
    good = {}
    for name in sorted(set(expected) & set(found)):
        node, (dtype, shape) = found[name], expected[name]
        if node.dtype != np.dtype(dtype) or node.shape != shape:
            problems.append(f"{name}: {node.dtype} {list(node.shape)}, but the stored counts say {dtype} {list(shape)}")
            continue
        good[name] = node
        if checksums and not _is_features(name) and node.attrs.get("sha256") != _sha256(node.read()):
            problems.append(f"{name}: sha256 mismatch (the array bytes changed after writing)")
    if not problems:
        problems += _value_problems(good, rows, len(meta["classes"]), len(meta["domains"]), int(meta["images"]))
    return good


def _sha256(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data)).hexdigest()


def _column_problems(f: h5py.File, order: list[str], problems: list[str]) -> list[int] | None:
    """Each backbone's dim, in `backbones` order, after checking that their `columns` tile `concat` in that order;
    None when a backbone is missing or lacks an attribute."""
    dims, start = [], 0
    for b in order:
        g = f.get(f"backbones/{b}")
        if g is None or any(a not in g.attrs for a in BACKBONE_ATTRS):
            problems.append(f"backbones/{b} is missing or lacks one of {', '.join(BACKBONE_ATTRS)}")
            return None
        dims.append(int(g.attrs["dim"]))
        columns = read_attrs(g)["columns"]
        if columns != [start, start + dims[-1]]:
            problems.append(
                f"backbones/{b}: columns {columns} do not follow the backbones before it in `backbones` "
                f"order (expected {[start, start + dims[-1]]})"
            )
        start += dims[-1]
    return dims


def _is_features(name: str) -> bool:
    return name.rsplit("/", 2)[-2] in FEATURE_GROUPS


def _feature_problems(name: str, stored, digest: str, finite: bool) -> list[str]:
    """The problems of a feature array whose stored `sha256` attribute is `stored`, read as `digest` and `finite`."""
    return ([f"{name}: sha256 mismatch (the array bytes changed after writing)"] if stored != digest else []) + (
        [] if finite else [f"{name}: NaN or Inf values"]
    )


def _expected_datasets(rows: list[dict], width: int, views: int) -> dict[str, tuple[str, tuple]]:
    """Path -> (dtype, shape) of every dataset the schema and the stored per-client counts call for."""
    C, out = len(rows), {}
    for split in SPLITS:
        n = sum(int(row[split]) for row in rows)
        out |= {f"{split}/{k}": (dtype, (n,)) for k, dtype in INDEX_DTYPES.items()}
        out[f"{split}/offsets"] = ("int64", (C + 1,))
        out[f"{split}/features/concat"] = ("float32", (n, width))
        if views and split == "train":
            out[f"{split}/views/concat"] = ("float32", (n, views, width))
    out["train/val_index"] = ("int64", (sum(int(row["val"]) for row in rows),))
    out["train/val_offsets"] = ("int64", (C + 1,))
    return out


def _value_problems(found: dict[str, Node], rows: list[dict], classes: int, domains: int, images: int) -> list[str]:
    """Offsets that follow the stored counts, labels and domain indices in range, each client's validation positions
    increasing inside its train rows, the image total (`found`: every dataset the counts call for, from
    `_check_structure`)."""
    problems = []
    for split, key, name in (*((s, s, "offsets") for s in SPLITS), ("train", "val", "val_offsets")):
        if not np.array_equal(found[f"{split}/{name}"].read(), offsets([int(row[key]) for row in rows])):
            problems.append(f"{split}/{name}: not the running total of the stored counts' {key} rows")
    if problems:
        return problems
    for split in SPLITS:
        for name, bound in (("labels", classes), ("domain", domains)):
            v = found[f"{split}/{name}"].read()  # [N]
            if v.size and not 0 <= v.min() <= v.max() < bound:
                problems.append(f"{split}/{name}: values outside 0..{bound - 1}")
    val, at = found["train/val_index"].read(), found["train/val_offsets"].read()  # [v], [C + 1]
    for c, row in enumerate(rows):
        v = val[at[c] : at[c + 1]]  # client c's positions in its train rows
        if v.size and not (np.all(np.diff(v) > 0) and 0 <= v[0] and v[-1] < int(row["train"])):
            problems.append(f"train/val_index: client {c:03d}'s are not increasing positions inside its train rows")
            break
    total = sum(row[split] for row in rows for split in SPLITS)
    if total != images:
        problems.append(f"images attribute says {images}, the clients hold {total}")
    return problems


def _stale(stored: dict) -> list[str]:
    """'torch 2.14.1 (now 2.15.0)' for each library whose version differs from the one the cache was made with (the
    cache format is not one: `open_cache` refuses another format, and a migrated cache keeps its versions)."""
    return [
        f"{k} {stored.get(k)} (now {v})" for k, v in versions().items() if stored.get(k) != v and k != "cache_format"
    ]
