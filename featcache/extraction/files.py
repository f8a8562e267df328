"""How the extraction half writes: every file complete or absent, one writer per folder, a full disk one line.

A file is written as `NAME.partial`, synced and renamed into place (`synced`). A parts folder is the resume point
of a store's fill; its exclusive lock (`locked`) keeps two extractions from filling one store at once: the second
waits, then finds the images held. Readers only ever see finished files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import UserError

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
            raise DiskFullError(f"file size limit reached while writing {target} ({os.strerror(code)}, ulimit -f): "
                                "raise the limit and run the same command again; finished blocks are kept and "
                                "resumed") from None
        raise DiskFullError(f"disk full while writing {target} ({os.strerror(code)}): free space and run the same "
                            "command again; finished blocks are kept and resumed") from None


@contextmanager
def locked(work: Path) -> Iterator[None]:
    """Hold the exclusive lock of the folder `work` (created if need be). The holder may delete the folder: a
    waiter then finds its lock file unlinked, and locks the new folder instead."""
    while True:
        work.mkdir(parents=True, exist_ok=True)
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


def unlocked(work: Path) -> bool:
    """Whether nobody holds the lock of `work` now (a folder left by a killed run)."""
    try:
        with open(work / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except BlockingIOError:
        return False
    except FileNotFoundError:
        return True


def drop_leftover(work: Path) -> None:
    """Remove a parts folder that a fill killed after its commit left without finished blocks (when nobody holds
    it); one that holds blocks is a resume point, kept for the next fill of its store."""
    try:
        with open(work / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(lock, work / "lock") and not any(work.glob("*.npy")):
                shutil.rmtree(work)
    except (FileNotFoundError, BlockingIOError):
        pass


@contextmanager
def synced(path: Path) -> Iterator:
    """A file handle on `path.partial`; when the block ends without error the file is synced and renamed to `path`,
    so `path` exists only complete. Plain writes, not a memory map: a full disk is an OSError, never a SIGBUS."""
    partial = path.with_name(path.name + ".partial")
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
