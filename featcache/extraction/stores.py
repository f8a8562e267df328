"""Store management: what a folder of embedding stores holds (`info`), and checking and pruning it (`gc`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py

from ..errors import UserError
from .files import unlocked
from .identity import EMBEDDING_CODE, code_identity, versions
from .store import DamagedStore, checked, groups, kind, open_store


def is_store(path: Path) -> bool:
    """Whether `path` is a store file or a folder of them (what `featcache info` shows as a store)."""
    path = Path(path)
    if path.is_dir():
        return True
    try:
        with h5py.File(path, "r") as f:
            return "featcache_store" in f.attrs
    except OSError:
        return False


def _files(path: Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist: pass a store file or the folder of the stores (default CACHE/store)")
    return sorted(p for p in path.glob("*.h5") if not p.name.startswith(".")) if path.is_dir() else [path]


def info(path: str | Path) -> dict:
    """{path, stores: [{file, backbone, dim, views, held: {"domain/split/kind": images}, images, bytes}], bytes}."""
    stores = []
    for file in _files(Path(path)):
        with open_store(file) as f:
            backbone = json.loads(f.attrs["backbone"])
            held = {f"{d}/{s}/{kind(v)}": int(g["index"].shape[0]) for (d, s, v), g in groups(f)}
            stores.append({"file": str(file), "backbone": backbone["key"], "weights": backbone["weights"],
                           "dim": int(backbone["dim"]), "views": int(f.attrs["views"]),
                           "images": int(f.attrs["images"]), "held": held, "bytes": os.path.getsize(file)})
    return {"path": str(path), "stores": stores, "bytes": sum(s["bytes"] for s in stores)}


def gc(path: str | Path, dry_run: bool = False) -> dict:
    """Check every store in a folder (checksums of every array) and remove those no command can use: damaged
    stores, and stores made by other embedding code or library versions (their keys are never asked for again),
    with the parts folders of killed fills that nobody holds. Returns what was kept and removed, with the reason."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: pass the folder of the stores (default CACHE/store)")
    now = {"code": code_identity(EMBEDDING_CODE)["sha256"], "versions": versions()}
    kept, removed = [], []
    for file in _files(folder):
        reason = _unusable(file, now)
        (removed if reason else kept).append({"file": str(file), **({"reason": reason} if reason else {})})
    for entry in removed:
        file = Path(entry["file"])
        work = file.with_name(f".{file.name}.parts")
        if not dry_run:
            file.unlink(missing_ok=True)
            if work.is_dir() and unlocked(work):
                shutil.rmtree(work)
    for work in sorted(folder.glob(".*.h5.parts")):  # a killed fill of a store that was never written
        store = work.with_name(work.name[1 : -len(".parts")])
        if not store.exists() and not (work / "plan.json").is_file() and unlocked(work):
            removed.append({"file": str(work), "reason": "an empty parts folder"})
            if not dry_run:
                shutil.rmtree(work)
    return {"path": str(folder), "kept": kept, "removed": removed, "dry_run": dry_run}


def _unusable(file: Path, now: dict) -> str | None:
    try:
        with open_store(file) as f:
            identity = json.loads(f.attrs["identity"])
            for _, g in groups(f):
                checked(file, g["index"])
                checked(file, g["rows"])
    except DamagedStore as e:
        return e.problem
    if identity.get("code") != now["code"]:
        return "made by other embedding code"
    if identity.get("versions") != now["versions"]:
        return "made with other library versions"
    return None
