"""The partition schemes, each (owners, train pools, spec, rng) -> every client's train indices, and their registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import UserError
from .steps import Pools, _chunks, _gather, _members

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
    parts: list[list[np.ndarray]] = [[] for _ in owners]
    for d, who in _members(owners).items():
        for pool in pools[d]:
            for i, chunk in zip(who, np.array_split(pool, len(who))):
                parts[i].append(chunk[: spec.per_class])
    return _gather(parts)


def _iid(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    dealt = np.concatenate([_cut(pool, spec.per_class, m) for pool in pools[owners[0]]])  # [N] grouped by class
    return [dealt[i::m].astype(np.int64) for i in range(m)]  # round-robin: equal sizes and classes, +-1


def _label(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    cut = [_cut(pool, spec.per_class, m) for pool in pools[owners[0]]]
    total = sum(len(pool) for pool in cut)

    def draw() -> list[np.ndarray]:
        parts: list[list[np.ndarray]] = [[] for _ in owners]
        sizes = np.zeros(m)  # [m]
        for pool in cut:
            open_ = (sizes < total / m).astype(float)  # [m] clients still below an even share
            p = rng.dirichlet(np.full(m, spec.alpha)) * open_  # [m]
            p = p / p.sum() if p.sum() > 0 else open_ / open_.sum()
            for i, chunk in enumerate(np.split(pool, (np.cumsum(p) * len(pool)).astype(int)[:-1])):
                parts[i].append(chunk)
                sizes[i] += len(chunk)
        return _gather(parts)

    return _until_every_client_has_data(draw, spec)


def _feature_label(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m = len(owners)
    n_classes = len(pools[owners[0]])

    def draw() -> list[np.ndarray]:
        p = rng.dirichlet(np.full(m, spec.alpha), size=n_classes)  # [K, m] class -> client proportions
        parts: list[list[np.ndarray]] = [[] for _ in owners]
        for d, who in _members(owners).items():
            for k, pool in enumerate(pools[d]):
                per_client = spec.per_class or len(pool) / len(who)
                want = np.floor(p[k, who] * m * per_client).astype(int)  # [c]
                if want.sum() > len(pool):
                    want = np.floor(want * len(pool) / want.sum()).astype(int)
                for i, chunk in zip(who, _chunks(pool, want)):
                    parts[i].append(chunk)
        return _gather(parts)

    return _until_every_client_has_data(draw, spec)


def _pathological(owners: list[str], pools: Pools, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    m, k = len(owners), spec.classes_per_client
    class_pools = pools[owners[0]]
    n_classes = len(class_pools)
    if k > n_classes:
        raise UserError(f"classes_per_client={k} but the dataset has only {n_classes} classes")
    deck = rng.permutation(n_classes)  # [K]
    held = [deck[(i * k + np.arange(k)) % n_classes] for i in range(m)]  # k consecutive cards: distinct classes
    parts: list[list[np.ndarray]] = [[] for _ in owners]
    for c, pool in enumerate(class_pools):
        who = [i for i in range(m) if c in held[i]]
        if len(pool) < len(who):
            raise UserError(
                f"class {c} has {len(pool)} training images in domain {owners[0]!r} but {len(who)} clients need it: "
                "use fewer clients or fewer classes_per_client"
            )
        for i, chunk in zip(who, np.array_split(pool, max(len(who), 1))):
            parts[i].append(chunk[: spec.per_class])
    return _gather(parts)


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
