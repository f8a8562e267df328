"""Store management: what a folder of embedding stores holds (`info`), checking one store (`verify`), and pruning
a folder of them (`gc`).

`gc` changes only what featcache provably made: a file whose root carries the store's marker attribute
(`store.MARKER`), a folder that carries featcache's marker file (`files.MARKER`). Anything else in the folder (a
user's HDF5 or text file named `.h5`, a symbolic link, a client cache, a folder named like a parts folder) is listed
as left alone and never opened for writing, moved or removed.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path


from ..cache import h5
from ..cache.check import report
from ..cache.write import MARKER as CACHE_MARKER
from ..errors import UserError, first_line, not_a_file
from ..files import MARKER as MARKER_FILE
from ..files import claim, own, remove_own, remove_unlocked, write_marker
from ..cache.identity import EMBEDDING_CODE, code_identity, content_key, versions
from .store import FORMAT, MARKER, READS, DamagedStore, Store, need_name, open_store, rows_folder

QUARANTINE = ".quarantine"  # gc moves damaged stores into this folder of the store folder (a marked folder)


def what_is(path: Path, follow: bool = True) -> tuple[str, object] | None:
    """("store", format) or ("cache", format) when `path` is a file featcache made (its root carries the store's or
    the cache's marker attribute); None for anything else: another file, a folder, a FIFO, a file HDF5 cannot open,
    and a symbolic link unless `follow`."""
    attrs = h5.peek_attrs(path, (MARKER, CACHE_MARKER), follow=follow)
    if attrs is None:
        return None
    if MARKER in attrs:
        return "store", attrs[MARKER]
    if CACHE_MARKER in attrs:
        return "cache", attrs[CACHE_MARKER]
    return None


def is_store(path: Path) -> bool:
    """Whether `featcache info` shows `path` as stores: a folder, or a file that carries the store's marker."""
    path = Path(path)
    return path.is_dir() or (what_is(path) or ("",))[0] == "store"


def _candidates(folder: Path) -> list[Path]:
    """The entries of `folder` named like a store (`*.h5`, not hidden), sorted."""
    return sorted(p for p in folder.iterdir() if p.name.endswith(".h5") and not p.name.startswith("."))


def _not_stores(folder: Path, found: list[Path], command: str) -> UserError:
    """The line for a folder that holds `.h5` files but no store (a folder of caches, or of the user's own data),
    for `command` (info or gc)."""
    caches = [p for p in found if (what_is(p) or ("",))[0] == "cache"]
    stores = folder / "store"
    where = (
        f"the folder of the stores ({stores})"
        if stores.is_dir()
        else "the folder of the stores (extract's --store, default OUT/store)"
    )
    broken = sum(map(h5.unopenable, found))
    held = (
        f"client caches ({len(caches)}), not embedding stores"
        if caches
        else f"no featcache embedding store it can read ({len(found)} .h5 file(s) without a readable featcache marker"
        + (f", {broken} of them HDF5 files that HDF5 cannot open: truncated or damaged" if broken else "")
        + ")"
    )
    if command == "gc":
        return UserError(
            f"{folder} holds {held}: gc prunes a folder of stores and never removes anything else; "
            f"nothing was removed; pass {where}"
        )
    return UserError(
        f"{folder} holds {held}: pass " + (f"a cache file (e.g. {caches[0]}) or " if caches else "") + where
    )


def _files(path: Path) -> list[Path]:
    path = Path(path)
    if not path.is_dir() and (why := not_a_file(path)) is not None:  # a named pipe is never opened (it would hang)
        raise UserError(f"{path} {why}: pass a store file or the folder of the stores (default CACHE/store)")
    if not path.is_dir():
        return [path]
    found = _candidates(path)
    stores = [p for p in found if (what_is(p) or ("",))[0] == "store"]
    if found and not stores:
        raise _not_stores(path, found, "info")
    return stores


def info(path: str | Path) -> dict:
    """What a store file or a folder of stores holds: {path, stores, duplicates, bytes}.

    Each store: {file, key, dataset, identity ('content', 'recipe' or 'legacy': identified by an older featcache,
    image files by path and modification time), fingerprint, sources (the folders its images were read from,
    metadata outside the key: [{root, real}], empty when not recorded), image_size (the --image-size it was made
    with, None for each backbone's own), preprocessing (input size, interpolation, mean, std, pipeline version),
    backbone, weights, weights_sha256, dim, views, images, held {"domain/split/kind": images}, bytes, stale (why this
    featcache never asks for its key again: other embedding code or library versions), content (the hash of what
    its embeddings depend on but code and versions: the same images, weights and preprocessing), rows (a digest of
    the rows held: their indices and crc32s), duplicates (the other stores of the same content or the same rows
    under other keys)}. A store that fails its checks is {file, problem, bytes}. `duplicates` lists the groups of
    such files."""
    stores = [_describe(file) for file in _files(Path(path))]
    groups_ = _duplicate_groups(stores)
    for group in groups_:
        for st in group:
            st["duplicates"] = [o["file"] for o in group if o is not st]
    return {
        "path": str(path),
        "stores": stores,
        "duplicates": [[st["file"] for st in g] for g in groups_],
        "bytes": sum(st["bytes"] for st in stores),
    }


def duplicates(path: str | Path) -> list[list[dict]]:
    """Groups of two or more stores in `path` (a store folder or file) that hold the same embeddings under
    different keys: the same images (dataset fingerprint) by the same weights with the same preprocessing, views,
    noise and precision, made by other embedding code or library versions; or byte-identical arrays (the same
    `rows`), which also finds stores made before data was identified by content (one per spelling of its root).
    Each store as `info` describes it; in each group the stores this featcache uses (no `stale` reason) come first,
    then by file name. Damaged stores are in no group."""
    return _duplicate_groups(info(path)["stores"])


def _duplicate_groups(stores: list[dict]) -> list[list[dict]]:
    """The connected groups of stores that share `content` or `rows`, where they hold more than one key."""
    good = [st for st in stores if "problem" not in st]
    group = list(range(len(good)))  # union-find over the stores

    def top(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    first: dict[tuple[str, str], int] = {}
    for i, st in enumerate(good):
        for label in ("content", "rows"):
            if st.get(label):
                j = first.setdefault((label, st[label]), i)
                group[top(i)] = top(j)
    members: dict[int, list[dict]] = {}
    for i, st in enumerate(good):
        members.setdefault(top(i), []).append(st)
    return [
        sorted(g, key=lambda st: (bool(st["stale"]), st["file"]))
        for g in members.values()
        if len({st["key"] for st in g}) > 1
    ]


def _describe(file: Path) -> dict:
    """One store as `info` lists it; a damaged one as {file, problem, bytes}, so one bad file hides no other."""
    size = _size(file)
    try:
        store = Store(file, None)
        attrs = store.meta()
        held = {need_name(need): n for need, n in store.needs().items()}
        digest = store.digest()
    except DamagedStore as e:
        return {"file": str(file), "problem": e.problem, "bytes": size}
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        return {"file": str(file), "problem": f"unreadable ({type(e).__name__})", "bytes": size}
    identity, backbone = attrs.get("identity") or {}, attrs.get("backbone") or {}
    dataset = identity.get("dataset") or {}
    preprocessing = backbone.get("preprocessing") or {}
    same = {
        "dataset": {k: v for k, v in dataset.items() if k != "by"},
        "weights": [backbone.get("name"), backbone.get("weights_sha256")],
        "preprocessing": preprocessing,
        **{k: identity.get(k) for k in ("views", "noise", "seed", "precision", "allow_partial")},
    }
    return {
        "file": str(file),
        "key": str(attrs.get("key")),
        "dataset": dataset.get("name"),
        "identity": "recipe" if "recipe" in dataset else dataset.get("by", "legacy"),
        "fingerprint": dataset.get("fingerprint") or dataset.get("recipe"),
        "sources": attrs.get("sources") or [],
        "image_size": identity.get("image_size"),
        "preprocessing": {k: preprocessing.get(k) for k in ("input_size", "interpolation", "mean", "std")}
        | {"pipeline": (preprocessing.get("pipeline") or {}).get("version")},
        "backbone": backbone.get("key"),
        "weights": backbone.get("weights"),
        "weights_sha256": backbone.get("weights_sha256"),
        "dim": backbone.get("dim"),
        "views": int(attrs.get("views", 0)),
        "images": int(attrs.get("images", 0)),
        "held": held,
        "bytes": size,
        "stale": _stale(identity),
        "content": content_key(same) if dataset else None,
        "rows": digest if held else None,
        "duplicates": [],
    }


def verify(path: str | Path) -> dict:
    """Check a store: its marker and format, metadata checksums, that its key is the hash of the identity it
    records, every row against its crc32 and finite; library versions and embedding code it was made with that differ
    from this environment's are `stale` (warnings: the store still serves the commands that made it, `gc` removes
    it). Nothing in the check depends on where the file lives. Returns {path, ok, problems, stale, arrays, bytes,
    seconds}, as `cache.verify` does."""
    t0 = time.perf_counter()
    problems: list[str] = []
    stale: list[str] = []
    arrays = 0
    try:
        with open_store(Path(path)) as f:
            identity = json.loads(f.attrs["identity"])
            if content_key(identity) != h5.plain(f.attrs["key"]):
                problems.append("the stored key is not the hash of the stored identity")
            named = re.search(r"\.([0-9a-f]{16})\.h5$", Path(path).name)
            if named and named.group(1) != h5.plain(f.attrs["key"])[:16]:
                problems.append(f"its name says key {named.group(1)}, it holds key {h5.plain(f.attrs['key'])[:16]}")
        store = Store(Path(path), None)
        problems += [f"/{name}/rows: NaN or Inf values" for name in store.check()]
        arrays = sum(3 if p.crc_at is not None else 2 for need in store.needs() for p in store.parts(need))
        stale = _stale(identity)
    except DamagedStore as e:
        problems.append(str(e))
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        problems.append(f"store {path} is unreadable ({type(e).__name__}: {first_line(e)})")
    return report(path, problems, stale, arrays, t0)


def _size(file: Path) -> int:
    """Bytes of a store: its file and its segments."""
    rows = rows_folder(file)
    return (os.path.getsize(file) if file.is_file() else 0) + sum(
        p.stat().st_size for p in (rows.iterdir() if own(rows, "rows") is not None else ())
    )


def _stale(identity: dict) -> list[str]:
    now = {"code": code_identity(EMBEDDING_CODE)["sha256"], "versions": versions()}
    made = identity.get("versions") or {}
    lines = [f"{k} {made.get(k)} (now {v})" for k, v in now["versions"].items() if made.get(k) != v]
    if identity.get("code") != now["code"]:
        lines.append(f"featcache embedding code {str(identity.get('code'))[:12]} (now {now['code'][:12]})")
    return lines


def gc(path: str | Path, dry_run: bool = False, remove_damaged: bool = False) -> dict:
    """Prune a folder of stores of what featcache made and no command can use, touching nothing else.

    Every store (a file carrying the store's marker) is checked (every row against its crc32): a damaged one is
    moved into the folder's `.quarantine` with its rows folder (removed instead with `remove_damaged`, which also
    removes the stores earlier runs moved there); one made by other embedding code or library versions is removed
    (its key is never asked for again), with its rows and parts folders. Parts folders (marked) that hold no plan and
    whose store does not exist, rows folders (marked) whose store file is gone, and folders left half removed by a
    killed run, are removed when nobody holds them. Everything else is listed as left
    alone with the reason. A folder that holds `.h5` files but nothing of featcache's (a folder of caches, the user's
    data) is one UserError line, nothing removed.

    Returns {path, dry_run, kept, removed, quarantined, left_alone, duplicates}: lists of {file, reason} ({file}
    for kept, {file, to, reason} for quarantined); duplicates: groups of stores (files) that hold the same embeddings
    under different keys (see `duplicates`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: pass the folder of the stores (default CACHE/store)")
    now = {"code": code_identity(EMBEDDING_CODE)["sha256"], "versions": versions()}
    report: dict = {
        "path": str(folder),
        "dry_run": dry_run,
        "kept": [],
        "removed": [],
        "quarantined": [],
        "left_alone": [],
    }
    leave = lambda p, why: report["left_alone"].append({"file": str(p), "reason": why})  # noqa: E731
    stores, others, damaged, stale = [], [], [], []  # stores of this format, of others; (store, why) damaged, stale
    for file in _candidates(folder):
        made = what_is(file, follow=False)
        if made is None:
            leave(file, _foreign(file))
        elif made[0] == "cache":
            leave(file, "a client cache (gc prunes stores only): left alone")
        elif made[1] not in READS:
            others.append(file)
            leave(
                file, f"a store of format {made[1]}, which this featcache (format {FORMAT}) does not read: left alone"
            )
        else:
            stores.append(file)
            problem, is_damage = _unusable(file, now)
            if problem is None:
                report["kept"].append({"file": str(file)})
            else:
                (damaged if is_damage else stale).append((file, problem))
    works, gone, quarantine = [], [], None
    for entry in sorted(p for p in folder.iterdir() if p.name.startswith(".")):
        if entry.name.endswith(".h5.parts"):
            if own(entry, "parts") is not None:
                works.append(entry)
            else:
                leave(entry, f"named like a parts folder but not featcache's (no {MARKER_FILE} marker): left alone")
        elif entry.name.endswith(".gone") and own(entry) is not None:
            gone.append(entry)
        elif entry.name == QUARANTINE and own(entry, "quarantine") is not None:
            quarantine = entry
    orphans = [  # the rows of a store whose file is gone (removed by hand), no fill of it under way
        rows
        for rows in sorted(folder.glob("*.h5.rows"))
        if own(rows, "rows") is not None
        and not os.path.lexists(rows.with_suffix(""))
        and not os.path.lexists(rows.with_name(f".{rows.name[:-5]}.parts"))
    ]
    if not (stores or others or works or gone or orphans or quarantine) and report["left_alone"]:
        raise _not_stores(folder, _candidates(folder), "gc")

    def remove(file: Path, reason: str) -> None:
        try:
            if not dry_run:
                file.unlink()
                remove_own(rows_folder(file))
            report["removed"].append({"file": str(file), "reason": reason})
        except OSError as e:
            leave(file, f"{reason}; could not remove it ({e.strerror}): left as it is")

    report["duplicates"] = _twins(folder) if stores else []
    twins = {f: [o for o in group if o != f] for group in report["duplicates"] for f in group}
    for file, reason in stale:
        same = ", ".join(Path(o).name for o in twins.get(str(file), []))
        remove(file, reason + (f" (the same embeddings as {same})" if same else ""))
    for file, problem in damaged:
        if remove_damaged:
            remove(file, f"damaged ({problem})")
        else:
            _quarantine(folder, file, problem, dry_run, report)
    if remove_damaged and quarantine is not None:
        listed = own(quarantine).get("files", {})
        for name, problem in sorted(listed.items()):
            if (what_is(quarantine / name, follow=False) or ("",))[0] == "store":
                remove(quarantine / name, f"damaged ({problem}), moved aside by an earlier gc")
        if not dry_run:
            left = {name: problem for name, problem in listed.items() if os.path.lexists(quarantine / name)}
            if any(p.name != MARKER_FILE for p in quarantine.iterdir()):
                write_marker(quarantine, {"kind": "quarantine", "files": left})
            else:
                remove_own(quarantine)
    dropped = {file.name for file, _ in stale}
    for work in works:
        name = work.name[1 : -len(".parts")]
        if name in dropped:
            why = "the parts folder of a store made by other embedding code or library versions"
        elif not (folder / name).exists() and not (work / "plan.json").is_file():
            why = "an empty parts folder (a fill killed before it planned)"
        else:
            continue  # a resume point of its store's next fill
        if dry_run or remove_unlocked(work):
            report["removed"].append({"file": str(work), "reason": why})
    for folder_gone in gone:
        if dry_run or remove_unlocked(folder_gone):
            report["removed"].append(
                {"file": str(folder_gone), "reason": "a folder featcache was removing when it was stopped"}
            )
    for rows in orphans:
        if dry_run or remove_own(rows):
            report["removed"].append({"file": str(rows), "reason": "the rows of a store whose file is gone"})
    return report


def _twins(folder: Path) -> list[list[str]]:
    """The groups of stores in `folder` that hold the same embeddings under different keys (`duplicates`), by file;
    gc names them and removes only those made by other code or versions, as it does any such store."""
    try:
        return [[st["file"] for st in group] for group in duplicates(folder)]
    except UserError:
        return []


def _foreign(path: Path) -> str:
    """Why gc leaves `path` alone: what it is, and that featcache did not make it (or that this cannot be read)."""
    if path.is_symlink():
        return "a symbolic link (gc never follows one): left alone"
    if path.is_dir():
        return "a folder, not featcache's: left alone"
    if not path.is_file():
        return "not a regular file, not featcache's: left alone"
    if h5.unopenable(path):
        return (
            "an HDF5 file that HDF5 cannot open (truncated or damaged): whether featcache made it cannot be read, "
            "so it is yours to remove if it was a store: left alone"
        )
    return "not featcache's (no featcache marker in it, or not an HDF5 file): left alone"


def _quarantine(folder: Path, file: Path, problem: str, dry_run: bool, report: dict) -> None:
    """Move the damaged store `file` into the folder's `.quarantine` (a marked folder whose marker lists each file
    with its problem), or say why it could not."""
    where = folder / QUARANTINE
    target = where / file.name
    n = 1
    while os.path.lexists(target):
        target, n = where / f"{file.name}.{n}", n + 1
    entry = {"file": str(file), "to": str(target), "reason": f"damaged ({problem})"}
    if dry_run:
        report["quarantined"].append(entry)
        return
    try:
        claim(where, "quarantine")
        os.rename(file, target)
        if own(rows_folder(file), "rows") is not None:
            os.rename(rows_folder(file), rows_folder(target))
        write_marker(where, {"kind": "quarantine", "files": own(where).get("files", {}) | {target.name: problem}})
    except (UserError, OSError) as e:
        why = str(e) if isinstance(e, UserError) else e.strerror
        report["left_alone"].append(
            {
                "file": str(file),
                "reason": f"damaged ({problem}); could not move it aside "
                f"({why}): left as it is; `featcache gc --remove-damaged` removes it",
            }
        )
        return
    report["quarantined"].append(entry)


def _unusable(file: Path, now: dict) -> tuple[str | None, bool]:
    """(why no command can use the store `file`, whether because it is damaged); (None, False) for a good store."""
    try:
        with open_store(file) as f:
            identity = json.loads(f.attrs["identity"])
        Store(file, None).check()
    except DamagedStore as e:
        return e.problem, True
    except Exception as e:  # a damaged file fails in many ways inside HDF5 and JSON; each one means "damaged"
        return f"unreadable: {type(e).__name__}", True
    if identity.get("code") != now["code"]:
        return "made by other embedding code", False
    if identity.get("versions") != now["versions"]:
        return "made with other library versions", False
    return None, False
