"""One file per client (`featcache split`): a federation's node then reads only its own rows, from a file of its own.

Client c's file is a cache of one client, written by `write` and checked by `verify`: the same key and manifest as
the whole cache (the same content), its counts that client's row, and the root attribute `split` = {"client": c,
"clients": C}: which client of how many it holds. `node_rows` reads a node's rows from such a file, or from a whole
cache and a client index.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError, as_path
from .check import verify
from .load import ClientData, client_rows, load_clients
from .open import open_cache, read_meta
from .write import BACKBONE_ATTRS, HEADER, SPLITS, Client, Split, write

SPLIT_ATTR = "split"


def split_path(out: Path, meta: dict, c: int) -> Path:
    return Path(out) / f"{meta['dataset']}-{meta['key'][:16]}.client{c:03d}.h5"


def split(cache: str | Path, out: str | Path) -> dict:
    """Write one verified file per client of `cache` into `out`; returns {cache, key, files}. An existing file of
    the same name is refused (`write`)."""
    cache, out = as_path(cache, "cache"), as_path(out, "out")
    out.mkdir(parents=True, exist_ok=True)
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
            path = split_path(out, meta, c)
            own = header | {"counts": {"clients": [rows[c]]}, SPLIT_ATTR: {"client": c, "clients": len(rows)}}
            write(path, own, backbones, [client])
            report = verify(path)
            if not report["ok"]:
                path.unlink(missing_ok=True)
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
