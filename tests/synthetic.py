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
    """A cache file in featcache's HDF5 schema holding synthetic features (for trainer and grid tests)."""
    import json

    import h5py
    import numpy as np

    from featcache import cache as fc

    train = synthetic_clients(C=C, D=D, K=K, seed=0, views=views)
    test = synthetic_clients(C=C, D=D, K=K, seed=1)
    with h5py.File(path, "w") as f:
        fc.write_attrs(f, {"featcache_format": fc.FORMAT, "key": "synthetic", "dataset": "synthetic",
                           "backbones": ["synth"], "classes": [str(k) for k in range(K)], "domains": ["synth"],
                           "views": views, "images": 0, "counts": []})
        for c in range(C):
            for split, data in (("train", train), ("test", test)):
                n = int(data.counts[c])
                g = f.create_group(f"clients/{c:03d}/{split}")
                g["labels"] = data.labels[c, :n].numpy()
                for name in ("synth", "concat"):
                    g[f"features/{name}"] = data.features[c, :n].numpy()
                    if views and split == "train":
                        g[f"views/{name}"] = data.views[c, :n].numpy()
            rng = np.random.default_rng(c)
            n = int(train.counts[c])
            f[f"clients/{c:03d}/train/val_index"] = np.sort(rng.choice(n, int(val_fraction * n), replace=False))
        f.attrs["counts"] = json.dumps([])
    return str(path)
