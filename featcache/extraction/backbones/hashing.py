"""sha256 of weight files, computed once per file version: `weights_identity` runs on every extraction, and
hashing a large checkpoint each time would cost more than the cache hit it decides."""

from __future__ import annotations

from pathlib import Path

from ...cache.identity import file_sha256


def sha256(path: Path) -> str:
    """Hex sha256 of the file at `path`, remembered across processes by its stat (`cache.identity.file_sha256`)."""
    return file_sha256(path)
