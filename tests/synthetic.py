"""A small, separable synthetic federated feature set (Gaussian class centres) shared by the trainer tests."""

from __future__ import annotations

import torch

from featcache.cache import ClientData


def synthetic_clients(C: int = 4, n: tuple[int, int] = (30, 60), D: int = 16, K: int = 5, seed: int = 0,
                      spread: float = 1.0, views: int = 0) -> ClientData:
    centres = torch.randn(K, D, generator=torch.Generator().manual_seed(1234)) * 2  # same classes for every split
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(n[0], n[1] + 1, (C,), generator=g)  # [C] clients of different sizes
    N = int(counts.max())
    x, y = torch.zeros(C, N, D), torch.full((C, N), -1)
    v = torch.zeros(C, N, views, D) if views else None
    shift = torch.randn(C, D, generator=g) * 0.3  # a little feature shift per client
    for c in range(C):
        labels = torch.randint(0, K, (int(counts[c]),), generator=g)
        base = centres[labels] + shift[c]
        x[c, : len(labels)] = base + spread * torch.randn(len(labels), D, generator=g)
        y[c, : len(labels)] = labels
        if views:
            v[c, : len(labels)] = base[:, None] + spread * torch.randn(len(labels), views, D, generator=g)
    return ClientData(x, y, counts, K, v)


def write_cache(path, C: int = 4, D: int = 16, K: int = 5, views: int = 0, val_fraction: float = 0.25) -> str:
    """A cache file in featcache's HDF5 schema holding synthetic features, sealed with checksums as extract seals
    its caches (for trainer and grid tests)."""
    import h5py
    import numpy as np

    from featcache import cache as fc

    train = synthetic_clients(C=C, D=D, K=K, seed=0, views=views)
    test = synthetic_clients(C=C, D=D, K=K, seed=1)
    manifest = {"dataset": {"name": "synthetic"}, "views": views, "versions": fc.versions()}
    rows = []
    with h5py.File(path, "w") as f:
        for c in range(C):
            for split, data in (("train", train), ("test", test)):
                n = int(data.counts[c])
                g = f.create_group(f"clients/{c:03d}/{split}")
                g["labels"] = data.labels[c, :n].numpy()
                g["source_index"] = np.arange(n, dtype=np.int64)
                g["domain"] = np.zeros(n, np.int16)
                for name in ("synth", "concat"):
                    g[f"features/{name}"] = data.features[c, :n].numpy()
                    if views and split == "train":
                        g[f"views/{name}"] = data.views[c, :n].numpy()
            n = int(train.counts[c])
            val = np.sort(np.random.default_rng(c).choice(n, int(val_fraction * n), replace=False))
            f[f"clients/{c:03d}/train/val_index"] = val
            rows.append({"client": c, "domain": "synth", "train": n, "val": len(val), "test": int(test.counts[c])})
        fc.write_attrs(f, {"featcache_format": fc.FORMAT, "featcache_version": fc.versions()["featcache"],
                           "key": fc.cache_key(manifest), "manifest": manifest, "dataset": "synthetic",
                           "backbones": ["synth"], "classes": [str(k) for k in range(K)], "domains": ["synth"],
                           "partition": {}, "counts": {"clients": rows}, "views": views,
                           "versions": manifest["versions"], "images": sum(r["train"] + r["test"] for r in rows)})
        fc.write_attrs(f.create_group("backbones/synth"), {"name": "synthetic", "weights": "synthetic",
                                                           "weights_sha256": "", "dim": D, "preprocessing": {}})
        fc.seal(f)
    return str(path)
