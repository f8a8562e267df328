"""Caches of many clients: the one-walk metadata checksum (`h5.walk`) equals the object-by-object definition on every
kind of attribute, the writer's checksum (kept as it writes) equals the file's, the same inputs give the same bytes,
and a load of many clients returns what plain h5py reads and refuses a change at a late client. Speed is
bench/clients.py's."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import edit_cache

from featcache import cache as C
from featcache.cache import h5, load
from featcache.errors import UserError
from featcache.testing import write_format2
from tests.synthetic import write_cache
from tests.test_cache_format import inputs

CLIENTS = 40


def reference_meta_sha256(f: h5py.File, bind_data: bool = True) -> str:
    """The metadata checksum as the schema states it, computed with h5py's high-level objects, one by one."""
    entries = [["/", "group", h5.plain_attrs(f)]]
    for name, obj in h5.objects(f):
        kind = f"dataset {obj.dtype.str} {list(obj.shape)}" if isinstance(obj, h5py.Dataset) else "group"
        if bind_data and isinstance(obj, h5py.Dataset):
            kind += f" {h5.plain(obj.attrs.get('sha256'))}"
        entries.append([name, kind, h5.plain_attrs(obj)])
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    return Path(write_cache(tmp_path_factory.mktemp("many") / "c.h5", C=CLIENTS, D=8, K=3, n=(3, 9)))


def copy(src: Path, tmp: Path) -> Path:
    return Path(shutil.copy(src, tmp / "c.h5"))


def test_the_writers_checksum_is_the_files_and_the_walk_is_the_definition(many, tmp_path):
    with h5py.File(many) as f:
        assert f.attrs["meta_sha256"] == reference_meta_sha256(f) == h5.meta_sha256(f)
        nodes = h5.walk(f)
        assert list(nodes) == ["/", *(name for name, _ in h5.objects(f))]
    old = Path(write_format2(tmp_path / "old.h5", *inputs(views=2)[:2], inputs(views=2)[2]))
    with h5py.File(old) as f:  # format 2's checksum: the datasets' own sha256 not bound
        assert f.attrs["meta_sha256"] == reference_meta_sha256(f, False) == h5.meta_sha256(f, bind_data=False)


ATTRIBUTES = {
    "int": np.int64(7),
    "float": 0.25,
    "bool": True,
    "vlen-str": "naïve",
    "ascii-vlen-str": np.array(b"abc", dtype=h5py.string_dtype("ascii")),
    "fixed-bytes": np.bytes_(b"fixed"),
    "int-array": np.arange(3),
    "str-array": np.array(["a", "bé"], dtype=h5py.string_dtype()),
    "float-2d": np.ones((2, 2), np.float32),
}


def test_the_walk_reads_every_kind_of_attribute_as_h5py_does(many, tmp_path):
    path = copy(many, tmp_path)
    with h5py.File(path, "r+") as f:
        for name, value in ATTRIBUTES.items():
            f["train/labels"].attrs[name] = value
            f["train"].attrs[name] = value
        f.create_group("extra/deep")  # groups without attributes, never opened by the walk
    with h5py.File(path) as f:
        nodes = h5.walk(f)
        for where in ("train/labels", "train"):
            expected = dict(f[where].attrs.items())
            assert nodes[where].attrs.keys() == expected.keys()
            for name, value in expected.items():
                got = nodes[where].attrs[name]
                assert type(got) is type(value) and np.array_equal(got, value), name
        assert h5.meta_sha256(f, nodes=nodes) == reference_meta_sha256(f)


def test_an_empty_attribute_is_unreadable_as_before(many, tmp_path):
    path = copy(many, tmp_path)
    with h5py.File(path, "r+") as f:
        f["test"].attrs["empty"] = h5py.Empty("f4")
    with h5py.File(path) as f:
        with pytest.raises(TypeError):
            reference_meta_sha256(f)
        with pytest.raises(TypeError):
            h5.meta_sha256(f)
    assert C.verify(path)["problems"][0].startswith("unreadable (TypeError")


def high_level_write(path: Path, header: dict, backbones: list[dict], clients: list[C.Client]) -> None:
    """The schema written with h5py's high-level calls, object by object in the writer's order (the feature arrays
    made first and filled client by client, then the index arrays whole), its checksum read back from the file."""
    from featcache import __version__
    from featcache.cache.write import FORMAT, INDEX_DTYPES, MARKER, SPLITS, offsets

    def array(name, data):
        data = np.ascontiguousarray(data)
        f.create_dataset(name, data=data, track_times=False).attrs["sha256"] = hashlib.sha256(data).hexdigest()

    rows = header["counts"]["clients"]
    with h5.create_h5(path) as f:
        h5.write_attrs(
            f, header | {MARKER: FORMAT, "featcache_version": __version__, "backbones": [b["key"] for b in backbones]}
        )
        start = 0
        for b in backbones:
            attrs = {k: v for k, v in b.items() if k != "key"} | {"columns": [start, start + b["dim"]]}
            h5.write_attrs(f.create_group(f"backbones/{b['key']}"), attrs)
            start += b["dim"]
        features = {}
        for split in SPLITS:
            shape = (sum(row[split] for row in rows), start)
            features[split] = f.create_dataset(f"{split}/features/concat", shape, "<f4", track_times=False)
        for split in SPLITS:
            x = np.concatenate(
                [np.concatenate([np.asarray(b, "<f4") for b in getattr(c, split).features], -1) for c in clients]
            )
            features[split][...] = x
            features[split].attrs["sha256"] = hashlib.sha256(x).hexdigest()
        for split in SPLITS:
            index = {"labels": [], "source_index": [], "domain": []}
            for client in clients:
                s = getattr(client, split)
                index["labels"].append(s.labels)
                index["source_index"].append(s.source_index)
                index["domain"].append(np.full(len(s.labels), header["domains"].index(client.domain)))
            for name, dtype in INDEX_DTYPES.items():
                array(f"{split}/{name}", np.concatenate([np.asarray(v, dtype) for v in index[name]]))
        array("train/val_index", np.concatenate([np.asarray(c.val_index, np.int64) for c in clients]))
        for split in SPLITS:
            array(f"{split}/offsets", offsets([row[split] for row in rows]))
        array("train/val_offsets", offsets([len(c.val_index) for c in clients]))
        f.attrs["images"] = sum(row[split] for row in rows for split in SPLITS)
        f.attrs["meta_sha256"] = reference_meta_sha256(f)


def test_the_writer_makes_the_bytes_h5pys_high_level_calls_make(tmp_path):
    header, backbones, clients, _ = inputs(rows=((40, 17), (25, 0), (0, 9), (33, 5)))
    C.write(tmp_path / "low.h5", header, backbones, clients)
    high_level_write(tmp_path / "high.h5", header, backbones, clients)
    assert (tmp_path / "low.h5").read_bytes() == (tmp_path / "high.h5").read_bytes()


def test_the_same_clients_give_the_same_bytes(tmp_path):
    a = Path(write_cache(tmp_path / "a.h5", C=CLIENTS, D=8, K=3, n=(3, 9)))
    b = Path(write_cache(tmp_path / "b.h5", C=CLIENTS, D=8, K=3, n=(3, 9)))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("holdout", ["none", "fit", "val"])
def test_many_clients_load_as_plain_h5py_reads_them_first_and_second_time(many, tmp_path, holdout):
    path = copy(many, tmp_path)
    with h5py.File(path) as f:
        expect = []
        g, at, val_at = f["train"], f["train/offsets"][...], f["train/val_offsets"][...]
        for c in range(CLIENTS):
            n, val = at[c + 1] - at[c], g["val_index"][val_at[c] : val_at[c + 1]]
            rows = at[c] + {"none": np.arange(n), "val": val, "fit": np.setdiff1d(np.arange(n), val)}[holdout]
            expect.append((g["features/concat"][...][rows], g["labels"][...][rows]))
    for _ in range(2):
        got = C.load_clients(path, "train", holdout=holdout)
        assert got.counts.tolist() == [len(y) for _, y in expect]
        for c, (x, y) in enumerate(expect):
            np.testing.assert_array_equal(got.features[c, : len(x)].numpy(), x)
            np.testing.assert_array_equal(got.labels[c, : len(y)].numpy(), y)
    test = C.load_clients(path, "test")  # the other split's features, checked on their first read
    assert test.counts.tolist() == [row["test"] for row in got.meta["counts"]["clients"]]


def client_rows(f: h5py.File, split: str, c: int) -> slice:
    at = f[f"{split}/offsets"][...]
    return slice(at[c], at[c + 1])


def swap_features(f: h5py.File) -> None:
    """Two clients' first test rows swapped."""
    x = f["test/features/concat"]
    a, b = client_rows(f, "test", 12), client_rows(f, "test", 30)
    n = min(a.stop - a.start, b.stop - b.start)
    rows = x[a.start : a.start + n].copy()
    x[a.start : a.start + n], x[b.start : b.start + n] = x[b.start : b.start + n], rows


def flip_late_label(f: h5py.File) -> None:
    labels, at = f["test/labels"], client_rows(f, "test", CLIENTS - 1).start
    labels[at] = (labels[at] + 1) % 3


def shift_late_offset(f: h5py.File) -> None:
    at = f["test/offsets"][...]
    at[-2] -= 1
    f["test/offsets"][...] = at


# name -> (edit, reseal, what the one line says)
LATE_CHANGES = {
    "features-swapped": (swap_features, False, "test/features/concat: sha256 mismatch"),
    "label-flipped": (flip_late_label, False, "test/labels: sha256 mismatch"),
    "offset-shifted": (shift_late_offset, True, "test/offsets: not the running total of the stored counts' test rows"),
    "attribute": (lambda f: f["test/labels"].attrs.__setitem__("note", "other"), False, "metadata checksum"),
}


@pytest.mark.parametrize("case", LATE_CHANGES.values(), ids=LATE_CHANGES.keys())
def test_a_change_at_a_late_client_is_refused_by_the_first_load_and_verify(many, tmp_path, case):
    edit, reseal, needle = case
    bad = edit_cache(copy(many, tmp_path), edit, reseal=reseal)
    with pytest.raises(UserError, match="failed verification") as refused:
        C.load_clients(bad, "test")
    assert "\n" not in str(refused.value)
    assert needle in " ".join(C.verify(bad)["problems"])


def test_a_later_load_of_a_checked_file_is_not_walked_again_and_still_checks_unread_features(
    many, tmp_path, monkeypatch
):
    path = copy(many, tmp_path)
    C.load_clients(path, "train")
    monkeypatch.setattr(load, "_check_structure", lambda f, p: pytest.fail("checked twice"))
    features = []
    real = load._feature_problems
    monkeypatch.setattr(load, "_feature_problems", lambda name, *a: features.append(name) or real(name, *a))
    again = C.load_clients(path, "test")
    assert again.features.shape[0] == CLIENTS and features == ["test/features/concat"]  # checked on its read
