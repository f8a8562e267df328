"""Algorithm registry, like timm's model registry: `@register` on a class, `create(name, cfg)`, `list_algorithms()`.

Every algorithm is a subclass of `base.FedAvg` that overrides only the hooks where it differs.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UserError, suggest

_ALGOS: dict[str, type] = {}

# Methods whose mechanism needs something a feature cache cannot give: listed, never faked.
UNAVAILABLE = {
    "pfedpt": "pFedPT (Li et al., 2023) learns visual prompts added to the input pixels, before the backbone; "
              "cached features come after the frozen backbone, so its prompts have nothing to act on. "
              "FedPFT's feature-space prompts (fedpft) are the cached-feature counterpart.",
}


def register(cls):
    """Class decorator: make `cls` creatable by its `name`; a name can be registered once."""
    old = _ALGOS.get(cls.name)
    if old is not None and old is not cls:
        raise UserError(f"algorithm name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    _ALGOS[cls.name] = cls
    return cls


def _import_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def list_algorithms() -> dict[str, type]:
    _import_all()
    return dict(sorted(_ALGOS.items()))


def create(name: str, cfg: dict | None = None):
    """A new instance of algorithm `name`, bound to the shared (structural) settings of `cfg` when given (the engine
    binds its own copy to the run's settings)."""
    _import_all()
    if name in UNAVAILABLE:
        raise UserError(f"{name} cannot run on cached features: {UNAVAILABLE[name]}")
    if name not in _ALGOS:
        raise UserError(f"unknown algorithm {name!r}{suggest(name, _ALGOS)}: see `featcache algos`")
    algo = _ALGOS[name]()
    if cfg is None:
        return algo
    from ..engine import shared_settings

    return algo.bind(shared_settings(cfg, algo))
