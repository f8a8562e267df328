"""How the extraction half writes: every file complete or absent, one writer per folder, a full disk one line.

A file is written as `NAME.<writer>.partial`, synced and renamed into place (`synced`). A parts folder is the resume
point of a store's fill; its exclusive lock (`locked`) keeps two extractions from filling one store at once: the second
waits, then finds the images held. Readers only ever see finished files.

Every folder featcache stages work in (a store's parts folder `.NAME.parts`, migrate's `.NAME.migrating`, gc's
`.quarantine`) is created by `claim` with featcache's marker, the file `featcache.json` ({"made_by": "featcache",
"kind": ...}); a folder of such a name without the marker is a user's, refused in one line and never written into
nor removed. `remove_own` removes only marked folders.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import UserError

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, quota, file size limit


class DiskFullError(UserError):
    """The disk filled up while writing; finished blocks are kept so the same command resumes."""


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """Turn a full disk (or quota, or file size limit) while writing `target` into one `DiskFullError` line that
    names which of them."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # HDF5 reports a failed write as a RuntimeError naming the errno
        found = re.search(r"errno = (\d+)", str(e))
        code = getattr(e, "errno", None) or (int(found.group(1)) if found else None)
        if code not in _DISK_FULL:
            raise
        if code == errno.EFBIG:
            raise DiskFullError(
                f"file size limit reached while writing {target} ({os.strerror(code)}, ulimit -f): "
                "raise the limit and run the same command again; finished blocks are kept and "
                "resumed"
            ) from None
        raise DiskFullError(
            f"disk full while writing {target} ({os.strerror(code)}): free space and run the same "
            "command again; finished blocks are kept and resumed"
        ) from None


MARKER = "featcache.json"  # in every folder featcache stages work in: the proof that the folder is its own
# kind -> what featcache keeps in a folder of that kind (for the line that refuses a user's folder of the same name)
KINDS = {
    "parts": "keeps the finished blocks of a store's fill",
    "migrating": "stages a cache's migration",
    "quarantine": "moves damaged stores aside",
    "rows": "keeps a store's rows",
}
CLAIM_WAIT = 2.0  # seconds to wait for the marker of a folder another featcache process has just created


def own(folder: Path, kind: str | None = None) -> dict | None:
    """The marker of `folder` ({"made_by": "featcache", "kind": ...}) when it is a real folder, not a symbolic link,
    holding featcache's marker file (of `kind`, given); None otherwise. Never opens anything but a regular file."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode) or not stat.S_ISREG(os.lstat(folder / MARKER).st_mode):
            return None
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("made_by") != "featcache":
        return None
    return marker if kind is None or marker.get("kind") == kind else None


def write_marker(folder: Path, marker: dict) -> None:
    """Write (or replace) the marker file of `folder`, complete or not at all."""
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    try:
        with writing(folder):
            tmp.write_text(json.dumps({"made_by": "featcache"} | marker, sort_keys=True))
            os.replace(tmp, folder / MARKER)
    finally:
        tmp.unlink(missing_ok=True)


def claim(folder: Path, kind: str) -> None:
    """Make `folder` featcache's folder of `kind`: create it (and its parents) with the marker, or find it marked.
    A folder, file or link of that name without the marker is a user's: one UserError line, nothing written into it.
    An empty folder (one another featcache process has just created) gets `CLAIM_WAIT` seconds to show its marker."""
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        try:
            os.mkdir(folder)
        except FileNotFoundError:
            folder.parent.mkdir(parents=True, exist_ok=True)
            continue
        except FileExistsError:
            if own(folder, kind) is not None:
                return
            if _just_made(folder) and time.monotonic() <= deadline:
                time.sleep(0.01)
                continue
            if own(folder, kind) is None:  # looked again: its maker may have marked and used it between our looks
                raise UserError(
                    f"{folder} is in the way: featcache {KINDS[kind]} in a folder of that name, and this "
                    f"one is not featcache's (it lacks featcache's marker {MARKER}); move or rename it, "
                    "then run the same command again"
                ) from None
            return
        try:
            write_marker(folder, {"kind": kind})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # just made by us: nothing of anyone else's is in it
            raise
        return


def _just_made(folder: Path) -> bool:
    """Whether `folder` may be one another featcache process has just made: a real folder holding nothing but,
    perhaps, its marker's temporary file (`remove_own` never leaves a marked folder half removed under its name)."""
    try:
        return not folder.is_symlink() and all(e.name.startswith(f".{MARKER}.") for e in os.scandir(folder))
    except FileNotFoundError:  # removed meanwhile: the next mkdir makes it
        return True
    except OSError:
        return False


def remove_own(folder: Path) -> bool:
    """Remove `folder` if it is featcache's (marked): renamed aside first, so no other process ever sees it half
    removed (one that holds its lock finds the lock file gone, one that claims it makes a new one). Returns whether
    it was removed; a folder without the marker is left as it is."""
    if own(folder) is None:
        return False
    gone = folder.with_name(f"{folder.name}.{uuid.uuid4().hex[:8]}.gone")
    os.rename(folder, gone)
    shutil.rmtree(gone)
    return True


@contextmanager
def locked(work: Path, kind: str = "parts") -> Iterator[None]:
    """Hold the exclusive lock of featcache's folder `work` (claimed: created with its marker if need be; a user's
    folder of that name is refused). The holder may remove the folder (`remove_own`): a waiter then finds its lock
    file gone, and locks the new folder instead."""
    while True:
        claim(work, kind)
        try:
            lock = open(work / "lock", "a")
        except FileNotFoundError:  # the holder removed the folder between our mkdir and open
            continue
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _same_file(lock, work / "lock"):
                yield
                return


def _same_file(handle, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev)


def remove_unlocked(work: Path, when=lambda work: True) -> bool:
    """Remove featcache's folder `work` (marked) if nobody holds its lock now and `when(work)` holds, deciding and
    removing under its lock; returns whether it was removed. A folder without the marker is never touched."""
    if own(work) is None:
        return False
    try:
        with open(work / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return _same_file(lock, work / "lock") and when(work) and remove_own(work)
    except (FileNotFoundError, BlockingIOError):
        return False


def drop_leftover(work: Path) -> None:
    """Remove a parts folder that a fill killed after its commit left without finished blocks (when nobody holds
    it); one that holds blocks is a resume point, kept for the next fill of its store."""
    remove_unlocked(work, lambda work: not any(work.glob("*.npy")))


@contextmanager
def synced(path: Path) -> Iterator:
    """A file handle on `path.<writer>.partial`, a name of this writer's own (tasks of one fill may write the same
    file at once: the last complete one wins); when the block ends without error the file is synced and renamed to
    `path`, so `path` exists only complete. Plain writes, not a memory map: a full disk is an OSError, never a
    SIGBUS."""
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.partial")
    with writing(path), open(partial, "wb") as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)


@contextmanager
def npy_file(path: Path, shape: tuple[int, ...]) -> Iterator:
    """An open `.npy` of float32 `shape`, filled by plain writes of its rows in order, complete or absent."""
    with synced(path) as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": shape})
        yield fh


def remove_partials(work: Path) -> None:
    for partial in work.glob("*.partial"):
        partial.unlink()
