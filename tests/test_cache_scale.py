"""Caches of many clients: the one-walk metadata checksum (`h5.walk`) equals the object-by-object definition on every
kind of attribute, the writer's checksum (kept as it writes) equals the file's, the same inputs give the same bytes,
and a load of many clients returns what plain h5py reads and refuses a change at any client. Speed is
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
from tests.synthetic import write_cache, write_format2
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
            f["clients/007/train/labels"].attrs[name] = value
            f["clients/007"].attrs[name] = value
        f.create_group("extra/deep")  # groups without attributes, never opened by the walk
    with h5py.File(path) as f:
        nodes = h5.walk(f)
        for where in ("clients/007/train/labels", "clients/007"):
            expected = dict(f[where].attrs.items())
            assert nodes[where].attrs.keys() == expected.keys()
            for name, value in expected.items():
                got = nodes[where].attrs[name]
                assert type(got) is type(value) and np.array_equal(got, value), name
        assert h5.meta_sha256(f, nodes=nodes) == reference_meta_sha256(f)


def test_an_empty_attribute_is_unreadable_as_before(many, tmp_path):
    path = copy(many, tmp_path)
    with h5py.File(path, "r+") as f:
        f["clients/003"].attrs["empty"] = h5py.Empty("f4")
    with h5py.File(path) as f:
        with pytest.raises(TypeError):
            reference_meta_sha256(f)
        with pytest.raises(TypeError):
            h5.meta_sha256(f)
    assert C.verify(path)["problems"][0].startswith("unreadable (TypeError")


def high_level_write(path: Path, header: dict, backbones: list[dict], clients: list[C.Client]) -> None:
    """The schema written with h5py's high-level calls, object by object, its checksum read back from the file."""
    from featcache import __version__
    from featcache.cache.write import FORMAT, INDEX_DTYPES, MARKER, SPLITS

    def array(g, name, data):
        data = np.ascontiguousarray(data)
        g.create_dataset(name, data=data, track_times=False).attrs["sha256"] = hashlib.sha256(data).hexdigest()

    with h5.create_h5(path) as f:
        h5.write_attrs(
            f, header | {MARKER: FORMAT, "featcache_version": __version__, "backbones": [b["key"] for b in backbones]}
        )
        start = 0
        for b in backbones:
            attrs = {k: v for k, v in b.items() if k != "key"} | {"columns": [start, start + b["dim"]]}
            h5.write_attrs(f.create_group(f"backbones/{b['key']}"), attrs)
            start += b["dim"]
        images = 0
        for c, client in enumerate(clients):
            g = f.create_group(f"clients/{c:03d}")
            g.attrs["domain"] = client.domain
            for split in SPLITS:
                s = getattr(client, split)
                index = {"labels": s.labels, "source_index": s.source_index}
                index["domain"] = np.full(len(s.labels), header["domains"].index(client.domain))
                for name, dtype in INDEX_DTYPES.items():
                    array(g, f"{split}/{name}", np.asarray(index[name], dtype))
                array(g, f"{split}/features/concat", np.concatenate([np.asarray(x, "<f4") for x in s.features], -1))
                images += len(s.labels)
            array(g, "train/val_index", np.asarray(client.val_index, np.int64))
        f.attrs["images"] = images
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
        for c in sorted(f["clients"]):
            g = f[f"clients/{c}/train"]
            n, val = len(g["labels"]), g["val_index"][...]
            rows = {"none": np.arange(n), "val": val, "fit": np.setdiff1d(np.arange(n), val)}[holdout]
            expect.append((g["features/concat"][...][rows], g["labels"][...][rows]))
    for _ in range(2):
        got = C.load_clients(path, "train", holdout=holdout)
        assert got.counts.tolist() == [len(y) for _, y in expect]
        for c, (x, y) in enumerate(expect):
            np.testing.assert_array_equal(got.features[c, : len(x)].numpy(), x)
            np.testing.assert_array_equal(got.labels[c, : len(y)].numpy(), y)
    test = C.load_clients(path, "test")  # the other split's features, checked on their first read
    assert test.counts.tolist() == [row["test"] for row in got.meta["counts"]["clients"]]


def swap_features(f: h5py.File) -> None:
    a, b = f["clients/012/test/features/concat"], f["clients/030/test/features/concat"]
    n = min(len(a), len(b))
    rows = a[:n].copy()
    a[:n], b[:n] = b[:n], rows


def flip_late_label(f: h5py.File) -> None:
    labels = f[f"clients/{CLIENTS - 1:03d}/test/labels"]
    labels[0] = (labels[0] + 1) % 3


def rename_late_client(f: h5py.File) -> None:
    f.move(f"clients/{CLIENTS - 1:03d}", f"clients/{CLIENTS:03d}")


# name -> (edit, reseal, what the one line says)
LATE_CHANGES = {
    "features-swapped": (swap_features, False, "sha256 mismatch"),
    "label-flipped": (flip_late_label, False, f"clients/{CLIENTS - 1:03d}/test/labels: sha256 mismatch"),
    "client-renamed": (rename_late_client, True, f"clients/{CLIENTS - 1:03d}/test/domain: missing"),
    "client-attribute": (lambda f: f["clients/031"].attrs.__setitem__("domain", "other"), False, "metadata checksum"),
}


@pytest.mark.parametrize("case", LATE_CHANGES.values(), ids=LATE_CHANGES.keys())
def test_a_change_at_any_client_is_refused_by_the_first_load_and_verify(many, tmp_path, case):
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
    assert again.features.shape[0] == CLIENTS and len(features) == CLIENTS  # each test array checked on its read
