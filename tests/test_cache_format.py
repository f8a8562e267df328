"""Cache format 3: the writer (`cache.write`) hashes what it writes, the features are stored once as `concat` with
each backbone's column range, the loader reads them once with their metadata, and format-2 caches are refused in one
line or converted by `featcache migrate` with the very same `concat` bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import run_cli

from featcache.cache.identity import content_key, versions
from featcache import cache as C
from featcache.cache import h5
from featcache.errors import UserError
from tests.synthetic import write_cache, write_format2

DIMS = {"alpha": 96, "beta": 160}  # two backbones of different widths


def inputs(views: int = 0, rows=((40, 17), (25, 9), (33, 0))) -> tuple[dict, list[dict], list[C.Client], dict]:
    """(header, backbones, clients, blocks) of a small two-backbone cache; blocks[(c, split, group)] holds each
    backbone's features, the arrays the clients hand to the writer."""
    rng = np.random.default_rng(0)
    blocks, clients, counts = {}, [], []
    for c, (n_train, n_test) in enumerate(rows):
        splits = {}
        for split, n in (("train", n_train), ("test", n_test)):
            for group, lead in (("features", (n,)), ("views", (n, views))):
                blocks[c, split, group] = [rng.standard_normal((*lead, d), dtype=np.float32) for d in DIMS.values()]
            splits[split] = C.Split(
                rng.integers(0, 3, n),
                np.arange(n) * 2,
                blocks[c, split, "features"],
                blocks[c, split, "views"] if views and split == "train" else None,
            )
        val = np.sort(rng.choice(n_train, n_train // 4, replace=False))
        clients.append(C.Client(f"d{c % 2}", splits["train"], splits["test"], val))
        counts.append({"client": c, "domain": f"d{c % 2}", "train": n_train, "val": len(val), "test": n_test})
    manifest = {"dataset": {"name": "fake"}, "views": views, "versions": versions()}
    header = {
        "key": content_key(manifest),
        "manifest": manifest,
        "dataset": "fake",
        "classes": ["a", "b", "c"],
        "domains": ["d0", "d1"],
        "partition": {},
        "counts": {"clients": counts},
        "views": views,
        "versions": manifest["versions"],
    }
    backbones = [
        {"key": k, "name": k, "weights": "random", "weights_sha256": "", "dim": d, "preprocessing": {}}
        for k, d in DIMS.items()
    ]
    return header, backbones, clients, blocks


def written(path: Path, views: int = 0) -> tuple[Path, dict]:
    header, backbones, clients, blocks = inputs(views)
    C.write(path, header, backbones, clients)
    return path, blocks


def test_the_writer_hashes_what_it_writes_without_reading_anything_back(tmp_path, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("the writer read the file back")

    with monkeypatch.context() as m:
        for name in ("__getitem__", "read_direct"):
            m.setattr(h5py.Dataset, name, no_reading)
        m.setattr(h5, "scan", no_reading)
        path, _ = written(tmp_path / "c.h5", views=2)
    assert [p.name for p in tmp_path.iterdir()] == ["c.h5"]  # no partial file left beside it
    with h5py.File(path) as f:
        for _, ds in h5.objects(f, h5py.Dataset):
            assert ds.attrs["sha256"] == hashlib.sha256(np.ascontiguousarray(ds[...]).tobytes()).hexdigest()
    assert C.verify(path)["ok"]


def test_features_are_stored_once_as_concat_with_column_ranges(tmp_path):
    path, blocks = written(tmp_path / "c.h5", views=2)
    with h5py.File(path) as f:
        assert json.loads(f.attrs["backbones"]) == list(DIMS) and f.attrs["featcache_format"] == 3
        assert [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in DIMS] == [[0, 96], [96, 256]]
        floats = [name for name, ds in h5.objects(f, h5py.Dataset) if ds.dtype == np.float32]
        assert all(name.endswith(("/features/concat", "/views/concat")) for name in floats)
        for c in range(3):
            for split, group in (("train", "features"), ("test", "features"), ("train", "views")):
                stored = f[f"clients/{c:03d}/{split}/{group}/concat"][...]
                np.testing.assert_array_equal(stored, np.concatenate(blocks[c, split, group], -1))
        assert "views" not in f["clients/000/test"]


@pytest.mark.parametrize("holdout", ["none", "fit", "val"])
@pytest.mark.parametrize("wanted", [None, ["beta"], ["beta", "alpha"]])
def test_loads_equal_numpy_on_the_stored_concat_first_and_second_time(tmp_path, holdout, wanted):
    path, _ = written(tmp_path / "c.h5", views=2)
    with h5py.File(path) as f:  # what any h5py user computes from the documented schema
        cols = [range(*json.loads(f[f"backbones/{b}"].attrs["columns"])) for b in wanted or DIMS]
        expect, expect_views, labels = [], [], []
        for c in sorted(f["clients"]):
            g = f[f"clients/{c}/train"]
            n, val = len(g["labels"]), g["val_index"][...]
            rows = {"none": np.arange(n), "val": val, "fit": np.setdiff1d(np.arange(n), val)}[holdout]
            take = np.concatenate([np.asarray(r) for r in cols])
            expect.append(g["features/concat"][...][rows][:, take])
            expect_views.append(g["views/concat"][...][rows][..., take])
            labels.append(g["labels"][...][rows])
    for _ in range(2):  # the first load checks the arrays it reads, the second reads only the columns asked for
        got = C.load_clients(path, "train", backbones=wanted, views=True, holdout=holdout)
        assert got.counts.tolist() == [len(y) for y in labels]
        for c, (x, v, y) in enumerate(zip(expect, expect_views, labels)):
            np.testing.assert_array_equal(got.features[c, : len(x)].numpy(), x)
            np.testing.assert_array_equal(got.views[c, : len(v)].numpy(), v)
            np.testing.assert_array_equal(got.labels[c, : len(y)].numpy(), y)
            assert not got.features[c, len(x) :].any() and (got.labels[c, len(y) :] == -1).all()
        assert got.meta["backbones"] == list(DIMS) and got.meta["backbone_info"]["beta"]["dim"] == 160


def format2_copy(tmp_path: Path, views: int = 0) -> tuple[Path, Path]:
    """(a format-3 cache, the format-2 cache of the same inputs)."""
    header, backbones, clients, _ = inputs(views)
    new = tmp_path / "new.h5"
    C.write(new, header, backbones, clients)
    old = Path(write_format2(tmp_path / "old.h5", header, backbones, inputs(views)[2]))
    return new, old


def test_a_format_2_cache_is_refused_in_one_line_that_names_migrate(tmp_path):
    _, old = format2_copy(tmp_path)
    for call in (lambda: C.load_clients(old), lambda: C.info(old)):
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value) and "has cache format 2" in str(e.value) and "reads format 3" in str(e.value)
        assert f"featcache migrate {old}" in str(e.value)
    assert "featcache migrate" in C.verify(old)["problems"][0]


@pytest.mark.parametrize("views", [0, 2])
def test_migrate_keeps_every_array_bitwise_and_halves_the_file(tmp_path, views):
    new, old = format2_copy(tmp_path, views)
    before = old.stat().st_size
    with h5py.File(old) as f:
        arrays = {name: ds[...] for name, ds in h5.objects(f, h5py.Dataset) if not name.endswith(tuple(DIMS))}
    result = run_cli("migrate", str(old), "--json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {
        "path": str(old),
        "from_format": 2,
        "to_format": 3,
        "bytes_before": before,
        "bytes": old.stat().st_size,
    }
    assert report["bytes"] < 0.6 * before  # two backbones: format 2 held every feature twice
    with h5py.File(old) as f, h5py.File(new) as g:
        assert sorted(name for name, _ in h5.objects(f, h5py.Dataset)) == sorted(arrays)
        for name, value in arrays.items():
            assert f[name][...].tobytes() == value.tobytes() == g[name][...].tobytes(), name
        assert json.loads(f.attrs["migrated_from"]) == {"format": 2, "featcache": "0.1.0"}
        assert [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in DIMS] == [[0, 96], [96, 256]]
    assert C.verify(old)["ok"] and sorted(p.name for p in tmp_path.iterdir()) == ["new.h5", "old.h5"]
    np.testing.assert_array_equal(C.load_clients(old, "test").features, C.load_clients(new, "test").features)


def test_migrate_refuses_a_damaged_cache_and_changes_nothing(tmp_path):
    _, old = format2_copy(tmp_path)
    with h5py.File(old, "r+") as f:  # one bit of the stored concat flipped after sealing
        ds = f["clients/001/train/features/concat"]
        row = ds[3]
        row.view(np.uint32)[5] ^= 1 << 20
        ds[3] = row
    damaged = old.read_bytes()
    with pytest.raises(UserError, match=r"clients/001/train/features/concat: sha256 mismatch\), nothing was changed"):
        C.migrate(old)
    assert old.read_bytes() == damaged and sorted(p.name for p in tmp_path.iterdir()) == ["new.h5", "old.h5"]


def test_migrate_refuses_the_current_format_and_unknown_ones(tmp_path):
    new, _ = format2_copy(tmp_path)
    with pytest.raises(UserError, match="already cache format 3: nothing to migrate"):
        C.migrate(new)
    with h5py.File(new, "r+") as f:
        f.attrs["featcache_format"] = 1
    with pytest.raises(UserError, match="has cache format 1; `featcache migrate` converts format 2"):
        C.migrate(new)
    with pytest.raises(UserError, match="does not exist"):
        C.migrate(tmp_path / "none.h5")


def test_write_never_replaces_a_file_and_leaves_nothing_when_it_fails(tmp_path):
    path, _ = written(tmp_path / "c.h5")
    mine = path.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        written(path)
    assert path.read_bytes() == mine

    header, backbones, clients, _ = inputs()

    def broken():
        yield clients[0]
        raise RuntimeError("the second client's blocks are gone")

    with pytest.raises(RuntimeError, match="blocks are gone"):
        C.write(tmp_path / "d.h5", header, backbones, broken())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


def test_an_array_moved_to_another_client_is_refused(tmp_path):
    """Each array's checksum is bound to its path: two clients' features of the same shape swapped (every per-array
    checksum still matches its bytes) fail the metadata checksum."""
    path = write_cache(tmp_path / "swap.h5", C=2, n=(40, 40))
    with h5py.File(path, "r+") as f:
        a, b = "clients/000/test/features/concat", "clients/001/test/features/concat"
        assert f[a].shape == f[b].shape and not np.array_equal(f[a][...], f[b][...])
        f.move(a, "tmp"), f.move(b, a), f.move("tmp", b)
    found = C.verify(path)
    assert not found["ok"] and any("metadata checksum" in p for p in found["problems"]), found
    with pytest.raises(UserError, match="failed verification: metadata checksum mismatch"):
        C.load_clients(path, "test")
