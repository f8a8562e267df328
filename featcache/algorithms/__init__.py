"""The algorithms, timm style: `create(name, cfg)`, `list_algorithms()`, `@register` on a class.

Every algorithm is a subclass of `base.FedAvg` that overrides only the hooks where it differs and declares its
capabilities (base.py); registry.py holds the registry, plugins.py loads algorithms from outside featcache (a name
may be a plug-in spec, `path/to/my_algo.py:MyAlgo` or `package.module:MyAlgo`, or come from an installed package's
`featcache.algorithms` entry point). Importing this package registers the built-in algorithms below.
"""

from __future__ import annotations

from ..training.config import shared_settings
from . import (  # noqa: F401  (each module registers its algorithms)
    apfl,
    ccvr,
    ditto,
    fedala,
    fedamp,
    fedbabu,
    fedbn,
    fedcac,
    feddbe,
    feddecorr,
    feddyn,
    fedetf,
    fedgh,
    fedlc,
    fednova,
    fedntd,
    fedpcl,
    fedper,
    fedpft,
    fedproc,
    fedproto,
    fedprox,
    fedrep,
    fedrod,
    fedtgp,
    fpl,
    lgfedavg,
    local,
    moon,
    perfedavg,
    pfedgate,
    pfedme,
    pfedsd,
    scaffold,
    serveropt,
)
from .base import FedAvg, objective_note, objective_text
from .plugins import is_plugin, load, load_entry_points, plugin_exit, plugin_exits, plugin_failure
from .registry import UNAVAILABLE, lookup, register, registered

__all__ = [
    "UNAVAILABLE",
    "create",
    "is_plugin",
    "list_algorithms",
    "load",
    "objective_note",
    "objective_text",
    "plugin_exit",
    "plugin_exits",
    "plugin_failure",
    "register",
]


def list_algorithms() -> dict[str, type[FedAvg]]:
    """Every registered algorithm by name, sorted: the built-in ones, installed packages' and plug-ins loaded in
    this process."""
    load_entry_points()
    return registered()


def create(name: str, cfg: dict | None = None) -> FedAvg:
    """A new instance of algorithm `name` (a registered name or a plug-in spec, see `plugins.load`), bound to the
    shared (structural) settings of `cfg` when given (the engine binds its own copy to the run's settings)."""
    load_entry_points()
    algo = lookup(load(name))()
    return algo if cfg is None else algo.bind(shared_settings(cfg, algo))
