"""Content keys: what determines an embedding, and what determines a client cache, each hashed to one sha256.

A store's key covers the images (dataset identity), the backbone (weights sha256), the preprocessing, the precision,
the views and noise, the library versions and featcache's own embedding code; a cache's key adds the partition and
the partition code. The code is hashed by its syntax tree without docstrings, so editing a comment or a docstring
keeps every key.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import json
from pathlib import Path

from .. import __version__
from .write import FORMAT

_ROOT = Path(__file__).resolve().parents[1] / "extraction"  # the code whose files key the embeddings
# the code whose output is an embedding (which pixels, how they are prepared, how a backbone is built and run) ...
EMBEDDING_CODE = ("pipeline.py", "embed.py", "backbones/*.py", "datasets/*.py")
# ... and the code that decides which images a client holds
PARTITION_CODE = ("partition/*.py",)


def content_key(manifest: dict) -> str:
    """sha256 of the canonical JSON of `manifest`."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


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
    h = hashlib.sha256()
    for rel in files:
        try:
            digest = _syntax_sha256(_read_source(rel) if root == _ROOT else (root / rel).read_bytes())
        except OSError:
            digest = hashlib.sha256(b"").digest()
        h.update(rel.encode() + b"\0" + digest)
    return {"files": files, "sha256": h.hexdigest()}


def versions() -> dict:
    """Versions of the libraries whose numerics determine the embeddings, and of featcache and its cache format."""
    return dict(_versions())


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    out = {"featcache": __version__, "cache_format": FORMAT}
    for dist in ("torch", "torchvision", "timm", "numpy", "pillow"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out
