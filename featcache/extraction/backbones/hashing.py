"""sha256 of weight files, computed once per file version: `weights_identity` runs on every extraction, and
hashing a large checkpoint each time would cost more than the cache hit it decides."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """Hex sha256 of the file at `path`, cached by (path, size, mtime)."""
    st = path.stat()
    return _sha256_cached(path, st.st_size, st.st_mtime_ns)
