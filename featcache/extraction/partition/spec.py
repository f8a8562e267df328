"""`PartitionSpec`: how to split a dataset among clients, as plain data, and its validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...errors import UserError, suggest
from .schemes import _SCHEMES
from .steps import _ORDERS

DIRICHLET = ("label", "feature-label")  # the schemes whose alpha means something

MAX_SEED = 2**32 - 1  # numpy's SeedSequence takes more, but the seed also seeds torch and the noise generators
PROTOCOL = ("test_split", "percent", "holdout_domain")  # the data sets' own protocols, None unless asked for
# --test-split: how a client's test images are chosen (steps.py)
TEST_SPLITS = {
    "whole": "each domain's whole test split, shared evenly by its clients (FedBN's and FedPCL's protocol)",
    "train-mix": "each client's test images follow its train label mix (as many as the domain's test split allows)",
}


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
    test_split: str | None = None  # whole | train-mix; default: whole for feature, train-mix otherwise (TEST_SPLITS)
    percent: float | None = None  # FedBN's --percent: the share of each domain's train split clients draw from
    holdout_domain: str | None = None  # leave-one-domain-out: clients train on the others, all test on it whole

    def __post_init__(self) -> None:
        if isinstance(self.domains, list):
            object.__setattr__(self, "domains", tuple(self.domains))
        _check_types(self)
        for name in ("alpha", "val_fraction", "percent"):  # 1 and 1.0 must give the same to_dict (it feeds keys)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("clients", "per_class", "test_per_class", "classes_per_client", "seed"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        _check_values(self)

    def to_dict(self) -> dict:
        """Plain data; the protocol options (`PROTOCOL`) only when set, so a partition that uses none of them is
        recorded (in cache keys and result files) by the fields every partition has."""
        out = dataclasses.asdict(self)
        out["domains"] = list(self.domains) if self.domains is not None else None
        return {k: v for k, v in out.items() if k not in PROTOCOL or v is not None}

    @property
    def tests_on(self) -> str:
        """The test protocol in force: 'holdout', or `test_split` (the scheme's own when not given)."""
        if self.holdout_domain is not None:
            return "holdout"
        return self.test_split or ("whole" if self.scheme == "feature" else "train-mix")

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
    "test_split": (str, _NONE),
    "percent": (*_INT, float, np.floating, _NONE),
    "holdout_domain": (str, _NONE),
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
    if spec.test_split is not None and spec.test_split not in TEST_SPLITS:
        raise UserError(
            f"unknown test split {spec.test_split!r}{suggest(spec.test_split, TEST_SPLITS)}; "
            f"known: {', '.join(TEST_SPLITS)}"
        )
    if spec.percent is not None and not 0 < spec.percent <= 1:
        raise UserError(f"percent must be in (0, 1], the share of each domain's train split (got {spec.percent:g})")
    _check_holdout(spec)


def _check_holdout(spec: PartitionSpec) -> None:
    held = spec.holdout_domain
    if held is None:
        return
    if not _SCHEMES[spec.scheme].multi_domain:
        multi = ", ".join(k for k, v in _SCHEMES.items() if v.multi_domain)
        raise UserError(
            f"holdout_domain needs a partition over several domains ({multi}), not {spec.scheme!r}: "
            "its clients train on the other domains"
        )
    if spec.domains is not None and held in spec.domains:
        raise UserError(
            f"{held!r} is held out for testing and listed in domains: leave it out of domains (the training domains)"
        )
    if spec.test_split is not None:
        raise UserError(
            f"test_split {spec.test_split!r} does not apply with holdout_domain: every client tests on all of {held!r}"
        )
    if spec.test_per_class is not None:
        raise UserError(
            f"test_per_class does not apply with holdout_domain: every client tests on all of {held!r}; omit it"
        )
