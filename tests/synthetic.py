"""Synthetic caches for the trainer tests: `write_cache` (through featcache's own writer); the feature set
`synthetic_clients` is featcache.testing's."""

from __future__ import annotations

from featcache.cache.identity import content_key, versions
from featcache.testing import synthetic_clients  # noqa: F401  (re-exported: the tests import it here)


def write_cache(
    path,
    C: int = 4,
    D: int = 16,
    K: int = 5,
    views: int = 0,
    val_fraction: float = 0.25,
    n: tuple[int, int] = (30, 60),
    spread: float = 1.0,
    partition: dict | None = None,
) -> str:
    """A cache file holding synthetic features (one backbone, 'synth'), written by featcache's own cache writer as
    extract writes its caches (for trainer and grid tests); clients hold n[0]..n[1] rows per split; `spread` the
    classes' noise (4: overlapping classes, whose training is far from converged in a few rounds); `partition` the
    partition the cache records (its content key covers it: caches of a sweep differ in it)."""
    import numpy as np

    from featcache import cache as fc

    train = synthetic_clients(C=C, n=n, D=D, K=K, seed=0, views=views, spread=spread)
    test = synthetic_clients(C=C, n=n, D=D, K=K, seed=1, spread=spread)
    manifest = {"dataset": {"name": "synthetic"}, "views": views, "versions": versions()}
    manifest |= {"partition": partition} if partition else {}
    rows, clients = [], []
    for c in range(C):
        n, m = int(train.counts[c]), int(test.counts[c])
        val = np.sort(np.random.default_rng(c).choice(n, int(val_fraction * n), replace=False))
        clients.append(
            fc.Client(
                "synth",
                fc.Split(
                    train.labels[c, :n].numpy(),
                    np.arange(n),
                    [train.features[c, :n].numpy()],
                    [train.views[c, :n].numpy()] if views else None,
                ),
                fc.Split(test.labels[c, :m].numpy(), np.arange(m), [test.features[c, :m].numpy()]),
                val,
            )
        )
        rows.append({"client": c, "domain": "synth", "train": n, "val": len(val), "test": m})
    header = {
        "key": content_key(manifest),
        "manifest": manifest,
        "dataset": "synthetic",
        "classes": [str(k) for k in range(K)],
        "domains": ["synth"],
        "partition": partition or {},
        "counts": {"clients": rows},
        "views": views,
        "versions": manifest["versions"],
    }
    backbone = {
        "key": "synth",
        "name": "synthetic",
        "weights": "synthetic",
        "weights_sha256": "",
        "dim": D,
        "preprocessing": {},
    }
    fc.write(path, header, [backbone], clients)
    return str(path)
