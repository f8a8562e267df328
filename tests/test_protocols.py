"""The data sets' own protocols on real-format fixtures: each domain's whole test split for a feature partition (or
the train label mix, when asked), PACS's official kfold lists, FedBN's `percent`, and leave-one-domain-out
(`holdout_domain`) from extraction to a report whose column names the held-out domain."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from fixtures_disk import write_digit5, write_domain_folders
from harness import run_cli

from featcache.errors import UserError
from featcache.extraction.datasets import load_dataset
from featcache.extraction.datasets.disk import DIGIT5_LAYOUT, PACS_CLASSES, PACS_DOMAINS
from featcache.extraction.partition import PartitionSpec, make_partition, partition_counts
from featcache.extraction.plan import _needs, protocol_notes


def write_pacs(root, per_class: int = 4, lists: bool = True):
    """PACS as its authors ship it: images under kfold/, the official lists in pacs_label/ (`path label`, labels
    1..7); the last image of each class is in crossval, and test_kfold lists the whole domain."""
    write_domain_folders(root / "kfold", PACS_DOMAINS, PACS_CLASSES, per_class=per_class)
    if not lists:
        return root
    (root / "pacs_label").mkdir(parents=True)
    for d in PACS_DOMAINS:
        rows = {"train": [], "crossval": [], "test": []}
        for k, c in enumerate(PACS_CLASSES):
            for i in range(per_class):
                line = f"{d}/{c}/img_{i:03d}.png {k + 1}"
                rows["crossval" if i == per_class - 1 else "train"].append(line)
                rows["test"].append(line)
        for name, lines in rows.items():
            (root / "pacs_label" / f"{d}_{name}_kfold.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def digit5(tmp_path_factory):
    root = tmp_path_factory.mktemp("digit5")
    write_digit5(root, parts=10, per_part=12, n_test=30)
    return load_dataset("digit5", root)


def test_feature_partitions_test_on_each_domains_whole_split_by_default(digit5):
    whole = make_partition(digit5, PartitionSpec("feature", per_class=1))  # 1 train image per class: 10 each
    for part in whole:
        np.testing.assert_array_equal(part.test, np.arange(len(digit5.domains[part.domain]["test"])))
    mix = make_partition(digit5, PartitionSpec("feature", per_class=1, test_split="train-mix"))
    assert all(len(m.test) <= len(w.test) for m, w in zip(mix, whole))
    two = make_partition(digit5, PartitionSpec("feature", clients=10, per_class=1))  # two clients per domain
    for d in digit5.domains:
        joined = np.sort(np.concatenate([p.test for p in two if p.domain == d]))
        np.testing.assert_array_equal(joined, np.arange(len(digit5.domains[d]["test"])))  # shared, disjoint
    capped = make_partition(digit5, PartitionSpec("feature", test_per_class=2))
    assert all(np.bincount(digit5.domains[p.domain]["test"].labels[p.test]).max() <= 2 for p in capped)


def test_the_test_protocol_is_told_and_recorded_only_when_asked(digit5):
    (line,) = protocol_notes([PartitionSpec("feature")], None)
    assert line.startswith("test split whole: each domain's whole test split") and "--test-split train-mix" in line
    (line,) = protocol_notes([PartitionSpec("feature-label", test_split="train-mix")], None)
    assert line.startswith("test split train-mix") and "--test-split whole" in line
    assert protocol_notes([PartitionSpec("label")], None) == []  # a one-domain split: the usual label mix, unsaid
    assert "test_split" not in PartitionSpec("feature").to_dict()  # keys and result files of default partitions
    assert PartitionSpec("feature", test_split="whole").to_dict()["test_split"] == "whole"
    with pytest.raises(UserError, match=r"unknown test split 'hole' \(did you mean: whole\?\)"):
        PartitionSpec("feature", test_split="hole")


def test_fedbn_percent_follows_fedbns_part_files(digit5):
    assert digit5.extra["train_parts"]["mnist"] == [12] * 10
    for percent, kept in ((0.1, 12), (0.3, 36), (1.0, 120), (0.05, 6)):  # whole parts; below 0.1 a share of part 0
        parts = make_partition(digit5, PartitionSpec("feature", percent=percent, order="first"))
        assert all(p.train.max() < kept for p in parts) and all(len(p.train) == kept for p in parts)
    (line,) = [x for x in protocol_notes([PartitionSpec("feature", percent=0.1)], digit5) if "percent" in x]
    assert "percent=0.1" in line and "FedBN's train_part files" in line
    with pytest.raises(UserError, match=r"percent must be in \(0, 1\]"):
        PartitionSpec("feature", percent=1.5)
    with pytest.raises(UserError, match="keeps no training image"):
        make_partition(digit5, PartitionSpec("feature", percent=0.001))


def test_digit5_layout_puts_test_pkl_beside_partitions():
    assert "ROOT/{MNIST,...}/test.pkl" in DIGIT5_LAYOUT and ".../test.pkl" not in DIGIT5_LAYOUT


def test_pacs_reads_the_official_kfold_lists_when_present(tmp_path):
    data = load_dataset("pacs", write_pacs(tmp_path / "with"))
    for d in PACS_DOMAINS:
        train, test = data.domains[d]["train"], data.domains[d]["test"]
        assert len(train) == 7 * 3 and len(test) == 7  # train_kfold and crossval_kfold, not a seeded 70/30
        assert all(p.name == "img_003.png" for p in test.paths)
        assert [PACS_CLASSES[k] for k in test.labels] == [p.parent.name for p in test.paths]
    assert "official kfold splits" in data.extra["notes"][0] and "pacs_label" in data.extra["notes"][0]
    assert "_test_kfold.txt is not read" in data.extra["notes"][0]  # the user's lists: which one is left unread
    plain = load_dataset("pacs", write_pacs(tmp_path / "without", lists=False))
    assert "no official kfold lists found" in plain.extra["notes"][0]
    assert len(plain.domains["photo"]["train"]) + len(plain.domains["photo"]["test"]) == 28


def test_pacs_kfold_lists_refuse_bad_lines_in_one_line(tmp_path):
    root = write_pacs(tmp_path)
    (root / "pacs_label" / "photo_train_kfold.txt").write_text("photo/dog/img_000.png 9\n")
    with pytest.raises(UserError, match=r"photo_train_kfold.txt: line 'photo/dog/img_000.png 9' is not 'PATH LABEL'"):
        load_dataset("pacs", root)


def test_holdout_domain_tests_every_client_on_the_whole_held_out_domain(tmp_path):
    data = load_dataset("pacs", write_pacs(tmp_path))
    parts = make_partition(data, PartitionSpec("feature", holdout_domain="sketch"))
    assert [p.domain for p in parts] == ["photo", "art_painting", "cartoon"]
    for p in parts:
        assert p.test_domain == "sketch" and len(p.test) == 7 and len(p.test_train) == 21  # all 28 of sketch
    rows = partition_counts(data, parts)["clients"]
    assert all(r["test"] == 28 and r["test_domain"] == "sketch" for r in rows)
    for bad, why in (
        (dict(scheme="label", holdout_domain="sketch"), "needs a partition over several domains"),
        (dict(holdout_domain="sketch", domains=("photo", "sketch")), "leave it out of domains"),
        (dict(holdout_domain="sketch", test_per_class=3), "test_per_class does not apply"),
    ):
        with pytest.raises(UserError, match=why):
            PartitionSpec(**bad)
    with pytest.raises(UserError, match=r"unknown holdout domain 'skech'.*did you mean: sketch"):
        make_partition(data, PartitionSpec("feature", holdout_domain="skech"))


@pytest.mark.parametrize("held", ["mnist", "synth"])
def test_a_held_out_domain_larger_than_a_training_domain_embeds_only_its_own_rows(held):
    """offline-digits holding out mnist or synth (test splits of 1,500 images; optdigits' holds 539): the client's
    test rows index the held-out domain, never the client's own (an IndexError there before)."""
    data = load_dataset("offline-digits", domains=["optdigits", held])
    parts = make_partition(data, PartitionSpec("feature", holdout_domain=held))
    needs = _needs([parts], 0)
    assert (("optdigits", "test", 0) not in needs) and len(needs[(held, "test", 0)]) == len(data.domains[held]["test"])
    for (domain, split, _), rows in needs.items():
        assert rows.max() < len(data.domains[domain][split])


def test_leave_one_domain_out_extracts_trains_and_reports_by_held_out_domain(tmp_path):
    root = write_pacs(tmp_path / "pacs")
    args = ["--backbone", "test_resnet=random", "--image-size", "32", "--out", str(tmp_path / "cache")]
    done = run_cli("extract", "--dataset", "pacs", "--data-root", str(root), "--holdout-domain", "sketch,photo", *args)
    assert done.code == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    assert any("official kfold splits" in n for n in notes)
    assert any("leave-one-domain-out" in n and "sketch: 28" in n and "photo: 28" in n for n in notes)
    made = json.loads(run_cli("extract", "--dataset", "pacs", "--data-root", str(root), "--holdout-domain",
                              "sketch,photo", *args, "--json").stdout)  # fmt: skip
    by_held = {c["partition"]["holdout_domain"]: c["cache"] for c in made["caches"]}
    with h5py.File(by_held["sketch"]) as f:  # every test row is one of sketch's images, named as such
        domains = json.loads(f.attrs["domains"])
        counts = json.loads(f.attrs["counts"])["clients"]
        assert domains[-1] == "sketch" and all(r["test"] == 28 for r in counts)
    for cache in by_held.values():
        res = run_cli("train", "--cache", cache, "--algo", "fedavg", "--rounds", "1", "--seeds", "0",
                      "--out", str(tmp_path / "runs"), "--json")  # fmt: skip
        assert res.code == 0, res.stderr
    report = run_cli("report", str(tmp_path / "runs"), "--out", str(tmp_path / "report"))
    assert report.code == 0, report.stderr
    assert "| held-out test domain |" in report.stdout
    assert "\n| photo |" in report.stdout and "\n| sketch |" in report.stdout
