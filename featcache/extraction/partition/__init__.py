"""Split a `Dataset` among federated clients: which train, test and validation images each client owns.

Only labels are read. A `PartitionSpec` (plain data, saved with every cache and result) names a scheme from a
registry; the scheme decides each client's training images, then steps shared by every scheme follow:

* test: a client's test images have the same label distribution as its training images. For client i with n_ik
  training images of class k it gets r_i * n_ik test images of class k (rounded down, or up where the pool has
  images left, largest remainders first), disjoint from the other clients of its domain. r_i is the largest ratio
  that the domain's test pools allow for every class (so a domain whose test split mirrors its train split hands
  out nearly all of it), lowered where needed so that no class exceeds `test_per_class`.
* val: positions into the client's train array, stratified by label and seeded; a class keeps at least one image in
  train. Validation picks hyperparameters; the final run trains on the whole train array again (FedPCL, App. A.1.4).
* indices are sorted ascending (HDF5 reads with increasing indices).

Schemes (Tan et al., FedPCL, NeurIPS 2022, App. A.1, Tables 8-10 and 12-13):

* feature: client i owns domain i mod #domains; each domain's class pools are split evenly among its clients and
  capped at `per_class` images per class per client (FedPCL feature shift: 10 per class, 200 test per class).
* label: one domain; for every class, Dirichlet(alpha) proportions over the clients (Hsu et al. 2019) with the
  balancing rule of FedPCL's and NIID-Bench's code (a client already holding N/clients images gets no more).
  `per_class` first cuts each class pool to per_class * clients images (FedPCL's label shift keeps a small pool).
* feature-label: client i owns domain i mod #domains; for every class k, proportions p_k ~ Dir(alpha) over all
  clients and client i asks for floor(p_ik * clients * per_class) images of class k from its own domain, as
  FedPCL's official code does (so sizes vary around per_class * #classes, Table 10: [100, 75, 112, 120, 65]).
  Without `per_class`, a client's even share of its domain's class pool takes its place. A domain's clients draw
  disjoint images; when they ask for more than the pool holds, their requests shrink in proportion.
* pathological: one domain; each client holds exactly `classes_per_client` distinct classes (McMahan et al. 2017's
  shards, dealt so no client gets the same class twice) and every class is shared evenly among its holders.
* iid: one domain; a stratified, even random split.

`order` says which images of a class pool come first: "shuffled" (a seeded permutation, the default) or "first"
(the dataset's own order, as FedPCL's official code takes the first 10 train and 200 test images per class).
Dirichlet draws that leave a client without training images are redrawn (bounded); impossible requests raise
`UserError`.

Randomness: everything is deterministic given `seed`, and every step draws from a stream of its own, seeded by `seed`
and the step's name alone (`_stream`): "pools/train/<domain>" and "pools/test/<domain>" shuffle a domain's class
pools, "split" makes the scheme's draws (Dirichlet proportions, the pathological deck), "val/<client>" picks a
client's validation positions. A draw added to or removed from one step changes no other step's draws, a domain
added changes no other domain's pools, a client added no other client's validation positions.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .datasets.base import Dataset
from ..errors import UserError, suggest

_DIRICHLET_TRIES = 100


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


@dataclass
class ClientPart:
    """One client's share: indices into its domain's train and test ImageSets, val = positions into `train`."""

    domain: str
    train: np.ndarray  # [n] int64 indices into dataset.domains[domain]['train'], ascending
    test: np.ndarray  # [m] int64 indices into dataset.domains[domain]['test'], ascending
    val: np.ndarray  # [v] int64 positions into `train` held out for validation, ascending


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
    if spec.alpha <= 0:
        raise UserError(f"alpha must be > 0 (got {spec.alpha:g})")
    if spec.seed < 0:
        raise UserError(f"seed must be >= 0 (got {spec.seed})")
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


# -- class pools -------------------------------------------------------------------------------------------------

_ORDERS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "shuffled": lambda idx, rng: rng.permutation(idx),
    "first": lambda idx, rng: idx,
}

Pools = dict[str, list[np.ndarray]]  # domain -> one index array per class, in the order images are handed out


def _stream(seed: int, step: str) -> np.random.Generator:
    """The random stream of one step, named as in the module docstring: seeded by `seed` and the name alone."""
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


def _cut(pool: np.ndarray, per_class: int | None, clients: int) -> np.ndarray:
    return pool[: per_class * clients] if per_class else pool


def _chunks(pool: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Consecutive, disjoint pieces of `pool` with the given sizes (sum <= len(pool))."""
    return np.split(pool[: counts.sum()], np.cumsum(counts)[:-1])


def _gather(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [np.concatenate(p).astype(np.int64) for p in parts]


def _until_every_client_has_data(draw: Callable[[], list[np.ndarray]], spec: PartitionSpec) -> list[np.ndarray]:
    for _ in range(_DIRICHLET_TRIES):
        train = draw()
        if min(len(t) for t in train) > 0:
            return train
    raise UserError(
        f"{_DIRICHLET_TRIES} Dirichlet draws (alpha={spec.alpha:g}) each left a client without training images: "
        "use fewer clients, a larger alpha or a larger per_class"
    )


# -- schemes: (owners, train pools, spec, rng) -> each client's train indices -------------------------------------


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


# -- the partition -----------------------------------------------------------------------------------------------


def make_partition(dataset: Dataset, spec: PartitionSpec) -> list[ClientPart]:
    """Every client's train, test and validation indices, as `spec` describes (deterministic given spec.seed)."""
    scheme = _SCHEMES[spec.scheme]
    domains = _chosen_domains(dataset, spec, scheme.multi_domain)
    clients = spec.clients or (len(domains) if scheme.multi_domain else 5)
    owners = [domains[i % len(domains)] for i in range(clients)]
    used = list(dict.fromkeys(owners))
    available = sum(len(dataset.domains[d]["train"]) for d in used)
    if clients > available:
        raise UserError(
            f"{clients} clients but only {available} training images in {', '.join(used)}: use fewer clients"
        )

    n_classes = len(dataset.classes)
    pools = {d: _class_pools(dataset.domains[d]["train"].labels, n_classes, spec.order,
                             _stream(spec.seed, f"pools/train/{d}")) for d in used}
    train = [np.sort(t) for t in scheme.split(owners, pools, spec, _stream(spec.seed, "split"))]
    for i, (d, t) in enumerate(zip(owners, train)):
        if len(t) == 0:
            raise UserError(
                f"client {i} (domain {d!r}) got no training images: use fewer clients or a larger per_class"
            )
    test = _test_indices(dataset, owners, train, spec)
    return [
        ClientPart(d, tr, te, _val_positions(dataset.domains[d]["train"].labels[tr], spec.val_fraction,
                                             _stream(spec.seed, f"val/{i}")))
        for i, (d, tr, te) in enumerate(zip(owners, train, test))
    ]


def _chosen_domains(dataset: Dataset, spec: PartitionSpec, multi_domain: bool) -> list[str]:
    _refuse_missing_domains(dataset, spec, multi_domain)
    known = list(dataset.domains)
    chosen = list(spec.domains) if spec.domains else (known if multi_domain else known[:1])
    for d in chosen:
        if d not in dataset.domains:
            raise UserError(
                f"unknown domain {d!r} in dataset {dataset.name}{suggest(d, known)}; known: {', '.join(known)}"
            )
    if not multi_domain and len(chosen) != 1:
        raise UserError(
            f"scheme {spec.scheme!r} splits one domain but got {len(chosen)} ({', '.join(chosen)}): pass one"
        )
    return chosen


def _refuse_missing_domains(dataset: Dataset, spec: PartitionSpec, multi_domain: bool) -> None:
    """Refuse when the domains the partition would use include one whose files are absent (a reader records them in
    `dataset.extra["missing_domains"]`): without `--domain` that is any of the dataset's domains (the first one for
    single-domain schemes), so a run never silently uses fewer domains than the dataset has."""
    missing: dict[str, str] = dataset.extra.get("missing_domains") or {}
    if not missing:
        return
    order = dataset.extra.get("domain_order") or [*dataset.domains, *missing]
    wanted = list(spec.domains) if spec.domains else (order if multi_domain else order[:1])
    absent = [d for d in wanted if d in missing]
    if absent:
        where = "; ".join(f"{d}: {missing[d]}" for d in absent)
        raise UserError(
            f"{dataset.name}: domain{'s' if len(absent) > 1 else ''} {', '.join(absent)} not found (expected {where}); "
            f"put {'them' if len(absent) > 1 else 'it'} there, or pick present domains with --domain "
            f"(present: {', '.join(dataset.domains)})"
        )


def _test_indices(dataset: Dataset, owners: list[str], train: list[np.ndarray],
                  spec: PartitionSpec) -> list[np.ndarray]:
    """Test images per client with its train label distribution (see the module docstring)."""
    n_classes = len(dataset.classes)
    parts: list[list[np.ndarray]] = [[] for _ in owners]
    for d, who in _members(owners).items():
        y_train = dataset.domains[d]["train"].labels
        n = np.stack([np.bincount(y_train[train[i]], minlength=n_classes)[:n_classes] for i in who])  # [c, K]
        pools = _class_pools(dataset.domains[d]["test"].labels, n_classes, spec.order,
                             _stream(spec.seed, f"pools/test/{d}"))
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


def partition_counts(dataset: Dataset, parts: list[ClientPart]) -> dict:
    """JSON-able sizes per client ("train" counts the whole train array, validation images included)."""
    n_classes = len(dataset.classes)
    rows = []
    for i, part in enumerate(parts):
        splits = dataset.domains[part.domain]
        rows.append(
            {
                "client": i,
                "domain": part.domain,
                "train": int(len(part.train)),
                "val": int(len(part.val)),
                "test": int(len(part.test)),
                "train_per_class": np.bincount(splits["train"].labels[part.train], minlength=n_classes).tolist(),
                "test_per_class": np.bincount(splits["test"].labels[part.test], minlength=n_classes).tolist(),
            }
        )
    total = {key: sum(r[key] for r in rows) for key in ("train", "val", "test")}
    return {"classes": list(dataset.classes), "clients": rows, "total": total}
