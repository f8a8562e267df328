"""Atomic file writes for results: a reader sees the old file or the new one, never a half-written one.

The text (or bytes) goes to `.NAME.PID.tmp` beside the target and is renamed over it. A failed write removes its temporary; a
writer killed outright (kill -9, power loss) cannot, so the next writer of the same file removes the temporaries of
processes that no longer exist.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path


def write_atomic(path: str | Path, text: str | bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_orphans(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(text) if isinstance(text, bytes) else tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
