"""Cache format 4: the writer (`cache.write`) hashes what it writes, every client's rows of a split are one dataset of
each kind (a client's rows found by the split's `offsets`), the features stored once as `concat` with each backbone's
column range, the loader reads them once with their metadata, and format-2 and format-3 caches (a group per client)
are refused in one line or converted by `featcache migrate` with the very same bytes, loading the very same tensors."""

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
from featcache.testing import write_client_groups, write_format2
from tests.synthetic import write_cache

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
        assert json.loads(f.attrs["backbones"]) == list(DIMS) and f.attrs["featcache_format"] == 4
        assert [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in DIMS] == [[0, 96], [96, 256]]
        floats = [name for name, ds in h5.objects(f, h5py.Dataset) if ds.dtype == np.float32]
        assert sorted(floats) == ["test/features/concat", "train/features/concat", "train/views/concat"]
        for split, group in (("train", "features"), ("test", "features"), ("train", "views")):
            stored, at = f[f"{split}/{group}/concat"][...], f[f"{split}/offsets"][...]
            for c in range(3):
                np.testing.assert_array_equal(stored[at[c] : at[c + 1]], np.concatenate(blocks[c, split, group], -1))
        assert "views" not in f["test"]
        assert len(h5.objects(f)) == 21  # 3 for the backbones, 5 groups, 13 datasets: whatever the number of clients


def test_the_number_of_objects_does_not_grow_with_the_clients(tmp_path):
    found = []
    for clients in (3, 40):
        path = write_cache(tmp_path / f"c{clients}.h5", C=clients, n=(2, 5), views=2)
        with h5py.File(path) as f:
            found.append(len(h5.objects(f)))
        assert C.load_clients(path, "train").features.shape[0] == clients
    assert found == [20, 20]


@pytest.mark.parametrize("holdout", ["none", "fit", "val"])
@pytest.mark.parametrize("wanted", [None, ["beta"], ["beta", "alpha"]])
def test_loads_equal_numpy_on_the_stored_concat_first_and_second_time(tmp_path, holdout, wanted):
    path, _ = written(tmp_path / "c.h5", views=2)
    with h5py.File(path) as f:  # what any h5py user computes from the documented schema
        cols = [range(*json.loads(f[f"backbones/{b}"].attrs["columns"])) for b in wanted or DIMS]
        expect, expect_views, labels = [], [], []
        g, at, val_at = f["train"], f["train/offsets"][...], f["train/val_offsets"][...]
        for c in range(len(at) - 1):
            n, val = at[c + 1] - at[c], g["val_index"][val_at[c] : val_at[c + 1]]
            rows = at[c] + {"none": np.arange(n), "val": val, "fit": np.setdiff1d(np.arange(n), val)}[holdout]
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


def write_format3(path: Path, header: dict, backbones: list[dict], clients: list[C.Client]) -> Path:
    """A cache in the format-3 layout (a group per client, `concat` once, checksums bound to their paths), from the
    arguments `featcache.cache.write` takes, written with h5py's high-level calls."""

    def concat_once(g, name: str, blocks) -> None:
        g[f"{name}/concat"] = np.concatenate([np.asarray(x, np.float32) for x in blocks], -1)

    with h5.create_h5(path) as f:
        meta = {"featcache_format": 3, "featcache_version": "0.1.0", "backbones": [b["key"] for b in backbones]}
        h5.write_attrs(f, header | meta)
        start = 0
        for b in backbones:
            columns = [start, start + b["dim"]]
            h5.write_attrs(f.create_group(f"backbones/{b['key']}"), {k: v for k, v in b.items() if k != "key"})
            h5.write_attrs(f[f"backbones/{b['key']}"], {"columns": columns})
            start += b["dim"]
        f.attrs["images"] = write_client_groups(f, header, clients, concat_once)
        h5.seal(f)
    return path


OLDER = {2: lambda path, *args: Path(write_format2(path, *args)), 3: write_format3}


def older_copy(tmp_path: Path, fmt: int, views: int = 0) -> tuple[Path, Path]:
    """(a cache, the cache of the same inputs in the older format `fmt`)."""
    header, backbones, clients, _ = inputs(views)
    new = tmp_path / "new.h5"
    C.write(new, header, backbones, clients)
    old = OLDER[fmt](tmp_path / "old.h5", header, backbones, inputs(views)[2])
    return new, old


def format2_copy(tmp_path: Path, views: int = 0) -> tuple[Path, Path]:
    """(a cache, the format-2 cache of the same inputs)."""
    return older_copy(tmp_path, 2, views)


@pytest.mark.parametrize("fmt", [2, 3])
def test_an_older_cache_is_refused_in_one_line_that_names_migrate(tmp_path, fmt):
    _, old = older_copy(tmp_path, fmt)
    for call in (lambda: C.load_clients(old), lambda: C.info(old)):
        with pytest.raises(UserError) as e:
            call()
        assert (
            "\n" not in str(e.value) and f"has cache format {fmt}" in str(e.value) and "reads format 4" in str(e.value)
        )
        assert f"featcache migrate {old}" in str(e.value)
    assert "featcache migrate" in C.verify(old)["problems"][0]


@pytest.mark.parametrize("fmt,views", [(2, 0), (2, 2), (3, 0), (3, 2)])
def test_migrate_keeps_every_array_bitwise_and_loads_the_same_tensors(tmp_path, fmt, views):
    new, old = older_copy(tmp_path, fmt, views)
    before = old.stat().st_size
    result = run_cli("migrate", str(old), "--json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {
        "path": str(old),
        "from_format": fmt,
        "to_format": 4,
        "bytes_before": before,
        "bytes": old.stat().st_size,
    }
    if fmt == 2:
        assert report["bytes"] < 0.6 * before  # two backbones: format 2 held every feature twice
    with h5py.File(old) as f, h5py.File(new) as g:
        names = sorted(name for name, _ in h5.objects(g, h5py.Dataset))
        assert sorted(name for name, _ in h5.objects(f, h5py.Dataset)) == names
        for name in names:
            assert f[name][...].tobytes() == g[name][...].tobytes(), name
        assert json.loads(f.attrs["migrated_from"]) == {"format": fmt, "featcache": "0.1.0"}
        assert [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in DIMS] == [[0, 96], [96, 256]]
    assert C.verify(old)["ok"] and sorted(p.name for p in tmp_path.iterdir()) == ["new.h5", "old.h5"]
    for split, holdout in (("train", "none"), ("train", "fit"), ("train", "val"), ("test", "none")):
        a, b = (C.load_clients(p, split, holdout=holdout, views=bool(views) and split == "train") for p in (old, new))
        for x, y in ((a.features, b.features), (a.labels, b.labels), (a.counts, b.counts), (a.views, b.views)):
            assert (x is None and y is None) or x.numpy().tobytes() == y.numpy().tobytes()


@pytest.mark.parametrize("fmt", [2, 3])
def test_migrate_refuses_a_damaged_cache_and_changes_nothing(tmp_path, fmt):
    _, old = older_copy(tmp_path, fmt)
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
    new, _ = older_copy(tmp_path, 3)
    with pytest.raises(UserError, match="already cache format 4: nothing to migrate"):
        C.migrate(new)
    with h5py.File(new, "r+") as f:
        f.attrs["featcache_format"] = 1
    with pytest.raises(UserError, match="has cache format 1; `featcache migrate` converts format 2, 3"):
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


def test_an_array_moved_to_another_path_is_refused(tmp_path):
    """Each array's checksum is bound to its path: two arrays of the same shape and dtype swapped (every per-array
    checksum still matches its bytes) fail the metadata checksum."""
    path = write_cache(tmp_path / "swap.h5", C=2, n=(40, 40))
    with h5py.File(path, "r+") as f:
        a, b = "test/labels", "test/source_index"
        assert f[a].shape == f[b].shape and not np.array_equal(f[a][...], f[b][...])
        f.move(a, "tmp"), f.move(b, a), f.move("tmp", b)
    found = C.verify(path)
    assert not found["ok"] and any("metadata checksum" in p for p in found["problems"]), found
    with pytest.raises(UserError, match="failed verification: metadata checksum mismatch"):
        C.load_clients(path, "test")


def test_offsets_that_disagree_with_the_counts_are_refused(tmp_path):
    path = write_cache(tmp_path / "c.h5", C=3, n=(10, 20))
    with h5py.File(path, "r+") as f:
        at = f["train/offsets"][...]
        at[1] += 1
        f["train/offsets"][...] = at
        h5.seal(f)
    found = C.verify(path)
    assert found["problems"] == ["train/offsets: not the running total of the stored counts' train rows"], found
    with pytest.raises(UserError, match="train/offsets: not the running total"):
        C.load_clients(path, "train")
