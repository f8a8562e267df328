"""Algorithm registry, like timm's model registry: `@register` on a class, `create(name)`, `list_algorithms()`.

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
    _ALGOS[cls.name] = cls
    return cls


def _import_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def list_algorithms() -> dict[str, type]:
    _import_all()
    return dict(sorted(_ALGOS.items()))


def create(name: str):
    _import_all()
    if name in UNAVAILABLE:
        raise UserError(f"{name} cannot run on cached features: {UNAVAILABLE[name]}")
    if name not in _ALGOS:
        raise UserError(f"unknown algorithm {name!r}{suggest(name, _ALGOS)}: see `featcache algos`")
    return _ALGOS[name]()
