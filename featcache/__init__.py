"""featcache: run frozen backbones once, train federated heads on the cached features.

The Python API, timm style (imported lazily: `import featcache` loads neither torch nor h5py):

    featcache.extract(dataset=..., backbone=[...], ...)   -> dict (the cache path under "cache")
    featcache.train(cache, algo, rounds=..., seeds=...)   -> dict (the result, its file under "result_file")
    featcache.grid(cache, algo, grid=[...], ...)           -> dict
    featcache.report([result files or folders], out=...)  -> dict (the table, the figures written)
    featcache.plot(state, cache, method="pca" | "tsne")    -> dict (the figure of the learned features)
    featcache.load_cache(path, split="train")             -> ClientData (padded client tensors)
    featcache.load_state(path)                            -> (tensors, metadata) of `train(..., save_state=True)`
    featcache.list_algorithms(), featcache.create(name), @featcache.register

`train` and `grid` are also the submodules that hold those functions: the package makes each of them
callable (calling it calls the function of the same name), so `from featcache import train; train(...)`,
`featcache.train(...)`, `import featcache.train` and `from featcache.train import load_split` all work, whichever is
imported first.

Importing featcache changes nothing in the process; the `featcache` command (featcache/cli.py) also keeps freed
memory in its process for reuse (featcache/memory.py; see the README, "Training").
"""

import sys as _sys
import types as _types

__version__ = "0.1.0"

# name -> (submodule, attribute) for the lazily imported API; the callable submodules are listed in _CALLABLE.
_LAZY = {
    "extract": ("extraction.plan", "extract"),
    "report": ("results", "report"),
    "plot": ("results", "plot"),
    "load_cache": ("cache", "load_clients"),
    "load_state": ("states", "load_state"),
    "list_algorithms": ("algorithms", "list_algorithms"),
    "register": ("algorithms", "register"),
    "create": ("algorithms", "create"),
}
_CALLABLE = ("train", "grid")

__all__ = ["__version__", *_CALLABLE, *_LAZY]


class _CallableModule(_types.ModuleType):
    """A submodule that, called, calls its function of the same name (`featcache.train(...)` is
    `featcache.train.train(...)`)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(getattr(self, self.__name__.rpartition(".")[2]))


class _Package(_types.ModuleType):
    """featcache itself: when the import system binds one of the API submodules onto the package (on any import of
    it, direct or not), that submodule is made callable first."""

    def __setattr__(self, name, value):
        if name in _CALLABLE and isinstance(value, _types.ModuleType) and type(value) is _types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


def __getattr__(name):
    if name in _CALLABLE:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")  # binding it on the package makes it callable
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


_sys.modules[__name__].__class__ = _Package
