"""The partition schemes, each (owners, train pools, spec, rng) -> every client's train indices (increasing), and their
registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import UserError
from .steps import Pools, _by_client, _deal, _even, _members

if TYPE_CHECKING:
    from .spec import PartitionSpec  # type only: spec imports this module

_DIRICHLET_TRIES = 100


def _cut(pool: np.ndarray, per_class: int | None, clients: int) -> np.ndarray:
    return pool[: per_class * clients] if per_class else pool


def _until_every_client_has_data(draw: Callable[[], list[np.ndarray]], spec: PartitionSpec) -> list[np.ndarray]:
    for _ in range(_DIRICHLET_TRIES):
        train = draw()
        if min(len(t) for t in train) > 0:
            return train
    raise UserError(
        f"{_DIRICHLET_TRIES} Dirichlet draws (alpha={spec.alpha:g}) each left a client without training images: "
        "use fewer clients, a larger alpha or a larger per_class"
    )


def _feature(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    dealt = [
        _deal(pool, _even(len(pool), len(who)), who, spec.per_class)
        for d, who in _members(owners).items()
        for pool in pools[d]
    ]
    return _by_client(dealt, len(owners))


def _iid(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    dealt = np.concatenate([_cut(pool, spec.per_class, m) for pool in pools[owners[0]]])  # [N] grouped by class
    return _by_client([(np.arange(len(dealt)) % m, dealt)], m)  # round-robin: equal sizes and classes, +-1


def _label(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    cut = [_cut(pool, spec.per_class, m) for pool in pools[owners[0]]]
    total = sum(len(pool) for pool in cut)

    def draw() -> list[np.ndarray]:
        dealt = []
        sizes = np.zeros(m)  # [m]
        for pool in cut:
            open_ = (sizes < total / m).astype(float)  # [m] clients still below an even share
            p = rng.dirichlet(np.full(m, spec.alpha)) * open_  # [m]
            p = p / p.sum() if p.sum() > 0 else open_ / open_.sum()
            at = np.clip((np.cumsum(p) * len(pool)).astype(int)[:-1], 0, len(pool))  # [m - 1] np.split's points
            counts = np.diff(at, prepend=0, append=len(pool))  # [m]
            dealt.append(_deal(pool, counts, np.arange(m)))
            sizes += counts
        return _by_client(dealt, m)

    return _until_every_client_has_data(draw, spec)


def _feature_label(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    n_classes = len(pools[owners[0]])

    def draw() -> list[np.ndarray]:
        p = rng.dirichlet(np.full(m, spec.alpha), size=n_classes)  # [K, m] class -> client proportions
        dealt = []
        for d, who in _members(owners).items():
            for k, pool in enumerate(pools[d]):
                per_client = spec.per_class or len(pool) / len(who)
                want = np.floor(p[k, who] * m * per_client).astype(int)  # [c]
                if want.sum() > len(pool):
                    want = np.floor(want * len(pool) / want.sum()).astype(int)
                dealt.append(_deal(pool, want, who))
        return _by_client(dealt, m)

    return _until_every_client_has_data(draw, spec)


def _pathological(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m, k = len(owners), spec.classes_per_client
    class_pools = pools[owners[0]]
    n_classes = len(class_pools)
    if k > n_classes:
        raise UserError(f"classes_per_client={k} but the dataset has only {n_classes} classes")
    deck = rng.permutation(n_classes)  # [K]
    held = deck[(np.arange(m)[:, None] * k + np.arange(k)) % n_classes]  # [m, k] k consecutive cards: distinct
    dealt = []
    for c, pool in enumerate(class_pools):
        who = np.flatnonzero((held == c).any(1))  # the clients that hold class c
        if len(pool) < len(who):
            raise UserError(
                f"class {c} has {len(pool)} training images in domain {owners[0]!r} but {len(who)} clients need it: "
                "use fewer clients or fewer classes_per_client"
            )
        dealt.append(_deal(pool, _even(len(pool), max(len(who), 1))[: len(who)], who, spec.per_class))
    return _by_client(dealt, m)


@dataclass(frozen=True)
class _Scheme:
    split: Callable[[list[str], Pools, PartitionSpec, np.random.Generator], list[np.ndarray]]
    multi_domain: bool  # clients spread over all chosen domains, else one domain shared by all clients


_SCHEMES: dict[str, _Scheme] = {
    "feature": _Scheme(_feature, multi_domain=True),
    "label": _Scheme(_label, multi_domain=False),
    "feature-label": _Scheme(_feature_label, multi_domain=True),
    "pathological": _Scheme(_pathological, multi_domain=False),
    "iid": _Scheme(_iid, multi_domain=False),
}


def list_schemes() -> list[str]:
    return list(_SCHEMES)
