"""`make_partition`: choose the domains, run the scheme, then the shared steps; `ClientPart`, `partition_counts`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import UserError, suggest
from ..datasets.base import Dataset
from .schemes import _SCHEMES
from .spec import PartitionSpec
from .steps import _class_pools, _kept_train, _stream, _test_indices, _validation


@dataclass
class ClientPart:
    """One client's share: indices into its domain's train and test ImageSets, val = positions into `train`. With a
    held-out domain (`test_domain`), `test` indexes that domain's test split and `test_train` its train split: the
    client is tested on both."""

    domain: str
    train: np.ndarray  # [n] int64 indices into dataset.domains[domain]['train'], ascending
    test: np.ndarray  # [m] int64 indices into dataset.domains[test_domain]['test'], ascending
    val: np.ndarray  # [v] int64 positions into `train` held out for validation, ascending
    test_domain: str = ""  # the domain tested on: "" is the client's own
    test_train: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [t] int64, ascending

    @property
    def tested_on(self) -> str:
        return self.test_domain or self.domain


def make_partition(dataset: Dataset, spec: PartitionSpec) -> list[ClientPart]:
    """Every client's train, test and validation indices, as `spec` describes (deterministic given spec.seed)."""
    scheme = _SCHEMES[spec.scheme]
    domains = _chosen_domains(dataset, spec, scheme.multi_domain)
    clients = spec.clients or (len(domains) if scheme.multi_domain else 5)
    used = domains[: min(clients, len(domains))]  # the domains clients own, known before any list of clients is
    kept = {d: _kept_train(dataset, d, spec.percent) for d in used}  # FedBN's percent: a prefix of each train split
    available = sum(kept.values())  # built (10**30 clients: refused at once)
    if clients > available:
        raise UserError(
            f"{clients} clients but only {available} training images in {', '.join(used)}: use fewer clients"
        )
    owners = [domains[i % len(domains)] for i in range(clients)]

    n_classes = len(dataset.classes)
    pools = {
        d: _class_pools(
            dataset.domains[d]["train"].labels[: kept[d]], n_classes, spec.order, _stream(spec.seed, f"pools/train/{d}")
        )
        for d in used
    }
    train = scheme.split(owners, pools, spec, _stream(spec.seed, "split"))  # each increasing
    for i, (d, t) in enumerate(zip(owners, train)):
        if len(t) == 0:
            raise UserError(
                f"client {i} (domain {d!r}) got no training images: use fewer clients or a larger per_class"
            )
    held = spec.holdout_domain
    test = (
        _test_indices(dataset, owners, train, spec)
        if held is None
        else [np.arange(len(dataset.domains[held]["test"]))] * clients
    )
    whole = np.arange(len(dataset.domains[held]["train"])) if held is not None else np.zeros(0, np.int64)
    labels = [dataset.domains[d]["train"].labels[tr] for d, tr in zip(owners, train)]
    val = _validation(labels, spec.val_fraction, spec.seed)
    return [ClientPart(d, tr, te, v, held or "", whole) for d, tr, te, v in zip(owners, train, test, val)]


def _chosen_domains(dataset: Dataset, spec: PartitionSpec, multi_domain: bool) -> list[str]:
    """The domains clients train on (a held-out domain is checked and left out of them)."""
    _refuse_missing_domains(dataset, spec, multi_domain)
    known = list(dataset.domains)
    held = spec.holdout_domain
    chosen = list(spec.domains) if spec.domains else (known if multi_domain else known[:1])
    if held is not None:
        if held not in dataset.domains:
            raise UserError(
                f"unknown holdout domain {held!r} in dataset {dataset.name}{suggest(held, known)}; "
                f"known: {', '.join(known)}"
            )
        chosen = [d for d in chosen if d != held]
        if not chosen:
            raise UserError(f"holding out {held!r} leaves no domain to train on: name others with --domains")
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
    `dataset.extra["missing_domains"]`): without `--domains` that is any of the dataset's domains (the first one for
    single-domain schemes), so a run never silently uses fewer domains than the dataset has."""
    missing: dict[str, str] = dataset.extra.get("missing_domains") or {}
    if not missing:
        return
    order = dataset.extra.get("domain_order") or [*dataset.domains, *missing]
    wanted = list(spec.domains) if spec.domains else (order if multi_domain else order[:1])
    wanted += [spec.holdout_domain] if spec.holdout_domain and spec.holdout_domain not in wanted else []
    absent = [d for d in wanted if d in missing]
    if absent:
        where = "; ".join(f"{d}: {missing[d]}" for d in absent)
        raise UserError(
            f"{dataset.name}: domain{'s' if len(absent) > 1 else ''} {', '.join(absent)} not found (expected {where}); "
            f"put {'them' if len(absent) > 1 else 'it'} there, or pick present domains with --domains "
            f"(present: {', '.join(dataset.domains)})"
        )


def partition_counts(dataset: Dataset, parts: list[ClientPart]) -> dict:
    """JSON-able sizes per client ("train" counts the whole train array, validation images included)."""
    n_classes = len(dataset.classes)
    rows = []
    for i, part in enumerate(parts):
        splits, tested = dataset.domains[part.domain], dataset.domains[part.tested_on]
        y_test = np.concatenate([tested["test"].labels[part.test], tested["train"].labels[part.test_train]])  # [m]
        rows.append(
            {
                "client": i,
                "domain": part.domain,
                "train": int(len(part.train)),
                "val": int(len(part.val)),
                "test": int(len(y_test)),
                "train_per_class": np.bincount(splits["train"].labels[part.train], minlength=n_classes).tolist(),
                "test_per_class": np.bincount(y_test, minlength=n_classes).tolist(),
            }
            | ({"test_domain": part.test_domain} if part.test_domain else {})
        )
    total = {key: sum(r[key] for r in rows) for key in ("train", "val", "test")}
    return {"classes": list(dataset.classes), "clients": rows, "total": total}
