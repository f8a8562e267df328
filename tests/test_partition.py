"""Partitions on small synthetic datasets: disjoint, deterministic, same train/test label mix, skew as asked."""

import hashlib
import json

import numpy as np
import pytest

from featcache.extraction.partition import schemes, steps
from featcache.extraction.datasets.base import ArrayImages, Dataset
from featcache.errors import UserError
from featcache.extraction.partition import ClientPart, PartitionSpec, list_schemes, make_partition, partition_counts

DOMAINS = ("mnist", "svhn", "usps", "synth", "mnistm")


def make_dataset(domains=DOMAINS, n_train=1500, n_test=600, n_classes=10, seed=0) -> Dataset:
    """Tiny fake images; labels shuffled and unevenly spread over classes (class k has weight k + 5)."""
    rng = np.random.default_rng(seed)
    weights = np.arange(n_classes) + 5.0
    weights /= weights.sum()

    def split(n):
        labels = rng.choice(n_classes, size=n, p=weights)  # [n]
        return ArrayImages(np.zeros((n, 2, 2), np.uint8), labels)

    splits = {d: {"train": split(n_train), "test": split(n_test)} for d in domains}
    return Dataset("fake", [f"c{k}" for k in range(n_classes)], splits)


DATA = make_dataset()
SPECS = {
    "feature": PartitionSpec("feature"),
    "feature-capped": PartitionSpec("feature", per_class=10, test_per_class=20),
    "feature-8": PartitionSpec("feature", clients=8),
    "label": PartitionSpec("label", clients=6, alpha=0.5),
    "label-capped": PartitionSpec("label", clients=4, alpha=1.0, per_class=15),
    "feature-label": PartitionSpec("feature-label", alpha=1.0),
    "feature-label-capped": PartitionSpec("feature-label", clients=12, alpha=0.5, per_class=10),
    "pathological": PartitionSpec("pathological", clients=7, classes_per_client=3),
    "iid": PartitionSpec("iid", clients=6),
}


def train_labels(part: ClientPart, data=DATA) -> np.ndarray:
    return data.domains[part.domain]["train"].labels[part.train]


def held_out_labels(part: ClientPart, data=DATA) -> np.ndarray:
    return data.domains[part.domain]["test"].labels[part.test]


def hist(labels, n_classes=10) -> np.ndarray:
    return np.bincount(labels, minlength=n_classes) / max(len(labels), 1)


def entropy(labels) -> float:
    p = hist(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("name", SPECS)
def test_parts_are_disjoint_sorted_int64_and_nonempty(name):
    parts = make_partition(DATA, SPECS[name])
    for split in ("train", "test"):
        for d in DATA.domains:
            owned = [getattr(p, split) for p in parts if p.domain == d]
            if owned:
                joined = np.concatenate(owned)
                assert len(np.unique(joined)) == len(joined), f"{split} overlaps in {d}"
                assert joined.max() < len(DATA.domains[d][split])
    for p in parts:
        assert len(p.train) > 0 and len(p.test) > 0
        for arr in (p.train, p.test, p.val):
            assert arr.dtype == np.int64 and np.all(np.diff(arr) > 0)


@pytest.mark.parametrize("name", ["feature", "label", "iid", "pathological", "feature-8"])
def test_uncapped_schemes_cover_every_training_image(name):
    parts = make_partition(DATA, SPECS[name])  # pathological: 7 clients x 3 classes = 21 slots cover 10 classes
    for d in {p.domain for p in parts}:
        joined = np.sort(np.concatenate([p.train for p in parts if p.domain == d]))
        np.testing.assert_array_equal(joined, np.arange(len(DATA.domains[d]["train"])))


@pytest.mark.parametrize("name", SPECS)
def test_same_seed_same_parts_other_seed_different(name):
    spec = SPECS[name]
    a, b = make_partition(DATA, spec), make_partition(DATA, spec)
    c = make_partition(DATA, PartitionSpec(**{**spec.to_dict(), "seed": 1}))
    for x, y in zip(a, b):
        for split in ("train", "test", "val"):
            np.testing.assert_array_equal(getattr(x, split), getattr(y, split))
    assert any(not np.array_equal(x.train, z.train) or not np.array_equal(x.val, z.val) for x, z in zip(a, c))


@pytest.mark.parametrize("name", SPECS)
def test_test_set_has_the_train_label_distribution(name):
    mix = PartitionSpec(**{**SPECS[name].to_dict(), "test_split": "train-mix"})  # feature's default is "whole"
    for p in make_partition(DATA, mix):
        n_train, n_test = np.bincount(train_labels(p), minlength=10), np.bincount(held_out_labels(p), minlength=10)
        assert np.all(n_test[n_train == 0] == 0), "a class absent from train appears in test"
        has = n_train > 0  # some ratio r gives every class r * n_train test images, rounded either way
        assert np.max((n_test[has] - 1) / n_train[has]) <= np.min((n_test[has] + 1) / n_train[has]) + 1e-9
        if len(p.test) >= 100:
            assert 0.5 * np.abs(hist(train_labels(p)) - hist(held_out_labels(p))).sum() < 0.05


def test_dirichlet_skew_grows_as_alpha_shrinks():
    data = make_dataset(domains=("a",), n_train=4000, n_test=1000)
    for scheme in ("label", "feature-label"):
        mean_entropy = {}
        for alpha in (0.1, 100.0):
            values = []
            for seed in range(3):
                spec = PartitionSpec(scheme, clients=8, alpha=alpha, seed=seed)
                values += [entropy(train_labels(p, data)) for p in make_partition(data, spec)]
            mean_entropy[alpha] = np.mean(values)
        assert mean_entropy[0.1] < mean_entropy[100.0] - 0.5, (scheme, mean_entropy)
        assert mean_entropy[100.0] > 0.95 * np.log(10)


def test_pathological_gives_exactly_k_classes_shared_evenly():
    for k in (1, 2, 3, 10):
        parts = make_partition(DATA, PartitionSpec("pathological", clients=10, classes_per_client=k))
        for p in parts:
            assert len(np.unique(train_labels(p))) == k
            assert set(np.unique(held_out_labels(p))) == set(np.unique(train_labels(p)))


def test_feature_cap_is_exact_and_first_order_takes_the_first_images():
    parts = make_partition(DATA, PartitionSpec("feature", per_class=10, test_per_class=20, order="first"))
    assert [p.domain for p in parts] == list(DOMAINS)
    for p in parts:
        assert np.all(np.bincount(train_labels(p), minlength=10) == 10)
        assert np.all(np.bincount(held_out_labels(p), minlength=10) == 20)
        y = DATA.domains[p.domain]["train"].labels
        first = np.sort(np.concatenate([np.flatnonzero(y == k)[:10] for k in range(10)]))
        np.testing.assert_array_equal(p.train, first)
    shuffled = make_partition(DATA, PartitionSpec("feature", per_class=10, test_per_class=20))
    assert not np.array_equal(shuffled[0].train, parts[0].train)
    assert np.all(np.bincount(train_labels(shuffled[0]), minlength=10) == 10)


def test_feature_with_more_clients_than_domains_splits_each_domain_evenly():
    parts = make_partition(DATA, PartitionSpec("feature", clients=8))
    assert [p.domain for p in parts] == [DOMAINS[i % 5] for i in range(8)]
    mnist = [np.bincount(train_labels(p), minlength=10) for p in parts if p.domain == "mnist"]
    assert len(mnist) == 2 and np.all(np.abs(mnist[0] - mnist[1]) <= 1)


def test_feature_label_reproduces_fedpcl_sizes():
    """Table 10: 5 clients, one per Digit-5 domain, per_class 10, alpha 1: sizes around 100 that differ."""
    sizes = []
    for seed in range(5):
        parts = make_partition(DATA, PartitionSpec("feature-label", alpha=1.0, per_class=10, seed=seed))
        assert [p.domain for p in parts] == list(DOMAINS)
        for p in parts:
            assert np.bincount(train_labels(p), minlength=10).max() <= 50  # floor(p_ik * 5 * 10)
        sizes += [len(p.train) for p in parts]
    assert len(set(sizes)) > 5 and 80 <= np.mean(sizes) <= 100
    many = make_partition(DATA, PartitionSpec("feature-label", clients=40, alpha=1.0, per_class=10))
    assert [p.domain for p in many] == [DOMAINS[i % 5] for i in range(40)]


def test_label_per_class_keeps_a_small_pool():
    parts = make_partition(DATA, PartitionSpec("label", clients=4, per_class=15))
    assert sum(len(p.train) for p in parts) == 4 * 15 * 10
    assert {p.domain for p in parts} == {"mnist"}


def test_iid_sizes_are_equal_and_stratified():
    parts = make_partition(DATA, PartitionSpec("iid", clients=6, per_class=10))
    for p in parts:
        assert np.all(np.bincount(train_labels(p), minlength=10) == 10)
    sizes = [len(p.train) for p in make_partition(DATA, PartitionSpec("iid", clients=7))]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("name", SPECS)
def test_val_positions_are_within_train_and_stratified(name):
    spec = SPECS[name]
    for p in make_partition(DATA, spec):
        assert len(np.unique(p.val)) == len(p.val) and (len(p.val) == 0 or p.val.max() < len(p.train))
        y = train_labels(p)
        n_all, n_val = np.bincount(y, minlength=10), np.bincount(y[p.val], minlength=10)
        assert np.all(n_val <= np.maximum(n_all - 1, 0)), "a class lost all its training images to validation"
        assert np.all(np.abs(n_val - spec.val_fraction * n_all) <= 1)


def test_val_fraction_zero_disables_validation():
    assert all(len(p.val) == 0 for p in make_partition(DATA, PartitionSpec("iid", val_fraction=0)))


@pytest.mark.parametrize("name", SPECS)
def test_partition_counts_sum_and_serialise(name):
    parts = make_partition(DATA, SPECS[name])
    counts = json.loads(json.dumps(partition_counts(DATA, parts)))
    assert len(counts["clients"]) == len(parts)
    for row, p in zip(counts["clients"], parts):
        assert row["domain"] == p.domain
        assert sum(row["train_per_class"]) == row["train"] == len(p.train)
        assert sum(row["test_per_class"]) == row["test"] == len(p.test)
        assert row["val"] == len(p.val)
    for key in ("train", "val", "test"):
        assert counts["total"][key] == sum(r[key] for r in counts["clients"])


def test_spec_round_trips_and_normalises_numbers():
    spec = PartitionSpec("feature-label", clients=12, alpha=1, domains=["usps", "svhn"], per_class=10)
    data = json.loads(json.dumps(spec.to_dict()))
    assert list(data) == [
        "scheme",
        "clients",
        "alpha",
        "per_class",
        "test_per_class",
        "classes_per_client",
        "domains",
        "val_fraction",
        "order",
        "seed",
    ]
    assert PartitionSpec.from_dict(data) == spec and data["alpha"] == 1.0 and spec.domains == ("usps", "svhn")
    assert [p.domain for p in make_partition(DATA, spec)][:3] == ["usps", "svhn", "usps"]
    assert set(list_schemes()) == {"feature", "label", "feature-label", "pathological", "iid"}


ERRORS = [
    (lambda: PartitionSpec("label", alpha=-1), "alpha must be a finite number > 0 (got -1)"),
    (lambda: PartitionSpec("label", alpha=0), "alpha must be a finite number > 0"),
    (lambda: PartitionSpec("lable"), "did you mean: label"),
    (lambda: PartitionSpec(clients=0), "clients must be >= 1"),
    (lambda: PartitionSpec(val_fraction=1.0), "val_fraction must be in [0, 1)"),
    (lambda: PartitionSpec(val_fraction=-0.1), "val_fraction must be in [0, 1)"),
    (lambda: PartitionSpec(per_class=0), "per_class must be >= 1"),
    (lambda: PartitionSpec(seed=-1), "seed must be in 0..4294967295 (got -1)"),
    (lambda: PartitionSpec(order="frist"), "did you mean: first"),
    (lambda: PartitionSpec(clients="5"), "clients has the wrong type"),
    (lambda: PartitionSpec(domains=[]), "domains must name each domain once"),
    (lambda: PartitionSpec.from_dict({"schme": "iid"}), "did you mean: scheme"),
    (lambda: make_partition(DATA, PartitionSpec(domains=("mnsit",))), "did you mean: mnist"),
    (lambda: make_partition(DATA, PartitionSpec("label", domains=("mnist", "usps"))), "splits one domain"),
    (lambda: make_partition(DATA, PartitionSpec("iid", clients=1501)), "1501 clients but only 1500 training"),
    (lambda: make_partition(DATA, PartitionSpec("feature", clients=1600, domains=("usps",))), "1600 clients"),
    (lambda: make_partition(DATA, PartitionSpec("pathological", classes_per_client=11)), "only 10 classes"),
    (lambda: make_partition(DATA, PartitionSpec("label", clients=1000, alpha=0.01)), "Dirichlet draws"),
]


@pytest.mark.parametrize("call, message", ERRORS, ids=[m for _, m in ERRORS])
def test_impossible_requests_are_one_line_user_errors(call, message):
    with pytest.raises(UserError) as err:
        call()
    text = str(err.value)
    assert message in text and "\n" not in text


def test_too_many_clients_for_a_small_domain_is_a_user_error():
    tiny = make_dataset(domains=("a",), n_train=30, n_test=10)
    with pytest.raises(UserError, match="got no training images|need it"):
        make_partition(tiny, PartitionSpec("pathological", clients=20, classes_per_client=5))


def test_domains_a_reader_found_missing_are_refused_unless_not_used():
    data = make_dataset(domains=("svhn", "usps"), n_train=200, n_test=100)
    data.extra.update(
        missing_domains={"mnist": "ROOT/MNIST/test.pkl", "synth": "ROOT/SynthDigits/test.pkl"},
        domain_order=["mnist", "svhn", "usps", "synth"],
    )
    for spec, absent in [
        (PartitionSpec(), "domains mnist, synth not found"),  # every domain by default
        (PartitionSpec("label", clients=2), "domain mnist not found"),  # the first one by default
        (PartitionSpec(domains=("usps", "synth")), "domain synth not found"),
    ]:
        with pytest.raises(UserError) as err:
            make_partition(data, spec)
        text = str(err.value)
        assert text.startswith(
            f"fake: {absent} (expected mnist: ROOT/MNIST/test.pkl"
            if "mnist" in absent
            else f"fake: {absent} (expected synth: ROOT/SynthDigits/test.pkl"
        )
        assert "--domains" in text and "present: svhn, usps" in text and "\n" not in text
    assert [p.domain for p in make_partition(data, PartitionSpec(domains=("usps", "svhn")))] == ["usps", "svhn"]
    assert {p.domain for p in make_partition(data, PartitionSpec("iid", clients=2, domains=("svhn",)))} == {"svhn"}
    del data.extra["domain_order"]  # without the order, the present domains come first: mnist is still refused
    with pytest.raises(UserError, match="domains mnist, synth not found"):
        make_partition(data, PartitionSpec())


def same_parts(a: list[ClientPart], b: list[ClientPart]) -> bool:
    return len(a) == len(b) and all(
        x.domain == y.domain and all(np.array_equal(getattr(x, k), getattr(y, k)) for k in ("train", "test", "val"))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("name", ["feature-capped", "iid"])
def test_a_draw_added_to_one_step_changes_no_other(name, monkeypatch):
    """The feature and iid schemes draw nothing in their split step: one draw added there must change nothing (with
    one stream for every step, it shifted the test pools' and validation draws that follow)."""
    spec = SPECS[name]
    before = make_partition(DATA, spec)
    real = schemes._SCHEMES[spec.scheme]
    drawing = schemes._Scheme(lambda *a: (a[-1].random(), real.split(*a))[1], real.multi_domain)
    monkeypatch.setitem(schemes._SCHEMES, spec.scheme, drawing)
    assert same_parts(make_partition(DATA, spec), before)


def test_a_domain_added_leaves_the_other_domains_clients_unchanged():
    options = dict(per_class=10, test_per_class=20, val_fraction=0.3)
    one = make_partition(DATA, PartitionSpec("feature", domains=("svhn",), **options))
    two = make_partition(DATA, PartitionSpec("feature", domains=("svhn", "usps"), **options))
    assert same_parts(one, two[:1]) and two[1].domain == "usps"


def test_validation_draws_come_from_the_stream_named_by_the_client():
    """Client i's validation positions are `_val_positions` drawn from the stream seeded by (seed, the sha256 words
    of "val/i"), as the module docstring says; "first" order and the feature scheme make train draw-free."""
    spec = PartitionSpec("feature", per_class=10, order="first", val_fraction=0.3, seed=7)
    for i, p in enumerate(make_partition(DATA, spec)):
        words = np.frombuffer(hashlib.sha256(f"val/{i}".encode()).digest(), np.uint32).tolist()
        rng = np.random.default_rng(np.random.SeedSequence([7, *words]))
        expected = steps._val_positions(train_labels(p), 0.3, rng)
        np.testing.assert_array_equal(p.val, expected)
