"""Opening a client cache read-only: `open_cache` refuses what is not a featcache cache of this format in one line
(naming `featcache migrate` where it converts the file), `read_meta` reads its metadata."""

from __future__ import annotations

from pathlib import Path

import h5py

from .. import __version__
from ..errors import UserError, not_a_file
from .h5 import plain, read_attrs
from .write import FORMAT

MIGRATES = (2, 3)  # the older formats `featcache migrate` converts (its `_MIGRATIONS`' keys)


def read_meta(f: h5py.File) -> dict:
    """The root attributes, plus `backbone_info`: each backbone's attributes by key."""
    return read_attrs(f) | {"backbone_info": {k: read_attrs(g) for k, g in f["backbones"].items()}}


def _read_only(path: Path, missing_fix: str) -> h5py.File:
    """`path` opened read-only with h5py; a missing file (`missing_fix` says what to do), a folder, a named pipe or a
    device (never opened: a pipe would hang), or a file that is not HDF5 is one UserError line."""
    why = not_a_file(path)
    if why == "does not exist":
        raise UserError(f"cache {path} does not exist: {missing_fix}")
    if why:
        raise UserError(f"cache {path} {why}: pass the path of a cache file (featcache extract prints it)")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise UserError(
            f"cache {path} is not a readable HDF5 file ({e}); delete it and run `featcache extract` again"
        ) from None


def open_cache(path: str | Path) -> h5py.File:
    """Open a finished cache read-only, refusing files that are not featcache caches of this format."""
    path = Path(path)
    f = _read_only(path, "run `featcache extract` first (it prints the cache path)")
    fmt = plain(f.attrs.get("featcache_format"))
    if fmt != FORMAT:
        wrote = plain(f.attrs.get("featcache_version", "an unknown version"))
        f.close()
        how = f"run `featcache migrate {path}` to convert it in place, or " if fmt in MIGRATES else ""
        raise UserError(
            f"{path} has cache format {fmt!r} (written by featcache {wrote}), this featcache {__version__} "
            f"reads format {FORMAT}: {how}re-run `featcache extract` with the same options to rebuild it"
        )
    return f
