"""The steps every scheme shares: seeded streams, class pools, the test indices and the validation positions."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import UserError
from ..datasets.base import Dataset

if TYPE_CHECKING:
    from .spec import PartitionSpec  # type only: spec imports this module

_ORDERS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "shuffled": lambda idx, rng: rng.permutation(idx),
    "first": lambda idx, rng: idx,
}

Pools = dict[str, list[np.ndarray]]  # domain -> one index array per class, in the order images are handed out


def _stream(seed: int, step: str) -> np.random.Generator:
    """The random stream of one step, named as in the package docstring: seeded by `seed` and the name alone."""
    name = np.frombuffer(hashlib.sha256(step.encode()).digest(), np.uint32)  # [8] words of the step's name
    return np.random.default_rng(np.random.SeedSequence([seed, *name.tolist()]))


def _class_pools(labels: np.ndarray, n_classes: int, order: str, rng: np.random.Generator) -> list[np.ndarray]:
    return [_ORDERS[order](np.flatnonzero(labels == k), rng) for k in range(n_classes)]  # K x [n_k] int64


def _members(owners: list[str]) -> dict[str, list[int]]:
    """Domain -> the clients that own it, in client order."""
    out: dict[str, list[int]] = {}
    for i, d in enumerate(owners):
        out.setdefault(d, []).append(i)
    return out


def _chunks(pool: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Consecutive, disjoint pieces of `pool` with the given sizes (sum <= len(pool))."""
    return np.split(pool[: counts.sum()], np.cumsum(counts)[:-1])


def _gather(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [np.concatenate(p).astype(np.int64) for p in parts]


def _kept_train(dataset: Dataset, domain: str, percent: float | None) -> int:
    """How many of a domain's train images (a prefix, in the dataset's order) clients draw from: all, or FedBN's
    `--percent`. A reader that records FedBN's train part files (`extra["train_parts"]`: domain -> their sizes) gets
    FedBN's DigitsDataset rule: int(percent * 10) whole parts, or below 0.1 that share of the first part."""
    n = len(dataset.domains[domain]["train"])
    if percent is None:
        return n
    sizes = (dataset.extra.get("train_parts") or {}).get(domain)
    if sizes:
        kept = sum(sizes[: int(percent * 10)]) if percent >= 0.1 else int(sizes[0] * percent * 10)
    else:
        kept = int(n * percent)
    if kept < 1:
        raise UserError(f"percent={percent:g} keeps no training image of domain {domain!r} ({n}): use a larger one")
    return min(kept, n)


def _test_indices(
    dataset: Dataset, owners: list[str], train: list[np.ndarray], spec: PartitionSpec
) -> list[np.ndarray]:
    """Each client's test images, by the spec's test protocol (`spec.tests_on`, TEST_SPLITS)."""
    return _TEST_SPLITS[spec.tests_on](dataset, owners, train, spec)


def _whole_test(dataset: Dataset, owners: list[str], train: list[np.ndarray], spec: PartitionSpec) -> list[np.ndarray]:
    """Each domain's whole test split: every class pool split evenly among the domain's clients (one client per
    domain: all of it), capped at `test_per_class` per class."""
    n_classes = len(dataset.classes)
    parts: list[list[np.ndarray]] = [[] for _ in owners]
    for d, who in _members(owners).items():
        labels = dataset.domains[d]["test"].labels
        for pool in _class_pools(labels, n_classes, spec.order, _stream(spec.seed, f"pools/test/{d}")):
            for i, chunk in zip(who, np.array_split(pool, len(who))):
                parts[i].append(chunk[: spec.test_per_class])
    return [np.sort(t) for t in _gather(parts)]


def _mix_test(dataset: Dataset, owners: list[str], train: list[np.ndarray], spec: PartitionSpec) -> list[np.ndarray]:
    """Test images per client with its train label distribution.

    Client i with n_ik training images of class k gets r_i * n_ik test images of class k (rounded down, or up where
    the pool has images left, largest remainders first), disjoint from the other clients of its domain. r_i is the
    largest ratio that the domain's test pools allow for every class (so a domain whose test split mirrors its train
    split hands out nearly all of it), lowered where needed so that no class exceeds `test_per_class`."""
    n_classes = len(dataset.classes)
    parts: list[list[np.ndarray]] = [[] for _ in owners]
    for d, who in _members(owners).items():
        y_train = dataset.domains[d]["train"].labels
        n = np.stack([np.bincount(y_train[train[i]], minlength=n_classes)[:n_classes] for i in who])  # [c, K]
        pools = _class_pools(
            dataset.domains[d]["test"].labels, n_classes, spec.order, _stream(spec.seed, f"pools/test/{d}")
        )
        supply = np.array([len(pool) for pool in pools])  # [K]
        demand = n.sum(0)  # [K]
        ratio = np.full(len(who), np.min(supply[demand > 0] / demand[demand > 0]))  # [c]
        if spec.test_per_class:
            ratio = np.minimum(ratio, spec.test_per_class / np.maximum(n.max(1), 1))
        exact = ratio[:, None] * n  # [c, K]
        counts = np.floor(exact + 1e-9).astype(int)  # [c, K]
        rest = exact - counts  # [c, K] rounded up where the pool has images left, largest remainders first
        counts += (rest > 1e-9) & ((-rest).argsort(0).argsort(0) < supply - counts.sum(0))
        for k, pool in enumerate(pools):
            for i, chunk in zip(who, _chunks(pool, counts[:, k])):
                parts[i].append(chunk)
    return [np.sort(t) for t in _gather(parts)]


def _val_positions(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Stratified positions held out for validation: round(fraction * n_k) per class, keeping one in train."""
    picks = [np.zeros(0, np.int64)]
    for c in np.unique(labels):
        pos = np.flatnonzero(labels == c)  # [n_k]
        take = min(int(np.floor(fraction * len(pos) + 0.5)), len(pos) - 1)
        picks.append(rng.choice(pos, take, replace=False))
    return np.sort(np.concatenate(picks)).astype(np.int64)


_TEST_SPLITS: dict[str, Callable[[Dataset, list[str], list[np.ndarray], PartitionSpec], list[np.ndarray]]] = {
    "whole": _whole_test,
    "train-mix": _mix_test,
}
