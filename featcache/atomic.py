"""Atomic file writes for results: a reader sees the old file or the new one, never a half-written one.

The text (or bytes) goes to `.NAME.PID.tmp` beside the target and is renamed over it. A failed write removes its
temporary; a writer killed outright (kill -9, power loss) cannot, so the next writer of the same file removes the
temporaries of processes that no longer exist.

One output layer for every command that writes results (`train`, `grid`, `report`, `reproduce`): `check_folder`
refuses an unusable `--out` before any work starts, and `output_errors` turns the OS errors of creating a folder or
writing a file (EEXIST, ENOTDIR, EACCES, EPERM, EROFS, ENOSPC, EDQUOT, EFBIG) into one-line `UserError`s.
"""

from __future__ import annotations

import errno
import glob
import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import UserError

_HOW = {
    errno.EEXIST: "a file is in the way of a folder: pass --out a folder path",
    errno.ENOTDIR: "a file is in the way of a folder: pass --out a folder path",
    errno.EISDIR: "a folder is in the way of a file: move it or pass another --out",
    errno.EACCES: "permission denied: pass --out a folder you can write to",
    errno.EPERM: "permission denied: pass --out a folder you can write to",
    errno.EROFS: "read-only file system: pass --out a folder you can write to",
    errno.ENOSPC: "disk full: free space and run the same command again",
    errno.EDQUOT: "disk quota exceeded: free space and run the same command again",
    errno.EFBIG: "file size limit reached (ulimit -f): raise the limit and run the same command again",
    errno.ENAMETOOLONG: "file name too long: pass a shorter --out",
}


def output_error(e: OSError, path: str | Path, flag: str = "--out") -> UserError | None:
    """The one-line UserError for an OS error while writing `path` (its fix names `flag`), or None for an error that
    is not about output."""
    code = getattr(e, "errno", None)
    if code not in _HOW:
        return None
    return UserError(f"cannot write {path}: {os.strerror(code)}; {_HOW[code].replace('--out', flag)}")


@contextmanager
def output_errors(path: str | Path, flag: str = "--out"):
    """Inside: an OSError of creating or writing `path` becomes one `UserError` line (exit code 2)."""
    try:
        yield
    except OSError as e:
        mapped = output_error(e, getattr(e, "filename", None) or path, flag)
        if mapped is None:
            raise
        raise mapped from None


def check_names(path: str | Path, flag: str = "--out") -> None:
    """Refuse, before any work, a path the file system cannot hold: a name (between two '/') longer than its limit
    (NAME_MAX, 255 bytes on most), or a whole path longer than PATH_MAX."""
    path = Path(path)
    probe = path.absolute()
    while not os.path.isdir(probe) and probe.parent != probe:  # the deepest existing folder: its file system
        probe = probe.parent
    limits = {}
    for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits[name] = os.pathconf(probe, name)
        except (OSError, ValueError):
            limits[name] = default
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > limits["PC_NAME_MAX"]:
            shown = name if len(name) <= 40 else f"{name[:40]}..."
            raise UserError(
                f"{flag}: the name {shown!r} is {size} bytes, over the file system's limit of "
                f"{limits['PC_NAME_MAX']}: pass a shorter {flag}"
            )
    size = len(os.fsencode(os.path.abspath(path)))
    if size >= limits["PC_PATH_MAX"]:
        raise UserError(
            f"{flag}: the path is {size} bytes, over the file system's limit of {limits['PC_PATH_MAX']}: "
            f"pass a shorter {flag}"
        )


def check_folder(folder: str | Path, flag: str = "--out") -> None:
    """Refuse, before any work, an output folder that cannot be created or written: a name too long for the file
    system, an existing file, a path below a file, a folder without write permission. Creates nothing."""
    folder = Path(folder)
    check_names(folder, flag)
    probe = folder
    while not probe.exists():
        if probe.is_symlink():  # a dangling link
            raise UserError(f"{flag} {folder}: {probe} is a broken symbolic link: pass another folder")
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == folder else f"is below the file {probe}"
        raise UserError(f"{flag} {folder} {where}, not a folder: pass {flag} a folder path")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"{flag} {folder}: {probe} is not writable (permission denied): pass {flag} a folder you can write to"
        )


def make_folder(folder: str | Path) -> Path:
    """mkdir -p with the one-line output errors."""
    folder = Path(folder)
    with output_errors(folder):
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def missing_folders(folder: str | Path) -> list[Path]:
    """The folders of `folder`'s path that do not exist yet, deepest first: what `make_folder` would create."""
    missing, folder = [], Path(folder)
    while not folder.exists() and not folder.is_symlink() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders of `missing_folders` again, deepest first, as long as they are empty (a refused command
    leaves the file system as it found it)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): what is in it stays
            return


def _stage(path: Path, text: str | bytes | Callable[[BinaryIO], None], durable: bool = False) -> Path:
    """Write `text` to the temporary `.NAME.PID.tmp` beside `path` (removed again should the write fail); `durable`
    fsyncs it. A callable `text` writes into the open file itself (a large body never held in memory whole)."""
    make_folder(path.parent)
    with output_errors(path):
        _drop_orphans(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            if callable(text):
                with open(tmp, "wb") as f:
                    text(f)
            else:
                tmp.write_bytes(text) if isinstance(text, bytes) else tmp.write_text(text)
            if durable:
                sync(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def write_atomic(path: str | Path, text: str | bytes | Callable[[BinaryIO], None], durable: bool = False) -> None:
    """Write `path` atomically (`text`: its body, or a function writing it into the open file); an OS error of the
    output (see `output_errors`) is one UserError line and leaves no temporary behind. `durable` also fsyncs the
    file before the rename and its folder after it, so the new file survives a power loss (a training checkpoint)."""
    path = Path(path)
    tmp = _stage(path, text, durable)
    with output_errors(path):
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            sync(path.parent)


def sync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename in it), to the disk: it survives a power cut, not only a
    kill."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_together(files: list[tuple[Path, str | bytes]]) -> None:
    """Write every file atomically: first all their temporaries, then the renames in order (put last the one whose
    presence means the others are complete), so a process killed while writing leaves temporaries (removed by the
    next writer of those names), not some of the files. Should one fail, the files this call created are removed
    again, and the folders it created when they are empty: all of them or none."""
    files = [(Path(path), body) for path, body in files]
    made = missing_folders(files[0][0].parent) if files else []
    staged, created = [], []
    try:
        for path, body in files:
            staged.append(_stage(path, body))
        for (path, _), tmp in zip(files, staged):
            existed = path.exists()
            with output_errors(path):
                os.replace(tmp, path)
            if not existed:
                created.append(path)
    except BaseException:
        for path in [*staged, *created]:
            path.unlink(missing_ok=True)
        remove_empty(made)
        raise


def _drop_orphans(path: Path) -> None:
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
