"""`PartitionSpec`: how to split a dataset among clients, as plain data, and its validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...errors import UserError, suggest
from .schemes import _SCHEMES
from .steps import _ORDERS

MAX_SEED = 2**32 - 1  # numpy's SeedSequence takes more, but the seed also seeds torch and the noise generators


@dataclass(frozen=True)
class PartitionSpec:
    """How to split a dataset among clients. Plain data: `to_dict` / `from_dict` round-trip through JSON/TOML."""

    scheme: str = "feature"  # feature | label | feature-label | pathological | iid
    clients: int | None = None  # default: one per domain (feature, feature-label), 5 otherwise
    alpha: float = 0.5  # Dirichlet concentration (label, feature-label)
    per_class: int | None = None  # train images per class per client (exact cap, or the mean for Dirichlet schemes)
    test_per_class: int | None = None  # cap of test images per class per client (FedPCL: 200)
    classes_per_client: int = 2  # pathological
    domains: tuple[str, ...] | None = None  # default: all (feature, feature-label), the first one otherwise
    val_fraction: float = 0.2  # share of each client's train held out for validation (0 disables)
    order: str = "shuffled"  # shuffled | first: which images of a class pool a client takes
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.domains, list):
            object.__setattr__(self, "domains", tuple(self.domains))
        _check_types(self)
        for name in ("alpha", "val_fraction"):  # 1 and 1.0 must give the same to_dict (it feeds cache keys)
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("clients", "per_class", "test_per_class", "classes_per_client", "seed"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        _check_values(self)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["domains"] = list(self.domains) if self.domains is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PartitionSpec:
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                raise UserError(f"unknown partition option {key!r}{suggest(key, names)}; known: {', '.join(names)}")
        return cls(**data)


_INT = (int, np.integer)
_NONE = type(None)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "scheme": (str,),
    "clients": (*_INT, _NONE),
    "alpha": (*_INT, float, np.floating),
    "per_class": (*_INT, _NONE),
    "test_per_class": (*_INT, _NONE),
    "classes_per_client": _INT,
    "domains": (tuple, _NONE),
    "val_fraction": (*_INT, float, np.floating),
    "order": (str,),
    "seed": _INT,
}


def _check_types(spec: PartitionSpec) -> None:
    for name, types in _FIELD_TYPES.items():
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise UserError(f"partition option {name} has the wrong type ({type(value).__name__}: {value!r})")
    if spec.domains is not None and not all(isinstance(d, str) for d in spec.domains):
        raise UserError(f"partition option domains must be a list of domain names (got {list(spec.domains)!r})")


def _check_values(spec: PartitionSpec) -> None:
    if spec.scheme not in _SCHEMES:
        raise UserError(
            f"unknown partition scheme {spec.scheme!r}{suggest(spec.scheme, _SCHEMES)}; known: {', '.join(_SCHEMES)}"
        )
    if spec.order not in _ORDERS:
        raise UserError(
            f"unknown partition order {spec.order!r}{suggest(spec.order, _ORDERS)}; known: {', '.join(_ORDERS)}"
        )
    if not 0 < spec.alpha < float("inf"):  # NaN fails too
        raise UserError(f"alpha must be a finite number > 0 (got {spec.alpha:g})")
    if not 0 <= spec.seed <= MAX_SEED:
        raise UserError(f"seed must be in 0..{MAX_SEED} (got {spec.seed})")
    if spec.clients is not None and spec.clients < 1:
        raise UserError(f"clients must be >= 1 (got {spec.clients})")
    if not 0 <= spec.val_fraction < 1:
        raise UserError(f"val_fraction must be in [0, 1) (got {spec.val_fraction:g}); 0 disables validation")
    for name in ("per_class", "test_per_class", "classes_per_client"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise UserError(f"{name} must be >= 1 (got {value})")
    if spec.domains is not None and (not spec.domains or len(set(spec.domains)) != len(spec.domains)):
        raise UserError(f"domains must name each domain once (got {list(spec.domains)!r}); omit it for the default")
