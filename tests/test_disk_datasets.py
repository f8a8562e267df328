"""Readers of real datasets on disk, each fed a tiny fixture written in its real format (see fixtures_disk.py)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
from fixtures_disk import (
    DIGIT5_SHAPES,
    dump,
    py2_pickle,
    write_cifar10,
    write_cifar100,
    write_class_folders,
    write_digit5,
    write_image,
    write_mnist,
    write_svhn,
    write_usps,
)

from featcache import cache as C
from featcache.extraction.datasets import load_dataset
from featcache.extraction.datasets.disk import DOMAINNET_CLASSES, OFFICE10_CLASSES, PACS_CLASSES, stratified_split
from featcache.extraction.datasets.safe_pickle import safe_load
from featcache.errors import UserError
from featcache.extraction.partition import PartitionSpec, make_partition


def one_line_error(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def all_labels(image_set) -> list[int]:
    return image_set.labels.tolist()


# --- safe_pickle ----------------------------------------------------------------------------------------------------


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Evals:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


class _Popens:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __reduce__(self):
        return subprocess.Popen, (self.argv,)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_safe_load_round_trips_numpy_and_containers(tmp_path, protocol):
    obj = (
        np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        np.array([3, 1], dtype=np.int64),
        np.array(["office_caltech_10/amazon/mug/frame_0001.jpg", "b"]),
        np.array(["x", None], dtype=object),
        {"k": [np.int64(7), 1.5, "s", b"raw", b""]},
        np.zeros((0, 28, 28), dtype=np.uint8),
    )
    back = safe_load(dump(obj, tmp_path / "ok.pkl", protocol))
    for a, b in zip(obj[:4], back[:4]):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert back[4] == {"k": [7, 1.5, "s", b"raw", b""]} and type(back[4]["k"][0]) is np.int64
    assert back[5].shape == (0, 28, 28)


def test_safe_load_reads_python2_cifar_pickles(tmp_path):
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    (tmp_path / "batch").write_bytes(py2_pickle({"data": data, "labels": [4, 9], "batch_label": "b\xe9"}))
    back = safe_load(tmp_path / "batch")
    np.testing.assert_array_equal(back["data"], data)
    assert back["labels"] == [4, 9] and back["batch_label"] == "b\xe9"


@pytest.mark.parametrize(
    "make, refused",
    [
        (lambda flag: _RunsCommand(f"touch {flag}"), f"{os.system.__module__}.system"),
        (lambda flag: _Evals(f"open({str(flag)!r}, 'w').close()"), "builtins.eval"),
        (lambda flag: _Popens(["touch", str(flag)]), "subprocess.Popen"),
    ],
    ids=["os.system", "eval", "subprocess"],
)
def test_safe_load_refuses_code_and_runs_nothing(tmp_path, make, refused):
    flag = tmp_path / "pwned"
    path = dump((np.zeros(3, np.uint8), [make(flag)]), tmp_path / "evil.pkl")
    with pytest.raises(UserError) as e:
        safe_load(path)
    one_line_error(e, f"refusing to unpickle {refused} from {path}")
    assert not flag.exists()
    (tmp_path / "MNIST" / "partitions").mkdir(parents=True)  # the same file as a dataset: refused there too
    path.rename(tmp_path / "MNIST" / "test.pkl")
    dump((np.zeros((1, 28, 28), np.uint8), [0]), tmp_path / "MNIST" / "partitions" / "train_part0.pkl")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, parts=1)
    one_line_error(e, f"refusing to unpickle {refused}", "test.pkl")
    assert not flag.exists()


def test_safe_load_refuses_protocol0_globals_and_odd_codecs(tmp_path):
    flag = tmp_path / "pwned"
    (tmp_path / "os.pkl").write_bytes(f"cos\nsystem\n(Vtouch {flag}\ntR.".encode())
    with pytest.raises(UserError) as e:
        safe_load(tmp_path / "os.pkl")
    one_line_error(e, "refusing to unpickle os.system")
    assert not flag.exists()
    (tmp_path / "rot.pkl").write_bytes(b"c_codecs\nencode\n(Vabc\nVrot13\ntR.")
    with pytest.raises(UserError) as e:
        safe_load(tmp_path / "rot.pkl")
    one_line_error(e, "cannot unpickle", "rot13")


def test_safe_load_truncated_and_missing_files_are_user_errors(tmp_path):
    good = pickle.dumps(np.arange(100, dtype=np.uint8), protocol=4)
    (tmp_path / "cut.pkl").write_bytes(good[:40])
    with pytest.raises(UserError) as e:
        safe_load(tmp_path / "cut.pkl")
    one_line_error(e, "cannot unpickle", "cut.pkl")
    with pytest.raises(UserError) as e:
        safe_load(tmp_path / "absent.pkl")
    one_line_error(e, "absent.pkl not found")


# --- digit5 ---------------------------------------------------------------------------------------------------------


def test_digit5_reads_fedbn_pickles(tmp_path):
    written = write_digit5(tmp_path / "digit", parts=2)
    data = load_dataset("digit5", tmp_path, parts=2)  # ROOT = FedBN's data/ holding digit/
    assert data.classes == [str(d) for d in range(10)]
    assert list(data.domains) == ["mnist", "svhn", "usps", "synth", "mnistm"]
    folders = {"mnist": "MNIST", "svhn": "SVHN", "usps": "USPS", "synth": "SynthDigits", "mnistm": "MNIST_M"}
    for domain, folder in folders.items():
        train_x, train_y, test_x, test_y = written[folder]
        train, test = data.domains[domain]["train"], data.domains[domain]["test"]
        assert (len(train), len(test)) == (24, 15)
        assert all_labels(train) == train_y.tolist() and all_labels(test) == test_y.tolist()
        image = train.image(12)  # first image of train_part1
        h, w = DIGIT5_SHAPES[folder][:2]
        assert image.mode == "RGB" and image.size == (w, h)
        rgb = np.asarray(image)  # [H, W, 3]
        expected = train_x[12] if train_x.ndim == 4 else np.repeat(train_x[12][..., None], 3, axis=-1)
        np.testing.assert_array_equal(rgb, expected)


def test_digit5_parts_and_present_domains_only(tmp_path):
    write_digit5(tmp_path, folders=("USPS", "MNIST"), parts=3)
    data = load_dataset("digit5", tmp_path, parts=1)  # ROOT = data/digit/ itself
    assert list(data.domains) == ["mnist", "usps"]
    assert len(data.domains["usps"]["train"]) == 12
    assert len(load_dataset("digit5", tmp_path, parts=3).domains["mnist"]["train"]) == 36
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path)  # FedPCL's default reads all ten partitions
    one_line_error(e, "train_part3.pkl is missing", "parts=10")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, parts=11)
    one_line_error(e, "parts must be an integer in 1..10")


def test_digit5_missing_data_names_layout_and_source(tmp_path):
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path)
    one_line_error(e, "no data found", "MNIST", "partitions/train_part", "github.com/med-air/FedBN")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", None)
    one_line_error(e, "needs --data-root pointing at", "SynthDigits")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path / "nowhere")
    one_line_error(e, "is not a folder")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, download=True)
    one_line_error(e, "cannot be downloaded", "FedBN")


def test_digit5_rejects_wrong_arrays_and_fingerprint_follows_content(tmp_path):
    write_digit5(tmp_path, folders=("SVHN",), parts=1)
    before = load_dataset("digit5", tmp_path, parts=1).fingerprint()
    assert load_dataset("digit5", tmp_path, parts=1).fingerprint() == before
    test_x, test_y = safe_load(tmp_path / "SVHN" / "test.pkl")
    test_x[0, 0, 0, 0] ^= 1
    dump((test_x, test_y), tmp_path / "SVHN" / "test.pkl")
    assert load_dataset("digit5", tmp_path, parts=1).fingerprint() != before
    dump((test_x.astype(np.float32), test_y), tmp_path / "SVHN" / "test.pkl")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, parts=1)
    one_line_error(e, "expected uint8 images", "float32")


def test_digit5_label_errors_name_the_label_and_the_range(tmp_path):
    write_digit5(tmp_path, folders=("MNIST",), parts=1, n_test=6)
    test_x, test_y = safe_load(tmp_path / "MNIST" / "test.pkl")
    dump((test_x, np.where(np.arange(6) >= 4, 10 + np.arange(6), test_y)), tmp_path / "MNIST" / "test.pkl")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, parts=1)
    message = one_line_error(e, "test.pkl: label 14 of image 4 is outside the digit classes 0..9", "2 of 6 labels")
    assert "labels for" not in message
    dump((test_x, test_y[:5]), tmp_path / "MNIST" / "test.pkl")
    with pytest.raises(UserError) as e:
        load_dataset("digit5", tmp_path, parts=1)
    one_line_error(e, "expected one label per image, got 5 labels for 6 images")


def _refused(data, **spec) -> str:
    with pytest.raises(UserError) as e:
        make_partition(data, PartitionSpec(**spec))
    return one_line_error(e)


def test_digit5_missing_domains_are_refused_unless_domain_picks_present_ones(tmp_path):
    write_digit5(tmp_path / "digit", folders=("USPS", "MNIST", "MNIST_M"), parts=2)
    data = load_dataset("digit5", tmp_path, parts=2)
    assert list(data.domains) == ["mnist", "usps", "mnistm"]  # the reader loads what is there ...
    base = tmp_path / "digit"
    message = _refused(data)  # ... and the default feature partition (all five domains) refuses to run on three
    assert message.startswith("digit5: domains svhn, synth not found (expected svhn: ")
    for folder in ("SVHN", "SynthDigits"):
        assert f"{base / folder}/partitions/train_part{{0..1}}.pkl and {base / folder}/test.pkl" in message
    assert "MNIST_M" not in message and "--domains" in message and "present: mnist, usps, mnistm" in message
    for scheme in ("feature", "feature-label"):
        _refused(data, scheme=scheme, clients=6)
    message = _refused(data, domains=("mnist", "svhn"))  # asking for an absent domain names its path
    assert "domain svhn not found" in message and str(base / "SVHN" / "test.pkl") in message
    parts = make_partition(data, PartitionSpec(domains=("mnist", "usps", "mnistm")))
    assert [p.domain for p in parts] == ["mnist", "usps", "mnistm"]
    assert {p.domain for p in make_partition(data, PartitionSpec("label", clients=3))} == {"mnist"}  # its default
    assert {p.domain for p in make_partition(data, PartitionSpec("iid", clients=2, domains=("usps",)))} == {"usps"}

    write_digit5(tmp_path / "svhn_only", folders=("SVHN",), parts=1)
    only_svhn = load_dataset("digit5", tmp_path / "svhn_only", parts=1)
    assert "domain mnist not found" in _refused(only_svhn, scheme="label", clients=2)  # the default would move
    assert "train_part0.pkl and" in _refused(only_svhn, scheme="label", clients=2)
    make_partition(only_svhn, PartitionSpec("label", clients=2, domains=("svhn",)))


def test_office10_domainnet_and_pacs_missing_sites_are_refused(tmp_path):
    data = tmp_path / "data"
    _fedbn_site(data, "office_caltech_10", "amazon", OFFICE10_CLASSES, "", as_numpy=True)
    write_class_folders(data / "office_caltech_10" / "dslr", {c: 3 for c in OFFICE10_CLASSES})
    office = load_dataset("office10", data)
    base = data / "office_caltech_10"
    message = _refused(office)
    assert message.startswith("office10: domains caltech, webcam not found")
    assert f"{base}/webcam_train.pkl and {base}/webcam_test.pkl, or {base}/webcam/{{class}}/*.jpg" in message
    assert {p.domain for p in make_partition(office, PartitionSpec(domains=("amazon", "dslr")))} == {"amazon", "dslr"}

    write_class_folders(tmp_path / "dn" / "sketch", {"zebra": 4, "bird": 4})
    domainnet = load_dataset("domainnet", tmp_path / "dn")
    assert "domains clipart, infograph, painting, quickdraw, real not found" in _refused(domainnet)
    make_partition(domainnet, PartitionSpec(domains=("sketch",)))

    write_class_folders(tmp_path / "pacs" / "photo", {"dog": 3, "horse": 3})
    pacs = load_dataset("pacs", tmp_path / "pacs")
    assert f"sketch: {tmp_path / 'pacs' / 'sketch'}/{{class}}/*.jpg" in _refused(pacs)
    make_partition(pacs, PartitionSpec("iid", clients=2))  # single-domain default: photo, the first, is present


def test_cli_refuses_missing_domains_in_one_line_and_extracts_chosen_ones_in_first_order(tmp_path):
    import h5py
    from harness import everything_in, one_line_error as one_line_cli_error, run_cli

    written = write_digit5(tmp_path / "digit", folders=("MNIST", "USPS"), parts=10, per_part=2, n_test=10)
    out = tmp_path / "out"
    args = [
        "extract",
        "--dataset",
        "digit5",
        "--data-root",
        str(tmp_path),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--per-class",
        "1",
        "--out",
        str(out),
        "--json",
    ]
    line = one_line_cli_error(run_cli(*args), "digit5: domains svhn, synth, mnistm not found")
    assert str(tmp_path / "digit" / "SynthDigits" / "partitions" / "train_part{0..9}.pkl") in line
    assert everything_in(out) == []
    ok = run_cli(*args, "--domains", "mnist", "--domains", "usps", "--order", "first", "--val-fraction", "0")
    assert ok.code == 0, ok.stderr
    with h5py.File(json.loads(ok.stdout)["cache"]) as f:
        assert json.loads(f.attrs["partition"])["order"] == "first"
        for c, folder in enumerate(("MNIST", "USPS")):
            train_y = written[folder][1]
            firsts = sorted(int(np.flatnonzero(train_y == k)[0]) for k in np.unique(train_y))  # first image per class
            assert C.client_rows(f, "train", c, "source_index").tolist() == firsts
    one_line_cli_error(run_cli("extract", "--dataset", "digit5", "--out", str(out)), "digit5 needs --data-root")
    one_line_cli_error(run_cli(*args, "--order", "frist"), "unknown partition order 'frist' (did you mean: first?)")


def test_complete_datasets_record_nothing_missing(tmp_path):
    write_digit5(tmp_path, parts=1)
    data = load_dataset("digit5", tmp_path, parts=1)
    assert "missing_domains" not in data.extra and len(make_partition(data, PartitionSpec())) == 5


# --- office10 and domainnet -----------------------------------------------------------------------------------------

_MODES = [("RGB", ".jpg"), ("L", ".png"), ("RGBA", ".png"), ("P", ".png"), ("I;16", ".png")]


def _fedbn_site(data: Path, folder: str, site: str, classes: list[str], prefix: str, as_numpy: bool) -> list[str]:
    """Images under data/folder/site/{class}/ and FedBN's {site}_{train,test}.pkl listing them; returns train labels."""
    listed = {"train": ([], []), "test": ([], [])}
    for i in range(9):
        cls = classes[(3 * i) % len(classes)]
        mode, suffix = _MODES[i % len(_MODES)]
        rel = f"{folder}/{site}/{cls}/frame_{i:04d}{suffix}"
        write_image(data / rel, mode, seed=i)
        split = "test" if i % 3 == 2 else "train"
        listed[split][0].append(prefix + rel)
        listed[split][1].append(cls)
    for split, (paths, labels) in listed.items():
        obj = (np.array(paths), np.array(labels)) if as_numpy else (paths, labels)
        dump(obj, data / folder / f"{site}_{split}.pkl")
    return listed["train"][1]


@pytest.mark.parametrize("point_at_subfolder", [False, True])
@pytest.mark.parametrize("prefix", ["", "../data/"])
def test_office10_reads_fedbn_path_pickles(tmp_path, prefix, point_at_subfolder):
    data = tmp_path / "data"
    train_text = _fedbn_site(data, "office_caltech_10", "amazon", OFFICE10_CLASSES, prefix, as_numpy=True)
    _fedbn_site(data, "office_caltech_10", "dslr", OFFICE10_CLASSES, prefix, as_numpy=False)
    root = data / "office_caltech_10" if point_at_subfolder else data
    loaded = load_dataset("office10", root)
    assert loaded.classes == OFFICE10_CLASSES and loaded.classes[5] == "laptop_computer"
    assert list(loaded.domains) == ["amazon", "dslr"]
    train = loaded.domains["amazon"]["train"]
    assert (len(train), len(loaded.domains["amazon"]["test"])) == (6, 3)
    assert all_labels(train) == [OFFICE10_CLASSES.index(t) for t in train_text]
    for i in range(len(train)):
        image = train.image(i)
        assert image.mode == "RGB" and image.size == (6, 5)
    assert train.paths[0] == data / "office_caltech_10" / "amazon" / train_text[0] / "frame_0000.jpg"


def test_fedbn_path_pickles_missing_images_and_halves(tmp_path):
    _fedbn_site(tmp_path, "office_caltech_10", "webcam", OFFICE10_CLASSES, "", as_numpy=True)
    root = tmp_path / "office_caltech_10"
    victim = next((root / "webcam").rglob("frame_0003*"))
    victim.unlink()
    with pytest.raises(UserError) as e:
        load_dataset("office10", root)
    one_line_error(e, "1 of 6 images listed in", "webcam_train.pkl", victim.name)
    for path in (root / "webcam").rglob("*.*"):
        path.unlink()
    with pytest.raises(UserError) as e:
        load_dataset("office10", root)
    one_line_error(e, "cannot find", "unpack the images")
    (root / "webcam_test.pkl").unlink()
    with pytest.raises(UserError) as e:
        load_dataset("office10", root)
    one_line_error(e, "webcam_test.pkl is missing")
    with pytest.raises(UserError) as e:
        load_dataset("office10", tmp_path / "data")
    one_line_error(e, "office10", "{amazon,caltech,dslr,webcam}_{train,test}.pkl", "FedBN")


def test_fedbn_path_pickle_with_unknown_label(tmp_path):
    write_image(tmp_path / "caltech" / "cat" / "a.jpg")
    dump((["caltech/cat/a.jpg"], ["cat"]), tmp_path / "caltech_train.pkl")
    dump((["caltech/cat/a.jpg"], ["cat"]), tmp_path / "caltech_test.pkl")
    with pytest.raises(UserError) as e:
        load_dataset("office10", tmp_path)
    one_line_error(e, "['cat']", "outside the expected classes")


def test_domainnet_pickles_and_folders(tmp_path):
    data = tmp_path / "data"
    _fedbn_site(data, "DomainNet", "clipart", DOMAINNET_CLASSES, "", as_numpy=True)
    write_class_folders(data / "DomainNet" / "sketch", {"zebra": 5, "bird": 3, "airplane": 4})  # airplane: not FedBN's
    loaded = load_dataset("domainnet", data)
    assert loaded.classes == DOMAINNET_CLASSES
    assert list(loaded.domains) == ["clipart", "sketch"]
    assert len(loaded.domains["clipart"]["train"]) == 6
    sketch = loaded.domains["sketch"]
    assert sorted(all_labels(sketch["train"]) + all_labels(sketch["test"])) == [0] * 3 + [9] * 5
    assert len(sketch["test"]) == 1 + 2  # round(0.3 * 3), round(0.3 * 5)
    assert not {p.parent.name for s in sketch.values() for p in s.paths} & {"airplane"}


def test_office10_folder_layout_split_is_seeded_and_stratified(tmp_path):
    write_class_folders(tmp_path / "caltech", {"mug": 10, "bike": 4, "monitor": 1})
    a = load_dataset("office10", tmp_path)
    b = load_dataset("office10", tmp_path)
    train, test = a.domains["caltech"]["train"], a.domains["caltech"]["test"]
    assert train.paths == b.domains["caltech"]["train"].paths and test.paths == b.domains["caltech"]["test"].paths
    mug, bike, monitor = (OFFICE10_CLASSES.index(c) for c in ("mug", "bike", "monitor"))
    assert sorted(all_labels(test)) == [bike] + [mug] * 3  # round(0.3 * 4) = 1, round(0.3 * 10) = 3; 1 image -> train
    assert monitor in all_labels(train) and not set(train.paths) & set(test.paths)
    other = load_dataset("office10", tmp_path, seed=1).domains["caltech"]["test"]
    assert other.paths != test.paths and sorted(all_labels(other)) == sorted(all_labels(test))
    assert len(load_dataset("office10", tmp_path, test_fraction=0.5).domains["caltech"]["test"]) == 2 + 5
    with pytest.raises(UserError) as e:
        load_dataset("office10", tmp_path, test_fraction=1.0)
    one_line_error(e, "test_fraction")


def test_stratified_split_keeps_classes_independent():
    labels = np.array([0] * 10 + [1] * 6)
    _, test = stratified_split(labels, 0.3, seed=3)
    _, test_more = stratified_split(np.concatenate([labels, [2] * 7]), 0.3, seed=3)
    assert test.tolist() == test_more[: len(test)].tolist()  # adding a class does not move the others


# --- pacs and imagefolder -------------------------------------------------------------------------------------------


def test_pacs_reads_kfold_folders(tmp_path):
    write_class_folders(tmp_path / "kfold" / "sketch", {"dog": 4, "person": 3}, suffix=".png", mode="L")
    write_class_folders(tmp_path / "kfold" / "photo", {"giraffe": 2}, suffix=".jpg")
    data = load_dataset("pacs", tmp_path)
    assert data.classes == PACS_CLASSES and list(data.domains) == ["photo", "sketch"]
    sketch = data.domains["sketch"]
    assert sorted(all_labels(sketch["train"]) + all_labels(sketch["test"])) == [0] * 4 + [6] * 3
    assert sketch["test"].image(0).mode == "RGB"
    with pytest.raises(UserError) as e:
        load_dataset("pacs", tmp_path / "kfold" / "photo")
    one_line_error(e, "no data found", "art_painting", "domaingeneralization.github.io")


def test_imagefolder_union_of_classes_splits_and_modes(tmp_path):
    (tmp_path / "b_site" / "train" / "zebra").mkdir(parents=True)  # an empty class folder still names a class
    for split, n in (("train", 3), ("test", 2)):
        write_class_folders(tmp_path / "b_site" / split, {"cat": n})
    for k, (mode, suffix) in enumerate(_MODES):
        write_image(tmp_path / "a_site" / "dog" / f"{k}{suffix}", mode, seed=k)
    write_image(tmp_path / "a_site" / "cat" / "x.JPG")
    (tmp_path / "a_site" / "dog" / "notes.txt").write_text("not an image")
    (tmp_path / "empty_site" / "dog").mkdir(parents=True)
    data = load_dataset("imagefolder", tmp_path, test_fraction=0.4)
    assert data.classes == ["cat", "dog", "zebra"]
    assert list(data.domains) == ["a_site", "b_site"]
    b = data.domains["b_site"]
    assert all_labels(b["train"]) == [0, 0, 0] and all_labels(b["test"]) == [0, 0]
    a = data.domains["a_site"]
    assert sorted(all_labels(a["train"]) + all_labels(a["test"])) == [0] + [1] * 5
    assert len(a["test"]) == 2  # round(0.4 * 5) dogs, the single cat stays in train
    images = [s.image(i) for s in a.values() for i in range(len(s))]
    assert {im.mode for im in images} == {"RGB"} and {im.size for im in images} == {(6, 5)}


def test_imagefolder_sixteen_bit_png_is_scaled_not_clipped(tmp_path):
    path = write_image(tmp_path / "d" / "c" / "deep.png", "I;16", seed=4)
    data = load_dataset("imagefolder", tmp_path, test_fraction=0.5)
    (split,) = [s for s in data.domains["d"].values() if len(s)]
    rgb = np.asarray(split.image(0))  # [5, 6, 3]
    assert rgb.shape == (5, 6, 3) and 0 < rgb.mean() < 255 and len(np.unique(rgb)) > 5
    assert split.paths == [path]


def test_imagefolder_fingerprint_follows_files_and_errors(tmp_path):
    write_class_folders(tmp_path / "site" / "train", {"a": 2, "b": 1})
    write_class_folders(tmp_path / "site" / "test", {"a": 1})
    before = load_dataset("imagefolder", tmp_path).fingerprint()
    assert load_dataset("imagefolder", tmp_path).fingerprint() == before
    target = tmp_path / "site" / "test" / "a" / "img_000.jpg"
    write_image(target, size=(9, 9), seed=77)
    assert load_dataset("imagefolder", tmp_path).fingerprint() != before
    with pytest.raises(UserError) as e:
        load_dataset("imagefolder", tmp_path / "site" / "test" / "a")
    one_line_error(e, "no data found", "ROOT/{domain}/{class}/")


# --- torchvision sets -----------------------------------------------------------------------------------------------


def test_cifar10_reads_python2_batches(tmp_path):
    images, labels = write_cifar10(tmp_path)
    data = load_dataset("cifar10", tmp_path)
    assert data.classes[:3] == ["airplane", "automobile", "bird"] and list(data.domains) == ["cifar10"]
    train, test = data.domains["cifar10"]["train"], data.domains["cifar10"]["test"]
    assert (len(train), len(test)) == (20, 5) and all_labels(train) == labels
    np.testing.assert_array_equal(np.asarray(train.image(9)), images[9])  # channel-major rows -> HWC pixels


def test_cifar100_uses_fine_labels(tmp_path):
    write_cifar100(tmp_path)
    data = load_dataset("cifar100", tmp_path)
    assert len(data.classes) == 100 and data.classes[37] == "class_37"
    assert all_labels(data.domains["cifar100"]["train"]) == [(37 * i) % 100 for i in range(6)]


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_files_like_torchvision(tmp_path, gz):
    written = write_mnist(tmp_path, gz=gz)
    data = load_dataset("mnist", tmp_path)
    train = data.domains["mnist"]["train"]
    np.testing.assert_array_equal(train.images, written["train"][0])
    assert all_labels(data.domains["mnist"]["test"]) == written["t10k"][1].tolist()
    assert train.image(0).mode == "RGB" and train.image(0).size == (28, 28)
    if not gz:  # torchvision reads extracted idx files without checksums: compare with its own reader
        import torchvision.datasets

        theirs = torchvision.datasets.MNIST(str(tmp_path), train=True, download=False)
        np.testing.assert_array_equal(train.images, theirs.data.numpy())
        assert all_labels(train) == theirs.targets.tolist()


def test_svhn_reads_mat_files_and_maps_ten_to_zero(tmp_path):
    written = write_svhn(tmp_path)
    data = load_dataset("svhn", tmp_path)
    for split in ("train", "test"):
        images = data.domains["svhn"][split]
        np.testing.assert_array_equal(images.images, written[split][0])
        assert all_labels(images) == written[split][1].tolist()
    assert 0 in all_labels(data.domains["svhn"]["train"])  # stored as 10 in the .mat file


@pytest.mark.parametrize("drop_zeros", [False, True])
def test_usps_reads_libsvm_like_torchvision(tmp_path, drop_zeros):
    written = write_usps(tmp_path, drop_zeros=drop_zeros)
    data = load_dataset("usps", tmp_path)
    train = data.domains["usps"]["train"]
    pixels, labels = written["usps.bz2"]
    expected = ((pixels.astype(np.float32) + 1) / 2 * 255).astype(np.uint8).reshape(-1, 16, 16)
    np.testing.assert_array_equal(train.images, expected)
    assert all_labels(train) == labels.tolist() and train.images[0, 0, 0] == 127  # the zero pixel, listed or not
    if not drop_zeros:
        import torchvision.datasets

        theirs = torchvision.datasets.USPS(str(tmp_path), train=True, download=False)
        np.testing.assert_array_equal(train.images, theirs.data)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
        ("mnist", "MNIST/raw"),
        ("svhn", "_32x32.mat"),
        ("usps", "usps.bz2"),
    ],
)
def test_torchvision_sets_offline_without_files(tmp_path, name, expected):
    with pytest.raises(UserError) as e:
        load_dataset(name, tmp_path)
    one_line_error(e, "not found", expected, "--download")
    with pytest.raises(UserError) as e:
        load_dataset(name, None)
    one_line_error(e, "needs --data-root:", expected)


def test_download_goes_through_torchvision_only_when_asked(tmp_path, monkeypatch):
    import torchvision.datasets

    calls = []

    class FakeCIFAR10:
        def __init__(self, root, train=True, download=False):
            calls.append({"root": root, "train": train, "download": download})
            if download and not (tmp_path / "cifar-10-batches-py").exists():
                write_cifar10(tmp_path)

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    with pytest.raises(UserError):
        load_dataset("cifar10", tmp_path)
    assert calls == []
    data = load_dataset("cifar10", tmp_path, download=True)
    assert calls == [
        {"root": str(tmp_path), "train": True, "download": True},
        {"root": str(tmp_path), "train": False, "download": True},
    ]
    assert len(data.domains["cifar10"]["train"]) == 20
    load_dataset("cifar10", tmp_path)
    assert len(calls) == 2

    class FailingSVHN:
        def __init__(self, root, split="train", download=False):
            raise RuntimeError("File not found or corrupted.\nsecond line")

    monkeypatch.setattr(torchvision.datasets, "SVHN", FailingSVHN)
    with pytest.raises(UserError) as e:
        load_dataset("svhn", tmp_path / "svhn", download=True)
    one_line_error(e, "downloading svhn with torchvision.datasets.SVHN failed", "File not found", "_32x32.mat")
