"""One file per client (`featcache split`): a federation's node then reads only its own rows, from a file of its own.

Client c's file is a cache of one client, written by `write` and checked by `verify`: the same key and manifest as
the whole cache (the same content), its counts that client's row, and the root attribute `split` = {"client": c,
"clients": C}: which client of how many it holds. `node_rows` reads a node's rows from such a file, or from a whole
cache and a client index.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..atomic import check_folder, make_folder, missing_folders, remove_empty
from ..errors import UserError, as_path
from .check import verify
from .load import ClientData, client_rows, load_clients
from .open import open_cache, read_meta
from .write import BACKBONE_ATTRS, HEADER, SPLITS, Client, Split, write

SPLIT_ATTR = "split"


def split_path(out: Path, meta: dict, c: int) -> Path:
    """Client c's file in `out`: named from the cache's dataset and key, each reduced to file-name characters, so a
    name read from a file never leaves `out`."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{meta['dataset']}-{str(meta['key'])[:16]}").lstrip(".")[:100]
    return Path(out) / f"{stem or 'cache'}.client{c:03d}.h5"


def _ours(path: Path, key: str, c: int, C: int) -> bool:
    """Whether `path` is client c's verified file of the cache `key` (an earlier split's, stopped after writing
    it): kept as it is."""
    if not path.is_file():
        return False
    try:
        with open_cache(path) as f:
            meta = read_meta(f)
    except UserError:  # not a cache: someone else's file, which `write` refuses to replace
        return False
    own = meta.get(SPLIT_ATTR)
    own = json.loads(own) if isinstance(own, str) else own
    return meta.get("key") == key and own == {"client": c, "clients": C} and verify(path)["ok"]


def split(cache: str | Path, out: str | Path) -> dict:
    """Write one verified file per client of a verified `cache` into `out`; returns {cache, key, files}. A file an
    earlier split of the same cache left (stopped part-way) is kept; any other file of the same name is refused
    (`write`); a refusal removes the files this call wrote."""
    cache, out = as_path(cache, "cache"), as_path(out, "out")
    check_folder(out)  # a file, a path below one, a broken link, a folder without write permission: one line
    report = verify(cache)
    if not report["ok"]:
        raise UserError(f"{cache} failed verification, nothing split: {report['problems'][0]}")
    made = missing_folders(out)
    make_folder(out)
    written: list[Path] = []
    try:
        return _split(cache, out, written)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        remove_empty(made)
        raise


def _split(cache: Path, out: Path, written: list[Path]) -> dict:
    with open_cache(cache) as f:
        meta = read_meta(f)
        if SPLIT_ATTR in meta:
            raise UserError(f"{cache} holds one client already: split the whole cache")
        header = {k: meta[k] for k in HEADER}
        backbones = [
            {"key": k} | {a: v for a, v in b.items() if a in BACKBONE_ATTRS and a != "columns"}
            for k, b in meta["backbone_info"].items()
        ]
        backbones.sort(key=lambda b: meta["backbones"].index(b["key"]))
        rows = meta["counts"]["clients"]
        files = []
        for c, row in enumerate(rows):
            path = split_path(out, meta, c)
            if _ours(path, meta["key"], c, len(rows)):
                files.append(str(path))
                continue
            parts = {}
            for s in SPLITS:
                read = lambda name: client_rows(f, s, c, name)
                views = read("views/concat") if s == "train" and int(meta["views"]) else None
                domains = {meta["domains"][int(d)] for d in np.unique(read("domain"))}
                other = next(iter(domains)) if len(domains) == 1 and row["domain"] not in domains else None
                parts[s] = Split(
                    read("labels"),
                    read("source_index"),
                    [read("features/concat")],
                    None if views is None else [views],
                    other,
                )
            client = Client(row["domain"], parts["train"], parts["test"], client_rows(f, "train", c, "val_index"))
            own = header | {"counts": {"clients": [rows[c]]}, SPLIT_ATTR: {"client": c, "clients": len(rows)}}
            write(path, own, backbones, [client])
            written.append(path)
            report = verify(path)
            if not report["ok"]:
                raise UserError(f"the file of client {c} failed verification: {report['problems'][0]}")
            files.append(str(path))
    return {"cache": str(cache), "key": meta["key"], "files": files}


def client_of(data: ClientData, c: int) -> ClientData:
    """Client `c` of `data` alone (C = 1), trimmed to its rows."""
    n = int(data.counts[c])
    views = None if data.views is None else data.views[c : c + 1, :n]
    return ClientData(
        data.features[c : c + 1, :n],
        data.labels[c : c + 1, :n],
        data.counts[c : c + 1],
        data.num_classes,
        views,
        data.meta,
    )


def node_rows(path: str | Path, index: int | None, views: bool = False) -> tuple[int, ClientData, ClientData]:
    """(client index, train, test) of one client: from a file `split` wrote (its own index; `index`, when given,
    must agree), or client `index` of a whole cache (which reads every client's rows: split it to read one)."""
    path = as_path(path, "cache")
    train, test = (load_clients(path, s, views=views and s == "train") for s in SPLITS)
    own = train.meta.get(SPLIT_ATTR)
    if own is not None:
        own = json.loads(own) if isinstance(own, str) else own
        if index is not None and int(index) != own["client"]:
            raise UserError(f"{path} holds client {own['client']}, not client {index}: give its own file or index")
        return own["client"], train, test
    C = int(train.features.shape[0])
    if index is None or not 0 <= int(index) < C:
        raise UserError(f"{path} holds {C} clients: give a client index 0..{C - 1} (node config client=N)")
    return int(index), client_of(train, int(index)), client_of(test, int(index))
