"""Content keys: what determines an embedding, and what determines a client cache, each hashed to one sha256.

A store's key covers the images (dataset identity), the backbone (weights sha256), the preprocessing, the precision,
the views and noise, the library versions and featcache's own embedding code; a cache's key adds the partition and
the partition code. The code is hashed by its syntax tree without docstrings, so editing a comment or a docstring
keeps every key.

Parsing and dumping the syntax trees costs a tenth of a second, in every process that asks for a key, so each file's
digest is remembered across processes in a per-user memo (`memo_path`), keyed by the file's path and its size,
mtime, ctime, inode and device, under the Python and featcache versions and this module's own file: any edit, copy
or checkout of a file changes its key and the file is hashed again. Weight files' sha256 (`file_sha256`) are
remembered the same way. As in git's index, a file that changed less than `RACY_NS` before it was hashed is not
remembered (a rewrite of the same size in the same timestamp tick keeps every stat field). A memo that is missing,
damaged or cannot be written counts as empty.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Callable

from .. import __version__
from ..atomic import write_atomic
from ..errors import UserError
from .write import FORMAT

_ROOT = Path(__file__).resolve().parents[1] / "extraction"  # the code whose files key the embeddings
# the code whose output is an embedding (which pixels, how they are prepared, how a backbone is built and run) ...
EMBEDDING_CODE = ("pipeline.py", "embed.py", "backbones/*.py", "datasets/*.py")
# ... and the code that decides which images a client holds
PARTITION_CODE = ("partition/*.py",)
RACY_NS = 2_000_000_000  # a file hashed within 2 s of its last change is not remembered (1 s timestamps)
MEMO_FILES = 1024  # a memo grown past this many files keeps the ones the last call used


def content_key(manifest: dict) -> str:
    """sha256 of the canonical JSON of `manifest`."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def memo_path() -> Path | None:
    """The memo of file digests in the user's cache folder ($XDG_CACHE_HOME, else ~/.cache), one file per Python
    and featcache installation (two checkouts never overwrite each other's); None when neither is an absolute
    path."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG default
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    install = hashlib.sha256(f"{sys.executable}\0{__file__}".encode()).hexdigest()[:16]
    return Path(base) / "featcache" / f"digests-{install}.json"


def _read_source(rel: str) -> bytes:
    return (_ROOT / rel).read_bytes()


@functools.lru_cache(maxsize=256)
def _syntax_sha256(source: bytes) -> bytes:
    """sha256 of `_syntax(source)`, remembered by source: every extraction asks for the same files' keys."""
    return hashlib.sha256(_syntax(source)).digest()


def _syntax(source: bytes) -> bytes:
    """The module's syntax tree without docstrings: what it computes, not how it is commented."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def code_identity(patterns: tuple[str, ...] = EMBEDDING_CODE, root: Path = _ROOT) -> dict:
    """{"files": [...], "sha256": ...} over the names and syntax trees of the files `patterns` match below `root`
    (default featcache/extraction), in order (a file that cannot be read counts as empty, so the key still changes
    when it comes back)."""
    files = []
    for pattern in patterns:
        files += sorted(p.relative_to(root).as_posix() for p in root.glob(pattern)) if "*" in pattern else [pattern]
    memo = _Memo(memo_path())
    h = hashlib.sha256()
    for rel in files:
        path = os.path.abspath(root / rel)
        read = functools.partial(_read_source, rel) if root == _ROOT else Path(path).read_bytes
        try:
            digest = memo.digest(path, "syntax", lambda read=read: _syntax_sha256(read()))
        except OSError:
            digest = hashlib.sha256(b"").digest()
        h.update(rel.encode() + b"\0" + digest)
    memo.save()
    return {"files": files, "sha256": h.hexdigest()}


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the bytes of the file at `path`, remembered by its stat (a weight file is read once per
    version, not in every process); OSError when it cannot be read."""
    memo = _Memo(memo_path())
    digest = memo.digest(os.path.abspath(path), "bytes", functools.partial(_bytes_sha256, path))
    memo.save()
    return digest.hex()


def _version(dist: str) -> str | None:
    import importlib.metadata as md  # lazy: its 40 ms only where a key is computed

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _bytes_sha256(path: str | Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


class _Memo:
    """The remembered digests of the memo file at `path` (None: none), each entry [size, mtime_ns, ctime_ns, inode,
    device, sha256 hex, ns when hashed] by what was hashed and the file's absolute path ("syntax:/…", "bytes:/…")."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.stamp = _stamp()
        self.files: dict[str, list] = {}
        self.used: set[str] = set()
        self.added = False
        if path is None or self.stamp is None:
            return
        try:
            memo = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return
        if isinstance(memo, dict) and memo.get("stamp") == self.stamp and isinstance(memo.get("files"), dict):
            self.files = memo["files"]

    def digest(self, path: str, kind: str, compute: Callable[[], bytes]) -> bytes:
        """`compute()`, the `kind` digest of the file at the absolute `path`, or the one remembered at the file's
        present stat; OSError when the file cannot be read."""
        key = f"{kind}:{path}"
        hashed_at = time.time_ns()  # before the stat: a change after it is later still
        with open(path, "rb") as f:  # an open revalidates an NFS client's cached attributes (close-to-open)
            st = os.fstat(f.fileno())
        entry = self.files.get(key)
        if _valid(entry, st):
            self.used.add(key)
            return bytes.fromhex(entry[5])
        digest = compute()
        if max(st.st_mtime_ns, st.st_ctime_ns) < hashed_at - RACY_NS:
            self.files[key] = [*_signature(st), digest.hex(), hashed_at]
            self.used.add(key)
            self.added = True
        return digest

    def save(self) -> None:
        """Write the entries this memo added, beside those another process wrote meanwhile; no fsync (a memo lost
        to a power cut costs one hashing)."""
        if not self.added or self.path is None:
            return
        files = _Memo(self.path).files | {k: self.files[k] for k in self.used}
        if len(files) > MEMO_FILES:
            files = {k: files[k] for k in self.used}
        with suppress(OSError, UserError):
            write_atomic(self.path, json.dumps({"stamp": self.stamp, "files": files}, separators=(",", ":")))


def _stamp() -> list | None:
    """What every remembered digest depends on besides its file: Python (its syntax trees), featcache and this
    module's file (the hashing); None when that file cannot be read."""
    try:
        return [sys.version, __version__, _signature(os.stat(__file__))]
    except OSError:
        return None


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _valid(entry, st: os.stat_result) -> bool:
    """Whether `entry` describes the file as `st` finds it, hashed more than RACY_NS after its last change."""
    return (
        isinstance(entry, list)
        and len(entry) == 7
        and entry[:5] == _signature(st)
        and isinstance(entry[5], str)
        and len(entry[5]) == 64
        and all(c in "0123456789abcdef" for c in entry[5])
        and isinstance(entry[6], int)
        and max(st.st_mtime_ns, st.st_ctime_ns) < entry[6] - RACY_NS
    )


def versions() -> dict:
    """Versions of the libraries whose numerics determine the embeddings, and of featcache and its cache format."""
    return dict(_versions())


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    return {"featcache": __version__, "cache_format": FORMAT} | installed_versions(
        ("torch", "torchvision", "timm", "numpy", "pillow")
    )


def installed_versions(dists: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of each distribution of `dists`, None for one that is not installed."""
    return {d: _version(d) for d in dists}
