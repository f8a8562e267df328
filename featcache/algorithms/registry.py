"""The algorithm registry, like timm's model registry: `@register` on a class makes it creatable by its `name`.

`register` is the one gate every algorithm passes, built-in or plug-in: a name that can name result files, once; a
subclass of `base.FedAvg`; settings that resolve (`settings_of`); capabilities that agree with its hooks
(`base.contradictions`). The package (`featcache.algorithms`) imports the built-in algorithms, which register
themselves, and creates them by name; plugins.py imports classes from outside featcache and registers them here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import UserError, suggest
from ..training.config import settings_of
from .base import FedAvg, contradictions

_ALGOS: dict[str, type[FedAvg]] = {}
# Suffixes that make an algorithm of another by name, "BASE+SUFFIX" (fedprox+fedadam: FedProx's clients with FedAdam's
# server): suffix -> the function from BASE's class to the new class (serveropt.py adds its server optimizers).
COMPOSERS: dict[str, Callable[[type[FedAvg]], type[FedAvg]]] = {}
_COMPOSED: dict[str, type[FedAvg]] = {}  # the classes COMPOSERS made, by name (not listed by `registered`)

# Methods whose mechanism needs something a feature cache cannot give: listed, never faked.
UNAVAILABLE = {
    "pfedpt": "pFedPT (Li et al., 2023) learns visual prompts added to the input pixels, before the backbone; "
    "cached features come after the frozen backbone, so its prompts have nothing to act on. "
    "FedPFT's feature-space prompts (fedpft) are the cached-feature counterpart.",
}

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,63}")  # names result files and scopes --set ALGO.key


def name_problem(name) -> str | None:
    """Why `name` cannot name an algorithm (None when it can): it is part of every result file's name and the scope
    of `--set ALGO.key`, so 1 to 64 letters, digits, '_', '+' or '-', starting with a letter or digit."""
    if isinstance(name, str) and NAME.fullmatch(name):
        return None
    shown = f"{name[:40]!r}... ({len(name)} characters)" if isinstance(name, str) and len(name) > 40 else repr(name)
    return (
        f"{shown} cannot name an algorithm: use 1 to 64 letters, digits, '_', '+' or '-' (it is part of result "
        "file names and of --set NAME.key)"
    )


def register(cls):
    """Class decorator: make `cls` creatable by its `name`; a name can be registered once. Refuses (UserError) a
    class that is not a FedAvg subclass, a name that cannot name result files or is reserved, settings that do not
    resolve and a declared capability its hooks contradict."""
    where = getattr(cls, "__qualname__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, FedAvg)):
        raise UserError(f"{where} is not an algorithm (a subclass of featcache.algorithms.base.FedAvg)")
    if (problem := name_problem(cls.name)) is not None:
        raise UserError(f"{where}.name {problem}")
    if cls.name in UNAVAILABLE:
        raise UserError(f"{where}.name {cls.name!r} is a reserved algorithm name: pick another")
    old = _ALGOS.get(cls.name)
    if old is not None and old is not cls:
        raise UserError(f"algorithm name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    settings_of(cls)
    if problems := contradictions(cls):
        raise UserError(f"{where}: {problems[0]}")
    _ALGOS[cls.name] = cls
    return cls


def registered() -> dict[str, type[FedAvg]]:
    """The registered algorithms by name, sorted."""
    return dict(sorted(_ALGOS.items()))


def lookup(name: str) -> type[FedAvg]:
    """The class registered as `name` (or composed: "BASE+SUFFIX", `COMPOSERS`); an unavailable method or an unknown
    name is one line."""
    if name in UNAVAILABLE:
        raise UserError(f"{name} cannot run on cached features: {UNAVAILABLE[name]}")
    if name not in _ALGOS and (made := composed(name)) is not None:
        return made
    if name not in _ALGOS:
        raise UserError(f"unknown algorithm {name!r}{suggest(name, _ALGOS)}: see `featcache algos`")
    return _ALGOS[name]


def composed(name: str) -> type[FedAvg] | None:
    """The class a "BASE+SUFFIX" name makes (`COMPOSERS`), made and checked as `register` checks a class on first
    use; None when `name` is not such a name."""
    base, plus, suffix = name.rpartition("+")
    if not (plus and suffix in COMPOSERS and base in _ALGOS):
        return None
    if name not in _COMPOSED:
        cls = COMPOSERS[suffix](_ALGOS[base])
        if (problem := name_problem(name)) is not None:
            raise UserError(problem)
        settings_of(cls)
        if problems := contradictions(cls):
            raise UserError(f"{name}: {problems[0]}")
        _COMPOSED[name] = cls
    return _COMPOSED[name]


register(FedAvg)  # the default algorithm, defined beside the contract it implements (base.py)
