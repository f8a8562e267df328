"""Synthetic caches for the trainer tests: `write_cache` (format 3, through featcache's own writer) and
`write_format2` (the old layout, for the migration tests); the feature set is `featcache.testing.synthetic_clients`."""

from __future__ import annotations

from featcache.extraction.identity import content_key, versions
from featcache.testing import synthetic_clients  # noqa: F401  (re-exported: the tests import it from here)


def write_cache(path, C: int = 4, D: int = 16, K: int = 5, views: int = 0, val_fraction: float = 0.25,
                n: tuple[int, int] = (30, 60)) -> str:
    """A cache file holding synthetic features (one backbone, 'synth'), written by featcache's own cache writer as
    extract writes its caches (for trainer and grid tests); clients hold n[0]..n[1] rows per split."""
    import numpy as np

    from featcache import cache as fc

    train = synthetic_clients(C=C, n=n, D=D, K=K, seed=0, views=views)
    test = synthetic_clients(C=C, n=n, D=D, K=K, seed=1)
    manifest = {"dataset": {"name": "synthetic"}, "views": views, "versions": versions()}
    rows, clients = [], []
    for c in range(C):
        n, m = int(train.counts[c]), int(test.counts[c])
        val = np.sort(np.random.default_rng(c).choice(n, int(val_fraction * n), replace=False))
        clients.append(fc.Client(
            "synth",
            fc.Split(train.labels[c, :n].numpy(), np.arange(n), [train.features[c, :n].numpy()],
                     [train.views[c, :n].numpy()] if views else None),
            fc.Split(test.labels[c, :m].numpy(), np.arange(m), [test.features[c, :m].numpy()]),
            val))
        rows.append({"client": c, "domain": "synth", "train": n, "val": len(val), "test": m})
    header = {"key": content_key(manifest), "manifest": manifest, "dataset": "synthetic",
              "classes": [str(k) for k in range(K)], "domains": ["synth"], "partition": {},
              "counts": {"clients": rows}, "views": views, "versions": manifest["versions"]}
    backbone = {"key": "synth", "name": "synthetic", "weights": "synthetic", "weights_sha256": "", "dim": D,
                "preprocessing": {}}
    fc.write(path, header, [backbone], clients)
    return str(path)


def write_format2(path, header: dict, backbones: list[dict], clients) -> str:
    """A cache in the format-2 layout (featcache 0.1 before the format-3 writer: each backbone's features as a dataset
    of its own and again inside `concat`, checksums computed by re-reading the file), from the arguments
    `featcache.cache.write` takes; for the migration tests and bench/extract.py's before/after figures."""
    import numpy as np

    from featcache.cache import h5

    images = 0
    with h5.create_h5(path) as f:  # the file extract created, concat assembled in slices of 4096 rows as it did
        h5.write_attrs(f, header | {"featcache_format": 2, "featcache_version": "0.1.0",
                                    "backbones": [b["key"] for b in backbones]})
        for b in backbones:
            h5.write_attrs(f.create_group(f"backbones/{b['key']}"), {k: v for k, v in b.items() if k != "key"})
        for c, client in enumerate(clients):
            g = f.create_group(f"clients/{c:03d}")
            g.attrs["domain"] = client.domain
            for split in ("train", "test"):
                s = getattr(client, split)
                g[f"{split}/labels"] = np.asarray(s.labels, np.int64)
                g[f"{split}/source_index"] = np.asarray(s.source_index, np.int64)
                g[f"{split}/domain"] = np.full(len(s.labels), header["domains"].index(client.domain), np.int16)
                for group, blocks in (("features", s.features), ("views", s.views)):
                    if blocks is None:
                        continue
                    for b, block in zip(backbones, blocks):
                        g.create_dataset(f"{split}/{group}/{b['key']}", data=np.asarray(block, np.float32),
                                         track_times=False)
                    shape = (*blocks[0].shape[:-1], sum(x.shape[-1] for x in blocks))
                    cat = g.create_dataset(f"{split}/{group}/concat", shape, "f4", track_times=False)
                    for r in range(0, shape[0], 4096):
                        rows = [np.asarray(x[r : r + 4096], np.float32) for x in blocks]  # each [k, ..., D_b]
                        cat[r : r + 4096] = np.concatenate(rows, -1)
                images += len(s.labels)
            g["train/val_index"] = np.asarray(client.val_index, np.int64)
        f.attrs["images"] = images
        h5.seal(f)
        f.attrs["meta_sha256"] = h5.meta_sha256(f, bind_data=False)  # format 2's metadata checksum
    return str(path)
