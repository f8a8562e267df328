"""The sha256 of each image file of a dataset, remembered by the file's stat so that a later run reads no bytes.

A dataset on disk is identified by what its files hold, not by where they are (`Dataset.fingerprint`). Reading every
byte on every run would cost a pass over the data, so the hashes are kept in a sidecar index in the store folder, one
file per dataset folder (`.contents-<hash of its real path>.json`, written atomically), keyed by each file's name
relative to that folder with its size, mtime, ctime, inode and device. A later run stats each file and reuses the
hash when all five match; a moved or copied folder is another real path, hashed once. As git's index does, an entry
whose file changed less than `RACY_NS` before it was hashed is not trusted (a rewrite of the same size in the same
timestamp tick keeps every stat field), so that file is hashed again on the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

from ..atomic import write_atomic
from ..errors import UserError

RACY_NS = 2_000_000_000  # an entry hashed within 2 s of its file's last change is hashed again (1 s timestamps)
THREADS = 8  # files hashed at once: the reads overlap on a network or spinning disk, hashlib releases the GIL
_CHUNK = 1 << 20


def sidecar(folder: Path, real_root: str) -> Path:
    return Path(folder) / f".contents-{hashlib.sha256(real_root.encode()).hexdigest()[:16]}.json"


class Contents:
    """sha256 of files' bytes, looked up in (and added to) the sidecar index of the store folder `folder`; without a
    folder every file is read. `reads` counts the files whose bytes were read."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self.reads = 0
        self._known: dict[str, dict[str, list]] = {}  # real root -> {relative name: entry}
        self._new: dict[str, dict[str, list]] = {}

    def hashes(self, root: str | Path, paths: list[Path], names: list[str]) -> list[tuple[int, str]]:
        """(size, sha256 hex) of each file of `paths`, whose names relative to the dataset folder `root` are
        `names` (the stat fields, not the name, say whether an entry still describes the file)."""
        real_root = os.path.realpath(root)
        known = self._index(real_root)
        stats = [_stat(p) for p in paths]
        out: list[str | None] = [_valid(known.get(n), st) for n, st in zip(names, stats)]  # sha256 or None
        todo = [i for i, d in enumerate(out) if d is None]
        if todo:
            with ThreadPoolExecutor(min(THREADS, len(todo))) as pool:
                hashed = list(pool.map(lambda i: _hash(paths[i]), todo))
            new = self._new.setdefault(real_root, {})
            for i, (digest, st, at) in zip(todo, hashed):
                entry = [*_signature(st), digest, at]
                if not _same(known.get(names[i]), entry):
                    known[names[i]] = new[names[i]] = entry
                out[i], stats[i] = digest, st  # the size the bytes were read at
            self.reads += len(todo)
        return [(st.st_size, digest) for st, digest in zip(stats, out)]

    def save(self) -> None:
        """Add the hashes this object computed to the sidecar files, when the store folder exists: extract calls it
        when a run ends well, so a refused run changes nothing. A folder that cannot be written only costs the next
        run a read of the files."""
        if self.folder is None or not self.folder.is_dir():
            return
        for real_root, new in self._new.items():
            if not new:
                continue
            file = sidecar(self.folder, real_root)
            files = _read(file, real_root) | new  # another run may have added entries meanwhile
            with suppress(UserError, OSError):
                write_atomic(file, json.dumps({"root": real_root, "files": files}, separators=(",", ":")))
        self._new.clear()

    def _index(self, real_root: str) -> dict[str, list]:
        if real_root not in self._known:
            self._known[real_root] = {} if self.folder is None else _read(sidecar(self.folder, real_root), real_root)
        return self._known[real_root]


def _read(file: Path, real_root: str) -> dict[str, list]:
    """A sidecar's entries; an unreadable or foreign one counts as empty (its files are hashed again)."""
    try:
        index = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict) or index.get("root") != real_root or not isinstance(index.get("files"), dict):
        return {}
    return index["files"]


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _same(old: list | None, new: list) -> bool:
    """Whether the entry `new` adds nothing to `old`: the same file and hash, and `new` not trusted either (its file
    changed just before it was hashed), so a quick second run does not rewrite the sidecar."""
    return _entry(old) and old[:6] == new[:6] and not _trusted(new)


def _valid(entry: list | None, st: os.stat_result) -> str | None:
    """The remembered hash when the file's stat is the one it was hashed at and it had not changed just before."""
    return entry[5] if _entry(entry) and entry[:5] == _signature(st) and _trusted(entry) else None


def _entry(entry) -> bool:
    return isinstance(entry, list) and len(entry) == 7


def _trusted(entry: list) -> bool:
    """Whether the file last changed more than RACY_NS before its bytes were read: a later change in the same
    timestamp tick would keep every stat field."""
    return max(entry[1], entry[2]) < entry[6] - RACY_NS


def _stat(path: Path) -> os.stat_result:
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"cannot read image {path} ({e.strerror}): repair or delete the file") from None
    require_regular(path, st)
    return st


def require_regular(path: Path, st: os.stat_result | None = None) -> None:
    """One line unless `path` is a regular file after symlinks: a named pipe would block a read forever, a device
    never ends, a symlink loop or a folder is no image."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(f"cannot read image {path} ({e.strerror}): repair or delete the file") from None
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise UserError(f"{path} is {kind}, not an image file: remove it or move it out of the dataset folder")


_KINDS = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def _hash(path: Path) -> tuple[str, os.stat_result, int]:
    """(sha256 hex, the stat it was read at, the time before reading). Opened without blocking and checked, so a file
    swapped for a named pipe cannot hang the read; the stat is taken before the bytes, so a change while reading
    shows on the next run."""
    at = time.time_ns()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(f"cannot read image {path} ({e.strerror}): repair or delete the file") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        require_regular(path, st)
        os.set_blocking(fd, True)
        h = hashlib.sha256()
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest(), st, at
