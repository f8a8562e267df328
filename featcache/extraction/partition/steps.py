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
    words = np.concatenate([np.array([seed], np.uint32), name])  # [9] [seed, *name]: seeded 4x faster than a list
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def _class_pools(labels: np.ndarray, n_classes: int, order: str, rng: np.random.Generator) -> list[np.ndarray]:
    return [_ORDERS[order](np.flatnonzero(labels == k), rng) for k in range(n_classes)]  # K x [n_k] int64


def _members(owners: list[str]) -> dict[str, list[int]]:
    """Domain -> the clients that own it, in client order."""
    out: dict[str, list[int]] = {}
    for i, d in enumerate(owners):
        out.setdefault(d, []).append(i)
    return out


Dealt = tuple[np.ndarray, np.ndarray]  # (owners [n], indices [n]): index r goes to client owners[r]


def _deal(pool: np.ndarray, sizes: np.ndarray, who, cap: int | None = None) -> Dealt:
    """Consecutive, disjoint pieces of `pool` of `sizes` for the clients `who` (pieces past the pool's end cut short,
    as `np.split` cuts them), each cut to its first `cap` images."""
    sizes = np.asarray(sizes, np.int64)  # [c]
    owners = np.repeat(np.asarray(who, np.int64), sizes)[: len(pool)]  # [n]
    taken = pool[: len(owners)]  # [n]
    if cap is not None:
        keep = np.arange(len(owners)) - np.repeat(np.cumsum(sizes) - sizes, sizes)[: len(owners)] < cap  # [n]
        owners, taken = owners[keep], taken[keep]
    return owners, taken


def _even(n: int, clients: int) -> np.ndarray:
    """[clients] the sizes `np.array_split` gives n images among `clients`: the first n % clients one more."""
    return n // clients + (np.arange(clients) < n % clients)


def _by_client(dealt: list[Dealt], clients: int) -> list[np.ndarray]:
    """Each client's dealt indices, increasing: one sort for all clients."""
    owners = np.concatenate([np.zeros(0, np.int64), *(o for o, _ in dealt)])  # [N]
    index = np.concatenate([np.zeros(0, np.int64), *(i for _, i in dealt)]).astype(np.int64)  # [N]
    index = index[np.lexsort((index, owners))]  # [N] by client, then increasing
    ends = np.cumsum(np.bincount(owners, minlength=clients))  # [clients]
    return [index[e - n : e] for n, e in zip(np.diff(ends, prepend=0), ends)]


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
    dealt = []
    for d, who in _members(owners).items():
        labels = dataset.domains[d]["test"].labels
        for pool in _class_pools(labels, n_classes, spec.order, _stream(spec.seed, f"pools/test/{d}")):
            dealt.append(_deal(pool, _even(len(pool), len(who)), who, spec.test_per_class))
    return _by_client(dealt, len(owners))


def _mix_test(dataset: Dataset, owners: list[str], train: list[np.ndarray], spec: PartitionSpec) -> list[np.ndarray]:
    """Test images per client with its train label distribution.

    Client i with n_ik training images of class k gets r_i * n_ik test images of class k (rounded down, or up where
    the pool has images left, largest remainders first), disjoint from the other clients of its domain. r_i is the
    largest ratio that the domain's test pools allow for every class (so a domain whose test split mirrors its train
    split hands out nearly all of it), lowered where needed so that no class exceeds `test_per_class`."""
    n_classes = len(dataset.classes)
    dealt = []
    for d, who in _members(owners).items():
        y = dataset.domains[d]["train"].labels[np.concatenate([train[i] for i in who])]  # [N] the clients' labels
        client = np.repeat(np.arange(len(who)), [len(train[i]) for i in who])  # [N]
        n = np.bincount((client * n_classes + y)[y < n_classes], minlength=len(who) * n_classes)
        n = n.reshape(len(who), n_classes)  # [c, K] each client's training images per class
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
        counts += (rest > 1e-9) & ((-rest).argsort(0, kind="stable").argsort(0, kind="stable") < supply - counts.sum(0))
        dealt += [_deal(pool, counts[:, k], who) for k, pool in enumerate(pools)]
    return _by_client(dealt, len(owners))


def _val_positions(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Stratified positions held out for validation: round(fraction * n_k) per class, keeping one in train. Classes in
    increasing order, each its positions in increasing order; a class that gives up no image draws nothing. The
    definition: `_validation` gives every client's at once."""
    order = np.argsort(labels, kind="stable")  # [n] positions grouped by class, increasing within each
    n = np.bincount(labels)  # [K] images per class
    take = np.minimum(np.floor(fraction * n + 0.5).astype(np.int64), n - 1)  # [K]
    ends = np.cumsum(n)  # [K]
    picks = [rng.choice(order[e - k : e], t, replace=False) for k, t, e in zip(n, take, ends) if t > 0]
    return np.sort(np.concatenate([np.zeros(0, np.int64), *picks])).astype(np.int64)


def _validation(labels: list[np.ndarray], fraction: float, seed: int) -> list[np.ndarray]:
    """Every client's `_val_positions` (client i's labels `labels[i]`, its stream "val/i"), the classes of all clients
    counted and grouped with one sort; only the draws are per client (a client that gives up no image makes no
    stream)."""
    sizes = np.array([len(y) for y in labels], np.int64)  # [C]
    client = np.repeat(np.arange(len(labels)), sizes)  # [N]
    y = np.concatenate([np.zeros(0, np.int64), *labels]).astype(np.int64)  # [N]
    k = int(y.max(initial=-1)) + 1
    n = np.bincount(client * k + y, minlength=len(labels) * k).reshape(len(labels), k)  # [C, K] images per class
    take = np.minimum(np.floor(fraction * n + 0.5).astype(np.int64), n - 1)  # [C, K]
    order = np.lexsort((y, client))  # [N] by client, class, then position
    position = order - np.repeat(np.cumsum(sizes) - sizes, sizes)  # [N] positions into each client's train
    ends = np.cumsum(n.ravel()).reshape(n.shape)  # [C, K] where each (client, class) group ends in `position`
    picks: list[list[np.ndarray]] = [[] for _ in labels]
    rng, last = None, -1
    for i, c in zip(*(a.tolist() for a in np.nonzero(take > 0))):  # client i gives up images of class c
        if i != last:
            rng, last = _stream(seed, f"val/{i}"), i
        e = int(ends[i, c])
        picks[i].append(rng.choice(position[e - int(n[i, c]) : e], int(take[i, c]), replace=False))
    return [np.sort(np.concatenate([np.zeros(0, np.int64), *p])).astype(np.int64) for p in picks]


_TEST_SPLITS: dict[str, Callable[[Dataset, list[str], list[np.ndarray], PartitionSpec], list[np.ndarray]]] = {
    "whole": _whole_test,
    "train-mix": _mix_test,
}
