"""featcache: run frozen backbones once, train federated heads on the cached features.

The Python API, timm style (imported lazily: `import featcache` loads neither torch nor h5py):

    featcache.extract(dataset=..., backbone=[...], ...)   -> dict (the cache path under "cache")
    featcache.train(cache, algo, rounds=..., seeds=...)   -> dict (the result, its file under "result_file";
                                                             a list of algos or caches: {"runs": [each one's]})
    featcache.grid(cache, algo, grid=[...] or {...}, ...) -> dict
    featcache.search(cache, algo, space=[...] or {...}, trials=..., sampler=..., pruner=...) -> dict
    featcache.report([result files or folders], out=..., x=...) -> dict (the table, the figures written)
    featcache.plot(state, cache, method="pca" | "tsne")    -> dict (the figure of the learned features)
    featcache.load_cache(path, split="train")             -> ClientData (padded client tensors)
    featcache.load_state(path)                            -> (tensors, metadata) of `train(..., save_state=True)`
    featcache.list_algorithms(), featcache.create(name), @featcache.register

Each is a plain function of the module named in `_LAZY`, imported on first use.

Importing featcache changes nothing in the process; the `featcache` command also keeps freed memory for reuse
(featcache/memory.py).
"""

import importlib as _importlib

__version__ = "0.1.0"

# name -> (submodule, attribute) of the public API, imported when first asked for.
_LAZY = {
    "extract": ("extraction.plan", "extract"),
    "train": ("runs.train", "train"),
    "grid": ("runs.select", "grid"),
    "search": ("runs.select", "search"),
    "report": ("results", "report"),
    "plot": ("results", "plot"),
    "load_cache": ("cache", "load_clients"),
    "load_state": ("runs.states", "load_state"),
    "list_algorithms": ("algorithms", "list_algorithms"),
    "register": ("algorithms", "register"),
    "create": ("algorithms", "create"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(_importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
