"""The embedding store: one backbone's embeddings of individual images, addressed by (domain, split, source index)
and filled lazily, so no backbone runs twice on the same image however often the images are re-partitioned.

A store is one HDF5 file per identity: the dataset's content, the backbone's weights, image size, precision, views,
noise and their seed, the input pipeline, the embedding code and the library versions (`identity.py`), never the
partition nor where the data lies (the folders its images were read from are recorded as `sources`, outside the key).
Every dataset carries the sha256 of its bytes and the root `meta_sha256` covers the rest, as in a cache:

    /                                  attrs: featcache_store (format), featcache_version, key, identity (JSON),
                                              backbone (JSON: key, name, weights, weights_sha256, dim,
                                              preprocessing), views, images, sources (JSON: [{root, real}]),
                                              meta_sha256
    /<domain>/<split>/features/index   [n] int64, increasing: the source indices held
    /<domain>/<split>/features/rows    [n, D] float32
    /<domain>/train/views/index, rows  [n], [n, V, D]: augmented views (with --views V)

The root attribute `featcache_store` (`MARKER`) is featcache's mark on a store file: `featcache gc` changes only files
that carry it (a client cache carries `featcache_format` instead), never a file for its name or for failing a check.

Reading rows is two lines of h5py: `g = f["photos/train/features"]` then
`g["rows"][np.searchsorted(g["index"][:], wanted)]`.

A fill runs under the exclusive lock of the store's parts folder `.<store>.parts`: it writes its plan (the blocks of
missing rows, `plan.json`), the embedding pass writes each block file complete or not at all, and `commit` merges the
finished blocks and the old file into a new file, synced and renamed over it. A killed fill leaves its plan and
finished blocks: the next fill commits them first and plans only what is still missing, in blocks with the same
boundaries, so it ends with the bytes of an undisturbed fill.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .. import __version__
from ..cache import h5
from ..errors import UserError, first_line
from ..files import writing

FORMAT = 1
MARKER = "featcache_store"  # the root attribute that marks a file as featcache's store; its value is the format
Need = tuple[str, str, int]  # (domain, split, views): 0 for plain features, V for V augmented views per image


def kind(views: int) -> str:
    return "views" if views else "features"


def block_name(need: Need, rows: np.ndarray) -> str:
    """A block file's name, the same in every fill that plans the same rows: '<domain hash>.<split>.<kind>.<first>'."""
    domain = hashlib.sha256(need[0].encode()).hexdigest()[:8]
    return f"{domain}.{need[1]}.{kind(need[2])}.{int(rows[0]):09d}.npy"


def store_path(folder: Path, dataset: str, name: str, key: str) -> Path:
    return Path(folder) / f"{dataset}.{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.{key[:16]}.h5"


@dataclass(eq=False)
class Store:
    """One store file (which may not exist yet) and its parts folder, the resume point of a fill."""

    path: Path
    key: str
    source: dict | None = None  # where this run reads the images (metadata, not key), added to `sources` on a fill
    _rows: dict = field(default_factory=dict, repr=False)  # Need -> (index [n], rows [n, ...]), read and checked

    @property
    def work(self) -> Path:
        return self.path.with_name(f".{self.path.name}.parts")

    def held(self) -> dict[Need, np.ndarray]:
        """Need -> the source indices held (increasing)."""
        if not self.path.is_file():
            return {}
        with self._open() as f:
            return {need: checked(self.path, g["index"]) for need, g in groups(f)}

    def backbone(self) -> dict | None:
        """The backbone's metadata as a cache records it (None while the store is empty)."""
        if not self.path.is_file():
            return None
        with self._open() as f:
            return json.loads(f.attrs["backbone"])

    def gather(self, need: Need, wanted: np.ndarray) -> np.ndarray:
        """The rows of the source indices `wanted` ([n, D] or [n, V, D] float32)."""
        index, rows = self._read(need)
        at = np.searchsorted(index, wanted)
        if len(wanted) and (at.max() >= len(index) or not np.array_equal(index[at], wanted)):
            raise UserError(
                f"store {self.path} lacks images of {need[0]}/{need[1]} it was filled with: delete it "
                "and run the same command again"
            )
        return rows[at]

    def _read(self, need: Need) -> tuple[np.ndarray, np.ndarray]:
        """(index [n], rows [n, ...]) held for `need`, read once per process with each array's checksum checked."""
        if need not in self._rows:
            with self._open() as f:
                g = f.get(f"{need[0]}/{need[1]}/{kind(need[2])}")
                if g is None:  # nothing of this (domain, split) was ever asked for
                    dim = json.loads(f.attrs["backbone"])["dim"]
                    empty = np.zeros((0, *((need[2],) if need[2] else ()), dim), np.float32)  # [0, (V,) D]
                    self._rows[need] = (np.zeros(0, np.int64), empty)
                else:
                    self._rows[need] = (checked(self.path, g["index"]), checked(self.path, g["rows"]))
        return self._rows[need]

    def _open(self) -> h5py.File:
        return open_store(self.path, self.key)

    # -- filling ----------------------------------------------------------------------------------------------------

    def plan(self, blocks: list[tuple[Need, np.ndarray]]) -> list[Path]:
        """Write the plan of a fill (its blocks, in order) and return each block's file."""
        files = [self.work / block_name(need, rows) for need, rows in blocks]
        plan = [
            {"domain": d, "split": s, "views": v, "rows": rows.tolist(), "file": file.name}
            for ((d, s, v), rows), file in zip(blocks, files)
        ]
        with writing(self.work):
            (self.work / "plan.json.partial").write_text(json.dumps(plan))
            os.replace(self.work / "plan.json.partial", self.work / "plan.json")
        return files

    def commit(self, identity: dict) -> int:
        """Merge the finished blocks of the plan in the parts folder into the store file; returns the rows added."""
        plan_file = self.work / "plan.json"
        try:  # what a killed fill left: a plan, blocks and meta.json that another program may have damaged since
            plan = json.loads(plan_file.read_text()) if plan_file.is_file() else []
            held = self.held() if plan else {}
            done = [
                b
                for b in plan
                if (self.work / b["file"]).is_file()  # and not merged by a fill killed after it
                and not np.isin(b["rows"], held.get((b["domain"], b["split"], b["views"]), ())).all()
            ]
            if done:
                backbone = self.backbone() or json.loads((self.work / "meta.json").read_text())
                merged = self._merged(done)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise UserError(
                f"the parts folder {self.work} (finished blocks of a killed fill) is damaged "
                f"({type(e).__name__}: {first_line(e, 120)}): remove it (rm -r) and run the same command "
                "again"
            ) from None
        if done:
            with writing(self.path):
                _write(self.path, self.key, identity, backbone, merged, self._sources())
            self._rows.clear()
        for b in plan:
            (self.work / b["file"]).unlink(missing_ok=True)
        plan_file.unlink(missing_ok=True)
        return sum(len(b["rows"]) for b in done if not b["views"])

    def _sources(self) -> list[dict]:
        """Where the images of this store were read from, one entry per distinct source in the order of the fills."""
        old = []
        if self.path.is_file():
            with self._open() as f:
                old = json.loads(h5.plain(f.attrs.get("sources", "[]")))
        return [*old, self.source] if self.source and self.source not in old else old

    def _merged(self, done: list[dict]) -> dict[Need, tuple[np.ndarray, np.ndarray]]:
        parts: dict[Need, list] = {}
        if self.path.is_file():
            for need in self.held():
                parts[need] = [self._read(need)]
        for b in done:
            rows = np.load(self.work / b["file"], mmap_mode="r")  # [n, D] or [n, V, D]
            parts.setdefault((b["domain"], b["split"], b["views"]), []).append((np.asarray(b["rows"], np.int64), rows))
        merged = {}
        for need, pieces in parts.items():
            index = np.concatenate([p[0] for p in pieces])  # [n]
            order = np.argsort(index, kind="stable")
            if len(index) and (np.diff(index[order]) == 0).any():
                raise UserError(f"store {self.path}: a block repeats rows it holds; delete {self.work} and run again")
            merged[need] = (index[order], np.concatenate([np.asarray(p[1]) for p in pieces])[order])
        return merged


def open_store(path: Path, key: str | None = None) -> h5py.File:
    """A store file opened read-only after checking its format, its metadata checksum and (given) its key."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise _damaged(path, f"not a readable HDF5 file ({e})") from None
    problem = None
    if h5.plain(f.attrs.get(MARKER)) != FORMAT:
        problem = f"not a featcache store of format {FORMAT}"
    elif h5.plain(f.attrs.get("meta_sha256")) != h5.meta_sha256(f):
        problem = "metadata checksum mismatch"
    elif key is not None and h5.plain(f.attrs.get("key")) != key:
        problem = "its key is not the one its name says"
    if problem:
        f.close()
        raise _damaged(path, problem)
    return f


class DamagedStore(UserError):
    """A store file that fails its checks; `problem` says which."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


def _damaged(path: Path, problem: str) -> DamagedStore:
    return DamagedStore(
        f"store {path} is damaged ({problem}): move it aside (`featcache gc {path.parent}` moves "
        "damaged stores into its .quarantine folder) and run the same command again",
        problem,
    )


def groups(f: h5py.File):
    """(Need, group) of every kind held, in file order."""
    for domain, splits in f.items():
        for split, kinds in splits.items():
            for name, g in kinds.items():
                yield (domain, split, int(f.attrs["views"]) if name == "views" else 0), g


def checked(path: Path, ds: h5py.Dataset) -> np.ndarray:
    """The array of `ds`, refused in one line when its bytes do not match its stored sha256."""
    data = ds[...]
    if h5.plain(ds.attrs.get("sha256")) != hashlib.sha256(np.ascontiguousarray(data)).hexdigest():
        raise _damaged(path, f"{ds.name}: sha256 mismatch")
    return data


def _write(path: Path, key: str, identity: dict, backbone: dict, merged: dict, sources: list[dict]) -> None:
    """A new store file holding `merged` (Need -> (index, rows)), written beside `path` and renamed over it."""
    views = max((v for _, _, v in merged), default=0)
    with h5.written(path, path.with_name(path.name + ".partial")) as f:
        h5.write_attrs(
            f,
            {
                MARKER: FORMAT,
                "featcache_version": __version__,
                "key": key,
                "identity": identity,
                "backbone": backbone,
                "views": views,
                "sources": sources,
                "images": sum(len(index) for (_, _, v), (index, _) in merged.items() if not v),
            },
        )
        for (domain, split, v), (index, rows) in sorted(merged.items()):
            g = f.require_group(f"{domain}/{split}/{kind(v)}")
            h5.write_array(g, "index", index)
            h5.write_array(g, "rows", np.asarray(rows, "<f4"))
        f.attrs["meta_sha256"] = h5.meta_sha256(f)
