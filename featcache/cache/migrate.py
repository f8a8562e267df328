"""Converting a cache of an older format to this one in place (`featcache migrate`). Formats 2 and 3 held a group
per client with its own datasets (about 14 HDF5 objects per client, whose per-object work was most of what a first
load of many clients cost), format 2 every backbone's features twice (a dataset of its own and inside `concat`);
format 4 holds every client's rows of a split in one dataset of each kind, found by the split's `offsets`."""

from __future__ import annotations

import errno
import hashlib
import os
from contextlib import suppress
from pathlib import Path

import h5py
import numpy as np

from ..atomic import output_errors, sync
from ..errors import UserError, not_a_file
from ..files import locked, remove_own
from .h5 import meta_sha256, plain, read_attrs
from .open import MIGRATES, _read_only
from .write import FEATURE_GROUPS, FORMAT, HEADER, INDEX_DTYPES, SPLITS, Client, Split, write


def migrate(path: str | Path) -> dict:
    """Convert a cache of an older format to this one, in place: the new file is written beside it and renamed over
    it only once complete and every array's checksum equals the stored one (the feature bytes are copied, not
    recomputed). Returns {path, from_format, to_format, bytes_before, bytes}.

    The new file is staged in the folder `.NAME.migrating` beside the cache, made with featcache's marker under that
    folder's exclusive lock (`extraction.files.locked`): a second migrate of the same file waits, then finds it
    converted and says so. The folder is removed whatever happens, so a refusal leaves nothing behind; a user's folder
    of that name (no marker) is refused in one line and left as it is. A symbolic link is followed: the file it
    points to is converted and the link kept."""
    given = Path(path)
    if (why := not_a_file(given)) is not None:  # a folder, a named pipe, a device: said as what it is, never opened
        raise UserError(f"cache {given} {why}: pass the path of a cache file")
    path = Path(os.path.realpath(given)) if given.is_symlink() else given  # convert the real file, keep the link
    if not os.access(path, os.W_OK):
        raise UserError(
            f"cannot migrate {given} in place: it is read-only or immutable; make it writable (chmod u+w, "
            "chattr -i) or migrate a copy"
        )
    work = path.with_name(f".{path.name}.migrating")
    try:
        with locked(work, "migrating"):
            try:
                return _migrate(path, work / path.name) | {"path": str(given)}
            finally:
                with suppress(OSError):
                    remove_own(work)
    except OSError as e:  # the staging folder or the final rename: a folder or file we may not change
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise UserError(
            f"cannot migrate {path} in place: {e.strerror} ({e.filename or path.parent}); make it and its "
            "folder writable, or migrate a copy; nothing was changed"
        ) from None


def _migrate(path: Path, staged: Path) -> dict:
    old = _read_only(path, "pass the path of a cache file")
    with old:
        fmt = plain(old.attrs.get("featcache_format"))
        if fmt is None:
            raise UserError(
                f"{path} is not a featcache client cache (it has no featcache_format attribute): pass "
                "the path of a cache file; nothing was changed"
            )
        if fmt == FORMAT:
            raise UserError(f"{path} is already cache format {FORMAT}: nothing to migrate")
        if fmt not in _MIGRATIONS:
            known = ", ".join(map(str, _MIGRATIONS))
            raise UserError(
                f"{path} has cache format {fmt!r}; `featcache migrate` converts format {known}: re-run "
                "`featcache extract` with the same options to rebuild it"
            )
        if old.attrs.get("meta_sha256") != meta_sha256(old, bind_data=fmt >= 3):  # format 2's left the arrays out
            raise UserError(
                f"cache {path} is damaged (metadata checksum mismatch): delete it and re-run `featcache extract`"
            )
        before = os.path.getsize(path)
        with output_errors(staged):  # a full disk or a size limit: one line, the original untouched
            _MIGRATIONS[fmt](old, staged)
        _same_arrays(path, old, staged)
    os.replace(staged, path)
    sync(path.parent)
    return {
        "path": str(path),
        "from_format": fmt,
        "to_format": FORMAT,
        "bytes_before": before,
        "bytes": os.path.getsize(path),
    }


def _from_clients(old: h5py.File, staged: Path) -> None:
    """Formats 2 and 3: a group per client (`clients/<c:03d>`), its `concat` features (format 2's per-backbone copies
    left behind); written client after client into format 4's split-wide datasets."""
    meta = read_attrs(old)
    fmt = meta["featcache_format"]
    header = {k: meta[k] for k in HEADER} | {"migrated_from": {"format": fmt, "featcache": meta["featcache_version"]}}
    if "migrated_from" in meta:  # the first format it was extracted in
        header["migrated_from"] = meta["migrated_from"]
    backbones = [{"key": b} | read_attrs(old[f"backbones/{b}"]) for b in meta["backbones"]]
    views = int(meta["views"])

    def split(g: h5py.Group, name: str) -> Split:
        s = g[name]
        held = {meta["domains"][int(d)] for d in np.unique(s["domain"][...])}  # the rows' domain (a held-out one)
        return Split(
            s["labels"][...],
            s["source_index"][...],
            [s["features/concat"]],
            [s["views/concat"]] if views and name == "train" else None,
            held.pop() if len(held) == 1 else None,
        )

    clients = (
        Client(plain(g.attrs["domain"]), split(g, "train"), split(g, "test"), g["train/val_index"][...])
        for g in (old["clients"][name] for name in sorted(old["clients"]))
    )
    write(staged, header, backbones, clients, replace=True)


def _same_arrays(path: Path, old: h5py.File, staged: Path) -> None:
    """Refuse the migration when a client's rows copied into `staged` differ from the bytes `old` says it holds:
    each client's segment of every dataset hashed against the sha256 of the client's own dataset in `old`."""
    with h5py.File(staged, "r") as new:
        clients = sorted(old["clients"])
        for split in SPLITS:
            kinds = [(k, "offsets") for k in INDEX_DTYPES] + [(f"{g}/concat", "offsets") for g in FEATURE_GROUPS]
            kinds += [("val_index", "val_offsets")] if split == "train" else []
            for kind, by in kinds:
                if f"{split}/{kind}" not in new:
                    continue
                ds, at = new[f"{split}/{kind}"], new[f"{split}/{by}"][...]  # [N, ...], [C + 1]
                for c, name in enumerate(clients):
                    held = f"clients/{name}/{split}/{kind}"
                    rows = np.ascontiguousarray(ds[at[c] : at[c + 1]])
                    if old[held].attrs.get("sha256") != hashlib.sha256(rows).hexdigest():
                        raise UserError(
                            f"cache {path} is damaged ({held}: sha256 mismatch), nothing was changed: delete it "
                            "and re-run `featcache extract`"
                        )


_MIGRATIONS = dict.fromkeys(MIGRATES, _from_clients)  # format -> converter(old file, new path)
