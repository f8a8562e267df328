"""The embedding store: one backbone's embeddings of individual images, addressed by (domain, split, source index)
and filled lazily, so no backbone runs twice on the same image however often the images are re-partitioned.

A store is one small HDF5 file per identity and a folder of its rows beside it. The identity: the dataset's content,
the backbone's weights, image size, precision, views, noise and their seed, the input pipeline, the embedding code and
the library versions (`identity.py`), never the partition nor where the data lies (the folders its images were read
from are recorded as `sources`, outside the key). Each fill appends one segment file to the folder and rewrites the
small file, so a fill writes its new rows only and a gather reads the rows it gathers:

    NAME.h5                            attrs: featcache_store (format), featcache_version, key, identity (JSON),
                                              backbone (JSON: key, name, weights, weights_sha256, dim,
                                              preprocessing), views, images, sources (JSON: [{root, real}]),
                                              segments (JSON: [{file, meta_sha256, held: {"domain/split/kind": n}}]),
                                              meta_sha256
    NAME.h5.rows/NNNNNN.h5             one fill's rows: attrs meta_sha256
        /<domain>/<split>/features/index   [n] int64, increasing: the source indices it added; attrs crc32,
                                           first (where they are consecutive: first .. first + n - 1)
        /<domain>/<split>/features/crc     [n] uint32: zlib.crc32 of each row's bytes; attrs crc32
        /<domain>/<split>/features/rows    [n, D] float32, contiguous (a gather reads only its rows)
        /<domain>/train/views/...          [n, V, D]: augmented views (with --views V)

Integrity is checked on what is read: each row a gather returns against its crc (the crcs of its rows read as one
span, no more), an `index` against its crc32 (8 bytes a row, read by a process's first gather of the need, unless
`first` names it); the small file's `meta_sha256` covers the segments' list and each segment's `meta_sha256` its own
objects, `first` included. `verify` reads every array whole. A store of format 1 (every row inside NAME.h5,
each array with its sha256) is read as it is, and its next fill moves its rows into the first segment (checked as
they are read).

The root attribute `featcache_store` (`MARKER`) is featcache's mark on a store file: `featcache gc` changes only files
that carry it (a client cache carries `featcache_format` instead) and folders that carry featcache's marker file.

A fill runs under the exclusive lock of the store's parts folder `.NAME.h5.parts`: it writes its plan (the blocks of
missing rows, `plan.json`), the embedding pass writes each block file complete or not at all, and `commit` writes the
finished blocks as one segment, synced, then the small file naming it, synced and renamed over the old one. Segments
are never changed once named, so readers without the lock see the old file or the new one, whole. A killed fill
leaves its plan and finished blocks: the next fill plans only the rows no finished block holds and commits all of
them as one segment, so it ends with the bytes of an undisturbed fill.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .. import __version__
from ..cache import h5
from ..errors import UserError, first_line
from ..files import claim, writing

FORMAT = 2
READS = (1, 2)  # formats this code reads (format 1 is moved into segments by its next fill)
MARKER = "featcache_store"  # the root attribute that marks a file as featcache's store; its value is the format
Need = tuple[str, str, int]  # (domain, split, views): 0 for plain features, V for V augmented views per image
ALIGN = 4096  # a segment's rows start at a page: read in place, aligned for numpy (an unaligned map is copied whole)
SLICE_BYTES = 64 << 20  # rows copied per slice while a segment is written or checked: memory bounded by this
IOV_MAX = 1024  # buffers one preadv fills (Linux's limit)


def kind(views: int) -> str:
    return "views" if views else "features"


def need_name(need: Need) -> str:
    return f"{need[0]}/{need[1]}/{kind(need[2])}"


def block_name(need: Need, rows: np.ndarray) -> str:
    """A block file's name, the same in every fill that plans the same rows: '<domain hash>.<split>.<kind>.<first>'."""
    domain = hashlib.sha256(need[0].encode()).hexdigest()[:8]
    return f"{domain}.{need[1]}.{kind(need[2])}.{int(rows[0]):09d}.npy"


def store_path(folder: Path, dataset: str, name: str, key: str) -> Path:
    return Path(folder) / f"{dataset}.{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.{key[:16]}.h5"


def rows_folder(path: Path) -> Path:
    """The folder of a store file's segments."""
    return Path(path).with_name(Path(path).name + ".rows")


def isin_sorted(values: np.ndarray, held: np.ndarray) -> np.ndarray:
    """[n] bool: which of `values` the increasing array `held` holds (a search, no sort of `held`)."""
    return find_sorted(held, np.asarray(values, np.int64))[0]


def find_sorted(held: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where `held` (increasing, no repeats) holds `values` [n]: ([n] bool which it holds, [m] their positions in it);
    consecutive indices (a whole data set's) by a subtraction, others by a search."""
    if not len(held):
        return np.zeros(len(values), bool), np.zeros(0, np.int64)
    if held[-1] - held[0] == len(held) - 1:  # increasing without repeats: consecutive
        at = values - held[0]
        hit = (at >= 0) & (at < len(held))
    else:
        at = np.minimum(np.searchsorted(held, values), len(held) - 1)
        hit = held[at] == values
    return hit, at[hit]


def crc32_rows(rows: np.ndarray) -> np.ndarray:
    """[n] uint32: zlib.crc32 of each row's bytes (rows [n, ...] float32)."""
    rows = np.ascontiguousarray(rows)
    return np.fromiter((zlib.crc32(r) for r in rows), np.uint32, len(rows))


@dataclass
class Part:
    """The rows one segment (or a format-1 file) holds of one need: index [n] increasing, the rows' shape [n, (V,) D],
    and where they lie: a segment's rows from byte `offset` of `file` and their crc32s from byte `crc_at` (read for
    the rows a gather reads, each checked against its row), or format 1's array in memory (`rows`, checked whole when
    read: `crc_at` None)."""

    index: np.ndarray
    shape: tuple
    file: Path | None = None
    offset: int = 0
    crc_at: int | None = None
    rows: np.ndarray | None = None

    def crcs(self, at: np.ndarray) -> np.ndarray:
        """[len(at)] uint32: the crc32s of the rows at positions `at`, read as the one span of the file they cover."""
        if not len(at):
            return np.zeros(0, np.uint32)
        lo, hi = int(at.min()), int(at.max()) + 1
        with open(self.file, "rb") as fh:  # type: ignore[arg-type]
            span = np.fromfile(fh, np.dtype("<u4"), hi - lo, offset=self.crc_at + 4 * lo)  # type: ignore[operator]
        if len(span) != hi - lo:
            raise OSError(f"the file ends {4 * (hi - lo - len(span))} bytes short")
        return span[at - lo]

    def read_into(self, out: np.ndarray, at: np.ndarray, dest: np.ndarray) -> None:
        """The rows at positions `at` (in order, repeats allowed) into out[dest] (`out` [n, (V,) D] float32,
        C-contiguous): one read per run of consecutive rows, each row landing in its place (a scatter read: no buffer
        between the file and `out`). No memory map: the kernel maps large page-cache folios whole, and a process's
        memory would count them."""
        if self.rows is not None:
            out[dest] = self.rows[at]
            return
        if not len(at):
            return
        size, buf = out[0].nbytes, memoryview(out).cast("B")
        reads = np.concatenate([[0], np.flatnonzero(np.diff(at) != 1) + 1])  # a new read where the file's rows jump
        starts = np.union1d(reads, np.flatnonzero(np.diff(dest) != 1) + 1)  # a new buffer also where `out`'s rows do
        to = (dest[starts] * size).tolist()  # where each buffer lands in `out`, in bytes
        n = (np.diff(starts, append=len(at)) * size).tolist()  # its bytes
        offset = (self.offset + at[starts] * size).tolist()  # where it lies in the file
        # each read's first buffer (at most IOV_MAX buffers a read), then the end
        first = np.union1d(np.flatnonzero(isin_sorted(starts, reads)), range(0, len(starts), IOV_MAX)).tolist()
        with open(self.file, "rb", buffering=0) as fh:  # type: ignore[arg-type]
            fd = fh.fileno()
            for a, b in zip(first, [*first[1:], len(starts)]):  # a scattered row costs a slice and a read, no copy
                if b == a + 1:
                    bufs, want = [buf[to[a] : to[a] + n[a]]], n[a]
                else:
                    bufs, want = [buf[t : t + k] for t, k in zip(to[a:b], n[a:b])], sum(n[a:b])
                if (got := os.preadv(fd, bufs, offset[a])) != want:
                    _read_rest(fd, bufs, offset[a], got)

    def read(self, a: int, b: int) -> np.ndarray:
        """Rows a..b."""
        at = np.arange(a, min(b, self.shape[0]))
        out = np.empty((len(at), *self.shape[1:]), np.float32)  # [b - a, (V,) D]
        self.read_into(out, at, np.arange(len(at)))
        return out


def _read_rest(fd: int, bufs: list[memoryview], offset: int, got: int) -> None:
    """Fill what a read of `bufs` from `fd` at `offset` left after its first `got` bytes (a read returns at most about
    2 GB)."""
    i = 0  # the first buffer not full
    while got > 0:
        offset += got
        while i < len(bufs) and got >= len(bufs[i]):
            got, i = got - len(bufs[i]), i + 1
        if i == len(bufs):
            return
        bufs[i] = bufs[i][got:]
        got = os.preadv(fd, bufs[i:], offset)
    raise OSError(f"the file ends {sum(map(len, bufs[i:]))} bytes short")


@dataclass(eq=False)
class Store:
    """One store file (which may not exist yet), its segments and its parts folder, the resume point of a fill."""

    path: Path
    key: str | None
    source: dict | None = None  # where this run reads the images (metadata, not key), added to `sources` on a fill
    _meta: dict | None = field(default=None, repr=False)  # the store file's attributes, read and checked once
    _parts: dict = field(default_factory=dict, repr=False)  # Need -> [Part], read once per process
    _held: dict = field(default_factory=dict, repr=False)  # Need -> the indices of its Parts, increasing

    @property
    def work(self) -> Path:
        return self.path.with_name(f".{self.path.name}.parts")

    @property
    def rows(self) -> Path:
        return rows_folder(self.path)

    def meta(self) -> dict:
        """The store file's attributes ({} while the store does not exist), checked once per process."""
        if self._meta is None:
            self._meta = {}
            if self.path.is_file():
                with open_store(self.path, self.key) as f:
                    self._meta = h5.read_attrs(f)
        return self._meta

    def needs(self) -> dict[Need, int]:
        """Need -> the rows held."""
        meta, held = self.meta(), {}
        if meta.get(MARKER) == 1:
            with open_store(self.path, self.key) as f:
                return {need: int(g["index"].shape[0]) for need, g in _groups(f, int(meta["views"]))}
        for seg in meta.get("segments", []):
            for name, n in seg["held"].items():
                need = _need(name, int(meta["views"]))
                held[need] = held.get(need, 0) + n
        return held

    def held(self, pending: bool = False) -> dict[Need, np.ndarray]:
        """Need -> the source indices held (increasing); with `pending` also those of the finished blocks a killed
        fill left (the next fill plans around them and commits them with its own)."""
        held = {need: self._sorted(need) for need in self.needs()}
        for b in self._finished(held) if pending else ():
            need = (b["domain"], b["split"], b["views"])
            held[need] = np.union1d(held.get(need, np.zeros(0, np.int64)), np.asarray(b["rows"], np.int64))
        return held

    def _sorted(self, need: Need) -> np.ndarray:
        if need not in self._held:
            index = [p.index for p in self.parts(need) if len(p.index)] or [np.zeros(0, np.int64)]
            held = np.concatenate(index) if len(index) > 1 else index[0]
            if any(a[-1] > b[0] for a, b in zip(index, index[1:])):  # segments that interleave (a fresh array)
                held.sort(kind="stable")
            self._held[need] = held
        return self._held[need]

    def backbone(self) -> dict | None:
        """The backbone's metadata as a cache records it (None while the store is empty)."""
        return self.meta().get("backbone")

    def parts(self, need: Need, whole: bool = False) -> list[Part]:
        """The Parts holding rows of `need`, in segment order (read once per process); with `whole` read again, their
        index and crc arrays each checked whole against its crc32 (verify, info's digest)."""
        if need not in self._parts or whole:
            meta, parts = self.meta(), []
            if meta.get(MARKER) == 1:
                with open_store(self.path, self.key) as f:
                    g = f.get(need_name(need))
                    if g is not None:
                        rows = checked(self.path, g["rows"])
                        parts.append(Part(checked(self.path, g["index"]), rows.shape, rows=rows))
            for seg in meta.get("segments", []):
                if need_name(need) in seg["held"]:
                    parts.append(_part(self.path, self.rows / seg["file"], seg["meta_sha256"], need, whole))
            self._parts[need] = parts
        return self._parts[need]

    def gather(self, need: Need, wanted: np.ndarray) -> np.ndarray:
        """The rows of the source indices `wanted` ([n, D] or [n, V, D] float32), each checked against its crc."""
        wanted = np.asarray(wanted, np.int64)
        order = np.argsort(wanted, kind="stable")  # read in the store's order: searches and pages go forward
        ranked = wanted[order]
        dim = int(self.backbone()["dim"]) if self.backbone() else 0
        out = np.empty((len(wanted), *((need[2],) if need[2] else ()), dim), np.float32)  # [n, (V,) D]
        crc = np.zeros(len(wanted), np.uint32)  # [n] each row's crc32 as its part records it
        found, plain = np.zeros(len(wanted), bool), np.zeros(len(wanted), bool)  # [n], [n]: format 1's rows
        for part in self.parts(need):
            hit, at = find_sorted(part.index, ranked)
            part.read_into(out, at, order[hit])
            found[order[hit]] = True
            if part.crc_at is None:
                plain[order[hit]] = True
            else:
                crc[order[hit]] = part.crcs(at)
        if not found.all():
            raise UserError(
                f"store {self.path} lacks images of {need[0]}/{need[1]} it was filled with: delete it "
                "and run the same command again"
            )
        rows = out[~plain] if plain.any() else out  # [m, (V,) D]
        if not np.array_equal(crc32_rows(rows), crc[~plain]):
            raise _damaged(self.path, f"{need_name(need)}: a row does not match its crc32")
        return out

    def check(self) -> list[str]:
        """Every row of every segment read against its crc (format 1: every array against its sha256); returns the
        needs whose rows hold NaN or Inf. A damaged store raises DamagedStore."""
        bad = []
        for need in self.needs():
            finite = True
            for part in self.parts(need, whole=True):
                step = max(1, SLICE_BYTES // max(1, 4 * int(np.prod(part.shape[1:]))))
                for a in range(0, part.shape[0], step):
                    rows = part.read(a, a + step)
                    if part.crc_at is not None and not np.array_equal(
                        crc32_rows(rows), part.crcs(np.arange(a, a + len(rows)))
                    ):
                        raise _damaged(self.path, f"{need_name(need)}: a row does not match its crc32")
                    finite &= bool(np.isfinite(rows).all())
            if not finite:
                bad.append(need_name(need))
        return bad

    def digest(self) -> str | None:
        """A digest of the rows held (index and crc of every need, or format 1's array checksums), the same for two
        stores that hold the same embeddings however they were filled; None while empty."""
        meta = self.meta()
        if not meta:
            return None
        h = hashlib.sha256()
        for need in sorted(self.needs()):
            parts = self.parts(need, whole=True)  # every crc is hashed: each array checked first
            index = np.concatenate([p.index for p in parts])
            order = np.argsort(index, kind="stable")
            h.update(need_name(need).encode() + index[order].tobytes())
            for p in parts:
                every = np.arange(p.shape[0])
                h.update((p.crcs(every) if p.crc_at is not None else crc32_rows(p.read(0, p.shape[0]))).tobytes())
        return h.hexdigest()

    # -- filling ----------------------------------------------------------------------------------------------------

    def plan(self, blocks: list[tuple[Need, np.ndarray]]) -> list[Path]:
        """Write the plan of a fill (its blocks, in order, after the finished blocks of a killed fill) and return
        each new block's file."""
        files = [self.work / block_name(need, rows) for need, rows in blocks]
        plan = self._finished() + [
            {"domain": d, "split": s, "views": v, "rows": rows.tolist(), "file": file.name}
            for ((d, s, v), rows), file in zip(blocks, files)
        ]
        with writing(self.work):
            (self.work / "plan.json.partial").write_text(json.dumps(plan))
            os.replace(self.work / "plan.json.partial", self.work / "plan.json")
        return files

    def _finished(self, held: dict | None = None) -> list[dict]:
        """The blocks of the plan in the parts folder whose files are complete and whose rows are not held yet."""
        plan_file = self.work / "plan.json"
        if not plan_file.is_file():
            return []
        try:  # what a killed fill left: a plan, blocks and meta.json that another program may have damaged since
            plan = json.loads(plan_file.read_text())
            held = self.held() if held is None else held
            done = [
                b
                for b in plan
                if (self.work / b["file"]).is_file()  # and not committed by a fill killed after it
                and not isin_sorted(
                    b["rows"], held.get((b["domain"], b["split"], b["views"]), np.zeros(0, np.int64))
                ).all()
            ]
            for b in done:  # each block whole (header and rows), before anything plans around it
                if len(np.load(self.work / b["file"], mmap_mode="r")) != len(b["rows"]):
                    raise ValueError(f"{b['file']} does not hold the rows its plan lists")
            return done
        except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
            raise self._damaged_parts(e) from None

    def commit(self, identity: dict) -> int:
        """Write the finished blocks of the plan in the parts folder as one segment and name it in the store file;
        returns the images added."""
        done = self._finished()
        try:
            if done:
                backbone = self.backbone() or json.loads((self.work / "meta.json").read_text())
                merged = self._merged(done)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise self._damaged_parts(e) from None
        if done:
            meta, segments = self.meta(), list(self.meta().get("segments", []))
            claim(self.rows, "rows")
            with writing(self.rows):
                if meta.get(MARKER) == 1:  # format 1: its rows become the first segment, checked as they are read
                    old = {need: (p.index, p.read) for need in self.needs() for p in self.parts(need)}
                    segments.append(_segment(self.rows / f"{len(segments) + 1:06d}.h5", old))
                segments.append(_segment(self.rows / f"{len(segments) + 1:06d}.h5", merged))
            views = max([int(meta.get("views", 0))] + [v for _, _, v in merged])
            with writing(self.path):
                _write(self.path, self.key, identity, backbone, views, segments, self._sources())
            self._meta, self._parts, self._held = None, {}, {}
        plan_file = self.work / "plan.json"
        for b in json.loads(plan_file.read_text()) if plan_file.is_file() else []:
            (self.work / b["file"]).unlink(missing_ok=True)
        plan_file.unlink(missing_ok=True)
        return sum(len(b["rows"]) for b in done if not b["views"])

    def _damaged_parts(self, e: Exception) -> UserError:
        return UserError(
            f"the parts folder {self.work} (finished blocks of a killed fill) is damaged "
            f"({type(e).__name__}: {first_line(e, 120)}): remove it (rm -r) and run the same command again"
        )

    def _sources(self) -> list[dict]:
        """Where the images of this store were read from, one entry per distinct source in the order of the fills."""
        old = self.meta().get("sources") or []
        return [*old, self.source] if self.source and self.source not in old else old

    def _merged(self, done: list[dict]) -> dict:
        """Need -> (the source indices the blocks add, increasing; rows(a, b): their rows a..b in that order)."""
        pieces: dict[Need, list] = {}
        for b in done:
            pieces.setdefault((b["domain"], b["split"], b["views"]), []).append(
                (np.asarray(b["rows"], np.int64), self.work / b["file"])
            )
        held = self.held()
        merged = {}
        for need, got in pieces.items():
            index = np.concatenate([p[0] for p in got])  # [n]
            order = np.argsort(index, kind="stable")
            if (np.diff(index[order]) == 0).any() or isin_sorted(index, held.get(need, np.zeros(0, np.int64))).any():
                raise UserError(f"store {self.path}: a block repeats rows it holds; delete {self.work} and run again")
            block = np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(got)])[order]  # [n] block of each row
            at = np.concatenate([np.arange(len(p[0])) for p in got])[order]  # [n] its position in the block

            def rows(a: int, b: int, got=got, block=block, at=at) -> np.ndarray:
                out = None
                for i in np.unique(block[a:b]):
                    mine = block[a:b] == i
                    part = np.load(got[i][1], mmap_mode="r")[at[a:b][mine]]  # [m, (V,) D], the map dropped after
                    out = np.empty((b - a, *part.shape[1:]), np.float32) if out is None else out  # [b - a, (V,) D]
                    out[mine] = part
                return out

            merged[need] = (index[order], rows)
        return merged


def _need(name: str, views: int) -> Need:
    domain, split, k = name.rsplit("/", 2)
    return domain, split, views if k == "views" else 0


def _groups(f: h5py.File, views: int):
    """(Need, group) of every kind a format-1 file holds, in file order."""
    for domain, splits in f.items():
        for split, kinds in splits.items():
            for name, g in kinds.items():
                yield (domain, split, views if name == "views" else 0), g


def _segment(path: Path, merged: dict) -> dict:
    """Write one segment file holding `merged` (Need -> (index [n] increasing, rows(a, b))), complete or absent;
    returns its entry in the store file: {file, meta_sha256, held}."""
    held = {}
    with h5.written(path, path.with_name(path.name + ".partial"), align=ALIGN) as f:
        for need, (index, rows) in sorted(merged.items()):
            if not len(index):
                continue
            n, first = len(index), rows(0, min(1, len(index)))
            loc = h5py.Group(h5._parent(f.id, need_name(need) + "/rows"))
            ds = h5py.Dataset(h5._new_dataset(loc.id, "rows", (n, *first.shape[1:]), np.dtype("<f4")))
            crc = np.empty(n, np.uint32)  # [n]
            step = max(1, SLICE_BYTES // max(1, first[:1].nbytes))
            for a in range(0, n, step):
                chunk = rows(a, min(n, a + step))  # [s, (V,) D]
                ds[a : a + len(chunk)] = chunk
                crc[a : a + len(chunk)] = crc32_rows(chunk)
            for name, data in (("index", index), ("crc", crc)):
                loc.create_dataset(name, data=data, track_times=False).attrs["crc32"] = zlib.crc32(data)
            if index[-1] - index[0] == n - 1:  # a run (increasing, no repeats): readers need not read the index
                loc["index"].attrs["first"] = np.int64(index[0])
            held[need_name(need)] = n
        digest = h5.meta_sha256(f)
    return {"file": path.name, "meta_sha256": digest, "held": held}


def _part(store: Path, file: Path, digest: str, need: Need, whole: bool = False) -> Part:
    """The Part of segment `file` (whose meta_sha256 the store file records as `digest`) holding `need`. Its index
    is read and checked against its crc32 unless the index is the run its attribute `first` names (covered by the
    segment's meta_sha256); with `whole` (a verify) the index and crc arrays are read and checked whatever they are."""
    try:
        with h5py.File(file, "r") as f:
            if h5.meta_sha256(f) != digest:
                raise _damaged(store, f"segment {file.name}: metadata checksum mismatch")
            g = f[need_name(need)]
            ds, first = g["rows"], h5.plain(g["index"].attrs.get("first"))
            index = None if first is None else np.arange(first, first + ds.shape[0])  # [n] the run it names
            arrays = {k: g[k][...] for k in ("index", "crc") if whole or (k == "index" and index is None)}
            if any(zlib.crc32(v) != h5.plain(g[k].attrs.get("crc32")) for k, v in arrays.items()) or (
                index is not None and "index" in arrays and not np.array_equal(arrays["index"], index)
            ):
                raise _damaged(store, f"segment {file.name}: {need_name(need)}: an index does not match its crc32")
            index = arrays["index"] if index is None else index
            offset, crc_at, shape = ds.id.get_offset(), g["crc"].id.get_offset(), ds.shape
    except DamagedStore:
        raise
    except (OSError, KeyError) as e:
        raise _damaged(store, f"segment {file.name}: {first_line(e, 120)}") from None
    if offset is None:  # no rows: HDF5 allocated nothing
        return Part(index, shape, rows=np.zeros(shape, np.float32))
    return Part(index, shape, file, offset, crc_at)


def open_store(path: Path, key: str | None = None) -> h5py.File:
    """A store file opened read-only after checking its format, its metadata checksum and (given) its key."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise _damaged(path, f"not a readable HDF5 file ({e})") from None
    problem = None
    if h5.plain(f.attrs.get(MARKER)) not in READS:
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


def checked(path: Path, ds: h5py.Dataset) -> np.ndarray:
    """The array of a format-1 dataset `ds`, refused in one line when its bytes do not match its stored sha256."""
    data = ds[...]
    if h5.plain(ds.attrs.get("sha256")) != hashlib.sha256(np.ascontiguousarray(data)).hexdigest():
        raise _damaged(path, f"{ds.name}: sha256 mismatch")
    return data


def _write(path: Path, key, identity: dict, backbone: dict, views: int, segments: list, sources: list) -> None:
    """The store file naming `segments`, written beside `path` and renamed over it."""
    images = sum(n for seg in segments for name, n in seg["held"].items() if not name.endswith("/views"))
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
                "images": images,
                "segments": segments,
            },
        )
        f.attrs["meta_sha256"] = h5.meta_sha256(f)
