"""The embedding store (`featcache/extraction/store.py`): each backbone embeds an image once, however often the images
are re-partitioned. A new partition embeds nothing and builds no backbone, a larger `per_class` embeds exactly the new
images, a cache gathered through a store is the cache an empty store gives byte for byte, sweeps write one cache per
setting from one pass, stores are shared between --out folders, and `featcache info` / `featcache gc` show and prune
a store folder; a damaged store is one line.

Image folders, two tiny random-weight timm models (`harness.BACKBONES`), 32 px, chunks of 4 images, one torch thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from harness import BACKBONES, damage_store, Result, everything_in, folder_extract_args, one_line_error, run_cli, sha256

from featcache import cache as C
from featcache.cache import h5
from featcache.errors import UserError
from featcache.extraction import embed
from featcache.extraction.datasets.base import PathImages
from featcache.extraction.plan import extract
from featcache.extraction.stores import info as store_info
from featcache.extraction.store import rows_folder

REPO = Path(__file__).resolve().parent.parent
SPLITS = ("train", "test")


pytestmark = pytest.mark.usefixtures("single_thread")


def run(images: Path, out: Path, **options) -> dict:
    args = dict(dataset="imagefolder", data_root=images, backbone=BACKBONES, image_size=32, batch_size=4, out=out)
    return extract(**(args | options))


def no_backbone_built(monkeypatch) -> None:
    """From here on, building a backbone fails the test: whatever this extraction needs must come from the stores."""

    def refuse(*a, **k):
        raise AssertionError("a backbone was built: the store should have held every image")

    monkeypatch.setattr(embed, "build", refuse)


def held(cache: str | Path) -> set[tuple[str, str, int]]:
    """The (domain, split, source index) of every image a cache holds."""
    with h5py.File(cache, "r") as f:
        domains = json.loads(f.attrs["domains"])
        return {
            (domains[d], split, int(i))
            for split in SPLITS
            for d, i in zip(f[f"{split}/domain"][...], f[f"{split}/source_index"][...])
        }


def stores(out: Path) -> list[Path]:
    return sorted((out / "store").glob("*.h5"))


def files(folder: Path) -> dict[str, str]:
    """Every file below `folder` (hidden ones too) with its sha256, but the sidecar of the images' hashes (it records
    their inodes and times)."""
    return {p: sha256(folder / p) for p in everything_in(folder) if (folder / p).is_file() and ".contents-" not in p}


def warned_random(result: Result) -> Result:
    """The result less the warning lines of random-weight backbones (`harness.BACKBONES` are random; Python shows
    each warning once per process)."""
    kept = [line for line in result.stderr.splitlines() if "has RANDOM weights" not in line]
    return Result(result.code, result.stdout, "\n".join(kept))


def valid(cache: str | Path) -> bool:
    report = C.verify(cache)
    assert report["ok"], report["problems"]
    return True


def test_a_new_partition_embeds_nothing_and_builds_no_backbone(images, tmp_path, monkeypatch):
    first = run(images, tmp_path)  # feature partition over d1 and d2: every image
    assert not first["cache_hit"] and len(first["embedded"]) == 2
    assert all(n == first["images"] for n in first["embedded"].values()), first["embedded"]
    nothing = dict.fromkeys(first["embedded"], 0)
    no_backbone_built(monkeypatch)
    caches = {first["cache"]}
    for options in (
        dict(partition="label", clients=2, alpha=0.5, domains=["d1"]),
        dict(partition="label", clients=2, alpha=1.0, domains=["d1"]),
        dict(partition="label", clients=3, alpha=1.0, domains=["d1"]),
        dict(partition="iid", clients=2, domains=["d2"]),
        dict(val_fraction=0.5),
        dict(seed=1),
    ):
        again = run(images, tmp_path, **options)
        assert not again["cache_hit"] and again["embedded"] == nothing, (options, again["embedded"])
        assert again["cache"] not in caches, options  # a different cache ...
        caches.add(again["cache"])
        assert valid(again["cache"])  # ... and a valid one
        with h5py.File(again["cache"], "r") as f:
            assert C.read_attrs(f)["partition"]["scheme"] == options.get("partition", "feature")
    assert len(stores(tmp_path)) == 2  # still one store per backbone


# `featcache ARGS` in a fresh interpreter that, on exit, writes which of timm and torchvision it imported to stderr.
IMPORTED = (
    "import atexit, runpy, sys; atexit.register(lambda: print('IMPORTED', sorted({m.split('.')[0] for m in "
    "sys.modules} & {'timm', 'torchvision'}), file=sys.stderr)); sys.argv = ['featcache', *sys.argv[1:]]; "
    "runpy.run_module('featcache.cli', run_name='__main__')"
)


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--partition", "label", "--clients", "2", "--alpha", "0.5"],
        ["--partition", "iid", "--clients", "2,3", "--seed", "1"],
    ],
    ids=["cache-hit", "re-partition", "sweep"],
)
def test_no_backbone_built_imports_neither_timm_nor_torchvision(images, tmp_path, options):
    """A cache hit, a re-partition and a sweep through filled stores build no model, so they import neither timm
    nor torchvision (seconds of a command that otherwise takes about two)."""
    run(images, tmp_path)  # fills both stores (feature partition: every image)
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED, *folder_extract_args(images, tmp_path, *options)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for r in result.get("caches", [result]):
        assert r["cache_hit"] == (not options) and valid(r["cache"]), r
    assert set(result["embedded"].values()) <= {0}, result["embedded"]
    assert done.stderr.strip().splitlines()[-1] == "IMPORTED []", done.stderr


def test_a_larger_per_class_embeds_exactly_the_new_images(images, tmp_path):
    small = run(images, tmp_path, per_class=2)
    large = run(images, tmp_path, per_class=4)
    before, after = held(small["cache"]), held(large["cache"])
    new = after - before
    assert 0 < len(new) < len(after) and all(n == len(before) for n in small["embedded"].values())
    assert large["embedded"] == dict.fromkeys(small["embedded"], len(new))
    between = run(images, tmp_path, per_class=3)  # (its images are among per_class=4's: nothing new)
    third = held(between["cache"]) - before - after
    assert between["embedded"] == dict.fromkeys(small["embedded"], len(third))
    for store in store_info(tmp_path / "store")["stores"]:
        assert store["images"] == len(before | after | third)


def test_a_cache_through_a_filled_store_equals_the_cache_from_an_empty_store(images, tmp_path):
    """The store already holds images two other partitions needed, and the new command embeds only the missing ones:
    its cache is still the one an empty store gives, byte for byte (`tests/test_embedding_identity.py` explores why)."""
    shared = tmp_path / "shared"
    run(images, shared, partition="label", clients=2, domains=["d1"], per_class=3)
    run(images, shared, partition="iid", clients=2, domains=["d2"], per_class=2, seed=5)
    through = run(images, shared, per_class=4)
    assert all(0 < n < through["images"] for n in through["embedded"].values()), through["embedded"]
    fresh = run(images, tmp_path / "fresh", per_class=4)
    assert all(n == fresh["images"] for n in fresh["embedded"].values())
    assert Path(through["cache"]).name == Path(fresh["cache"]).name
    assert sha256(through["cache"]) == sha256(fresh["cache"])


def test_the_same_command_in_fresh_folders_gives_identical_caches_and_stores(images, tmp_path):
    a = run(images, tmp_path / "a", partition="label", clients=2, domains=["d1"])
    run(images, tmp_path / "b", partition="label", clients=2, domains=["d1"])
    layout = sorted(
        [
            Path(a["cache"]).name,
            "store",
            *(f"store/{p.name}{end}" for p in stores(tmp_path / "a") for end in ("", ".rows", ".rows/featcache.json")),
            *(f"store/{p.name}.rows/000001.h5" for p in stores(tmp_path / "a")),  # one fill: one segment
            *(f"store/{p.name}" for p in (tmp_path / "a" / "store").glob(".contents-*.json")),
        ]
    )
    assert everything_in(tmp_path / "a") == layout and len(stores(tmp_path / "a")) == 2  # no parts folder left
    assert files(tmp_path / "a") == files(tmp_path / "b")


def test_a_sweep_writes_each_settings_cache_from_one_pass(images, tmp_path, monkeypatch):
    decoded = []
    original = PathImages.image
    monkeypatch.setattr(PathImages, "image", lambda self, i: decoded.append((id(self), i)) or original(self, i))
    # per_class cuts each class pool to per_class * clients images: the 3-client caches hold images the 2-client
    # ones do not.
    label = dict(partition="label", domains=["d1"], per_class=1, workers=0)
    sweep = run(images, tmp_path / "sweep", alpha=[0.5, 1.0], clients=[2, 3], **label)
    caches = sweep["caches"]
    assert len(caches) == 4 and len({c["cache"] for c in caches}) == 4 and not sweep["cache_hit"]
    images_of = [held(c["cache"]) for c in caches]
    union = set().union(*images_of)
    assert all(len(one) < len(union) for one in images_of[:2])  # the union is more than a 2-client cache's images
    assert len(decoded) == len(set(decoded)) == len(union)  # each image decoded once for both backbones
    assert sweep["embedded"] == dict.fromkeys(caches[0]["backbones"], len(union))
    settings = [(c, a) for c in (2, 3) for a in (0.5, 1.0)]  # the sweep's order: clients, then alpha
    for (clients, alpha), swept in zip(settings, caches):
        single = run(images, tmp_path / f"c{clients}-a{alpha}", alpha=alpha, clients=clients, **label)
        assert "caches" not in single and Path(single["cache"]).name == Path(swept["cache"]).name
        assert sha256(single["cache"]) == sha256(swept["cache"]), (clients, alpha)
        with h5py.File(swept["cache"], "r") as f:
            partition = C.read_attrs(f)["partition"]
            assert (partition["clients"], partition["alpha"]) == (clients, alpha)
    again = run(images, tmp_path / "sweep", alpha=[0.5, 1.0], clients=[2, 3], **label)
    assert again["cache_hit"] and [c["cache"] for c in again["caches"]] == [c["cache"] for c in caches]


def test_a_shared_store_folder_outside_out_serves_two_outs(images, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    a = run(images, tmp_path / "a", store=shared)
    assert all(n == a["images"] for n in a["embedded"].values())
    assert everything_in(tmp_path / "a") == [Path(a["cache"]).name]  # no store folder in --out
    assert len(list(shared.glob("*.h5"))) == 2 and len(list(shared.glob(".contents-*.json"))) == 1
    made = [*shared.glob("*.h5"), *shared.glob("*.h5.rows"), *shared.glob("*.h5.rows/*"), *shared.glob(".contents-*")]
    assert everything_in(shared) == sorted(str(p.relative_to(shared)) for p in made)  # no parts folder left
    no_backbone_built(monkeypatch)
    b = run(images, tmp_path / "b", store=shared)
    assert b["embedded"] == dict.fromkeys(a["embedded"], 0) and not b["cache_hit"]
    assert sha256(a["cache"]) == sha256(b["cache"]) and everything_in(tmp_path / "b") == [Path(b["cache"]).name]


def test_a_failed_first_run_leaves_no_store_folder(images, tmp_path):
    """Bad input found while embedding (a damaged image): neither --out nor a --store folder it created is left, nor
    the parents of either that it created."""
    import shutil

    root = shutil.copytree(images, tmp_path / "images")
    (root / "d2" / "b" / "img_001.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    for out, store in (
        (tmp_path / "out", []),
        (tmp_path / "out", ["--store", str(tmp_path / "shared")]),
        (tmp_path / "o" / "deep" / "out", ["--store", str(tmp_path / "s" / "deep" / "store")]),
    ):
        result = run_cli(*folder_extract_args(root, out, *store))
        one_line_error(warned_random(result), "cannot read image")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["images"], store


# -- featcache info, featcache gc, a damaged store ---------------------------------------------------------------


@pytest.fixture
def filled(images, tmp_path) -> tuple[Path, dict]:
    out = tmp_path / "out"
    res = run_cli(*folder_extract_args(images, out, "--partition", "iid", "--domains", "d1", "--clients", "2"))
    assert res.code == 0, res.stderr
    return out, json.loads(res.stdout)


def store_bytes(store: Path) -> int:
    return os.path.getsize(store) + sum(os.path.getsize(p) for p in rows_folder(store).iterdir())


def test_info_lists_each_store_with_its_images_per_domain_and_split(filled):
    out, res = filled
    expected: dict[str, int] = {}
    for domain, split, _ in held(res["cache"]):
        expected[f"{domain}/{split}/features"] = expected.get(f"{domain}/{split}/features", 0) + 1
    shown = run_cli("info", str(out / "store"), "--json")
    assert shown.code == 0, shown.stderr
    folder = json.loads(shown.stdout)
    assert [s["file"] for s in folder["stores"]] == [str(p) for p in stores(out)]
    assert sorted(s["backbone"] for s in folder["stores"]) == sorted(res["backbones"])
    for s in folder["stores"]:
        assert s["held"] == expected and s["images"] == res["images"] and s["dim"] > 0 and s["views"] == 0
        assert s["bytes"] == store_bytes(Path(s["file"]))
    assert folder["bytes"] == sum(store_bytes(p) for p in stores(out))
    one = run_cli("info", str(stores(out)[0]), "--json")
    assert one.code == 0 and json.loads(one.stdout)["stores"] == folder["stores"][:1]
    for target in (out / "store", stores(out)[0]):
        table = run_cli("info", str(target))
        assert table.code == 0, table.stderr
        text = " ".join(table.stdout.split())
        shown = folder["stores"] if target == out / "store" else folder["stores"][:1]
        for s in shown:
            assert s["backbone"] in text and str(s["images"]) in text and f"{s['bytes'] / 2**20:.1f}" in text
            for name, n in s["held"].items():
                assert name in text and f"{name} {n}" in text
        assert all(s["backbone"] not in text for s in folder["stores"] if s not in shown)


def test_gc_keeps_good_stores_and_moves_a_damaged_one_aside(filled):
    out, _ = filled
    good, bad = stores(out)
    damage_store(bad)
    before = files(out)
    dry = run_cli("gc", str(out / "store"), "--dry-run", "--json")
    assert dry.code == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] and [k["file"] for k in report["kept"]] == [str(good)] and report["removed"] == []
    (moved,) = report["quarantined"]
    quarantined = out / "store" / ".quarantine" / bad.name
    assert moved["file"] == str(bad) and moved["to"] == str(quarantined) and "crc32" in moved["reason"]
    assert files(out) == before  # a dry run changes nothing
    table = run_cli("gc", str(out / "store"), "--dry-run")
    assert table.code == 0 and "would move aside" in table.stdout and files(out) == before
    done = run_cli("gc", str(out / "store"), "--json")
    assert done.code == 0, done.stderr
    assert json.loads(done.stdout)["quarantined"][0]["to"] == str(quarantined)
    assert stores(out) == [good] and sha256(good) == before[f"store/{good.name}"]
    assert sha256(quarantined) == before[f"store/{bad.name}"]  # moved aside, not a byte changed
    again = json.loads(run_cli("gc", str(out / "store"), "--json").stdout)
    assert again["removed"] == again["quarantined"] == [] and [k["file"] for k in again["kept"]] == [str(good)]
    gone = json.loads(run_cli("gc", str(out / "store"), "--remove-damaged", "--json").stdout)
    assert [r["file"] for r in gone["removed"]] == [str(quarantined)] and "earlier gc" in gone["removed"][0]["reason"]
    assert not (out / "store" / ".quarantine").exists() and stores(out) == [good]  # the emptied folder is gone too


def test_extract_through_a_damaged_store_is_one_line_and_writes_nothing(images, filled):
    out, _ = filled
    bad = stores(out)[1]
    damage_store(bad)
    before = files(out)
    sidecars = [p for p in everything_in(out) if ".contents-" in p]  # the images' hashes, from the first fill
    result = run_cli(*folder_extract_args(images, out, "--partition", "iid", "--domains", "d1", "--clients", "3"))
    line = one_line_error(result, "is damaged")
    assert f"store {bad} is damaged" in line and "featcache gc" in line
    folders = ["store", *(f"store/{p.name}" for p in (out / "store").glob("*.rows"))]
    assert files(out) == before and everything_in(out) == sorted([*before, *sidecars, *folders])  # no parts, no cache


# -- the command line ---------------------------------------------------------------------------------------------


def test_a_sweep_value_that_is_no_number_is_one_line(images, tmp_path):
    out = tmp_path / "out"
    one_line_error(run_cli(*folder_extract_args(images, out, "--alpha", "0.1,x")), "--alpha")
    one_line_error(run_cli(*folder_extract_args(images, out, "--clients", "2,three")), "--clients")
    assert everything_in(out) == []


def test_a_clients_list_prints_a_row_per_cache(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short --out: the table cuts cells wider than its 120 columns off a terminal
    out = Path("out")
    args = [
        a
        for a in folder_extract_args(images, out, "--partition", "iid", "--domains", "d1", "--clients", "2,3")
        if a != "--json"
    ]
    shown = run_cli(*args)
    assert shown.code == 0, shown.stderr
    caches = sorted(p.name for p in out.glob("*.h5"))
    assert len(caches) == 2 and shown.stdout.count("(written,") == 2
    rows = [line for line in shown.stdout.splitlines() if "(written," in line]
    assert sorted(name for name in caches for row in rows if name in row) == caches  # a row per cache
    again = run_cli(*args)
    assert again.stdout.count("(hit,") == 2 and "nothing" in again.stdout


def test_the_same_weights_spelled_twice_share_one_store_without_deadlock(images, tmp_path):
    out = tmp_path / "out"
    args = [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(images),
        "--backbone",
        "test_efficientnet=random",
        "--backbone",
        "test_efficientnet= random",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--domains",
        "d1",
        "--partition",
        "iid",
        "--clients",
        "2",
        "--out",
        str(out),
        "--json",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "featcache.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert len(res["backbones"]) == 2 and res["backbones"][1] == res["backbones"][0] + "-2"
    (store,) = stores(out)
    assert store_info(store)["stores"][0]["images"] == res["images"]
    with h5py.File(res["cache"], "r") as f:
        (a, b), (c, d) = [json.loads(f[f"backbones/{k}"].attrs["columns"]) for k in res["backbones"]]
        x = C.client_rows(f, "train", 0)
        np.testing.assert_array_equal(x[:, a:b], x[:, c:d])  # the same weights: the same rows, read twice


def test_the_code_memo_gives_the_hash_of_the_files_as_they_are(tmp_path, monkeypatch):
    """The store and cache keys' code digests are remembered across processes by each file's stat: a rewrite of the
    same size with a new mtime, or of a new size with the old mtime, is hashed again; a damaged memo, or a cache
    folder that cannot be written, only costs a hashing; a file changed in the last RACY_NS is never remembered."""
    from featcache.cache import identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(identity, "RACY_NS", 0)  # a file written here is trusted at once (its ctime is now)
    memo = identity.memo_path()
    code = tmp_path / "code"
    code.mkdir()
    past = os.stat(tmp_path).st_mtime_ns - 60 * 10**9

    def write(name: str, text: str, mtime_ns: int) -> None:
        (code / name).write_text(text)
        os.utime(code / name, ns=(mtime_ns, mtime_ns))

    def key() -> str:
        return identity.code_identity(("*.py",), code)["sha256"]

    def hashed() -> str:  # what hashing every file gives
        with monkeypatch.context() as m:
            m.setattr(identity, "memo_path", lambda: None)
            return key()

    write("a.py", "X = 1\n", past)
    write("b.py", "Y = 1\n", past)
    first = key()
    assert memo.is_file() and len(json.loads(memo.read_text())["files"]) == 2
    with monkeypatch.context() as m:  # the memo answers: nothing is parsed
        m.setattr(identity, "_syntax_sha256", lambda source: pytest.fail("hashed although remembered"))
        assert key() == first

    def hashed_late() -> None:  # as if everything were hashed after the edits below: only the stats tell them
        late = json.loads(memo.read_text())
        late["files"] = {k: [*e[:6], e[6] + 10**12] for k, e in late["files"].items()}
        memo.write_text(json.dumps(late))

    hashed_late()
    write("a.py", "X = 2\n", past + 10**9)  # the same size, a new mtime
    assert key() == hashed() != first
    second = key()
    hashed_late()
    write("a.py", "X = 23\n", past + 10**9)  # a new size, the same mtime
    assert key() == hashed() != second

    st = os.stat(code / "a.py")  # each field on its own (a write above changes the ctime too)
    entry = [*identity._signature(st), "0" * 64, st.st_ctime_ns + 10**12]
    assert identity._valid(entry, st)
    for field, change in (("st_size", 1), ("st_mtime_ns", 1), ("st_ctime_ns", 1), ("st_ino", 1), ("st_dev", 1)):
        other = types.SimpleNamespace(
            **{k: getattr(st, k) for k in ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino", "st_dev")}
        )
        setattr(other, field, getattr(st, field) + change)
        assert not identity._valid(entry, other), field

    for damaged in (b"{not json", b'{"stamp": 1}', json.dumps({"files": {"x": [1]}}).encode(), b"\0" * 64):
        memo.write_bytes(damaged)
        assert key() == hashed()
    stamp = json.loads(memo.read_text())["stamp"]
    entry = [*identity._signature(os.stat(code / "a.py")), "0" * 63 + "z", 0]
    memo.write_text(json.dumps({"stamp": stamp, "files": {f"syntax:{code / 'a.py'}": entry}}))  # a malformed entry
    assert key() == hashed()

    monkeypatch.setattr(identity, "RACY_NS", 2 * 10**9)
    (code / "c.py").write_text("Z = 1\n")  # changed just now: hashed, not remembered
    assert key() == hashed() and f"syntax:{code / 'c.py'}" not in json.loads(memo.read_text())["files"]

    monkeypatch.setattr(identity, "RACY_NS", 0)
    weights = tmp_path / "weights.pth"  # a weight file's sha256, remembered the same way
    weights.write_bytes(b"w" * 100)
    assert identity.file_sha256(weights) == hashlib.sha256(b"w" * 100).hexdigest()
    with monkeypatch.context() as m:
        m.setattr(identity, "_bytes_sha256", lambda path: pytest.fail("hashed although remembered"))
        assert identity.file_sha256(weights) == hashlib.sha256(b"w" * 100).hexdigest()
    hashed_late()
    weights.write_bytes(b"v" * 100)
    assert identity.file_sha256(weights) == hashlib.sha256(b"v" * 100).hexdigest()
    with pytest.raises(FileNotFoundError):
        identity.file_sha256(tmp_path / "missing.pth")

    monkeypatch.setenv("XDG_CACHE_HOME", str(code / "a.py" / "cache"))  # no folder can be made there
    assert key() == hashed()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: the XDG default
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert identity.memo_path().parent == tmp_path / "home" / ".cache" / "featcache"


def test_a_saved_dataset_reads_its_images_only_when_asked_for(tmp_path):
    """A built-in dataset saved beside the caches is loaded by its labels (a re-partition through filled stores needs
    no pixels); its images, read at first use, are the saved ones; damaged, they are one line and the file is gone
    (the next run builds the dataset again)."""
    from featcache.extraction.datasets import Dataset, keep_dataset, list_datasets, load_dataset
    from featcache.extraction.datasets.base import ArrayImages

    list_datasets()  # the readers registered: offline-digits is a recipe, saved by keep_dataset
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 255, (n, 8, 8), dtype=np.uint8) for s, n in (("train", 6), ("test", 4))}
    labels = {s: np.arange(len(x)) % 2 for s, x in images.items()}
    data = Dataset("offline-digits", ["0", "1"], {"mnist": {s: ArrayImages(images[s], labels[s]) for s in images}})
    keep_dataset(data, tmp_path, size=8)
    (saved,) = tmp_path.glob(".offline-digits-*.npz")

    loaded = load_dataset("offline-digits", store=tmp_path, size=8)
    splits = loaded.domains["mnist"]
    assert all(s._images is None for s in splits.values())  # the labels alone were read
    assert all(np.array_equal(splits[s].labels, labels[s]) for s in images)
    assert np.array_equal(splits["train"].batch(np.array([1, 3])), np.repeat(images["train"][[1, 3], ..., None], 3, -1))
    assert np.array_equal(splits["test"].images, images["test"])

    damaged = load_dataset("offline-digits", store=tmp_path, size=8)
    saved.write_bytes(saved.read_bytes()[:-200])  # truncated after it was loaded
    with pytest.raises(UserError, match="damaged .* is removed: run the same command again"):
        damaged.domains["mnist"]["test"].batch(np.array([0]))
    assert not saved.exists()


def test_writers_of_one_file_at_once_each_finish(tmp_path):
    """Two tasks of one fill (Ray's, on one store) that both found no metadata file both write it: each through a
    temporary of its own, so both renames succeed and the file is one writer's, complete; nothing else is left."""
    from featcache.files import synced

    path = tmp_path / "meta.json"
    with synced(path) as first, synced(path) as second:
        first.write(b'{"by": 1}')
        second.write(b'{"by": 2}')
    assert json.loads(path.read_bytes()) in ({"by": 1}, {"by": 2})
    assert list(tmp_path.iterdir()) == [path]


# -- the store at scale: append-only segments ---------------------------------------------------------------------


@pytest.mark.slow
def test_store_scale_bench_kills_verify_and_resume_to_the_same_bytes():
    """bench/store_scale.py at a small size, its segment written in 16 slices: each kill point (inside the segment,
    before and after the store file's rename) leaves a store that verifies, and the resumed fill ends with the bytes
    of an undisturbed one."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "store_scale.py"
    args = ["--rows", "3000", "--small", "300", "--add", "100", "--repeats", "1"]
    done = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [k["point"] for k in out["kill"]] == ["mid-segment", "before-store-rename", "after-store-rename"]
    for k in out["kill"]:
        assert k["killed_by"] == 9 and k["verified_after_kill"] and k["same_bytes_as_undisturbed"], k
    assert {"fill_ratio", "gather_ratio", "peak_rss_mb", "load_1min"} <= set(out)


def format1_store(path: Path, key: str, identity: dict, backbone: dict, needs: dict) -> None:
    """A store file as format 1 wrote one: every need's index and rows inside it, each array with its sha256."""
    with h5.written(path, path.with_name(path.name + ".partial")) as f:
        h5.write_attrs(
            f,
            {
                "featcache_store": 1,
                "featcache_version": "0.1.0",
                "key": key,
                "identity": identity,
                "backbone": backbone,
                "views": 0,
                "sources": [],
                "images": sum(len(i) for i, _ in needs.values()),
            },
        )
        for (domain, split, _), (index, rows) in sorted(needs.items()):
            g = f.require_group(f"{domain}/{split}/features")
            h5.write_array(g, "index", index)
            h5.write_array(g, "rows", rows)
        f.attrs["meta_sha256"] = h5.meta_sha256(f)


def test_a_format_1_store_is_read_as_it_is_and_its_next_fill_moves_it_into_segments(tmp_path):
    from featcache.cache.identity import content_key
    from featcache.extraction.store import Store, crc32_rows
    from featcache.extraction.stores import verify
    from featcache.files import locked, npy_file

    identity, backbone = {"dataset": "made-up"}, {"key": "bb", "name": "bb", "dim": 6}
    key, rng = content_key(identity), np.random.default_rng(0)
    path = tmp_path / f"made.bb.{key[:16]}.h5"
    old = {("d1", "train", 0): (np.arange(0, 40, 2), rng.random((20, 6), np.float32))}
    old[("d1", "test", 0)] = (np.arange(5), rng.random((5, 6), np.float32))
    format1_store(path, key, identity, backbone, old)
    store = Store(path, key)
    assert verify(path)["ok"] and store.needs() == {need: len(i) for need, (i, _) in old.items()}
    assert np.array_equal(
        store.gather(("d1", "train", 0), np.array([38, 0, 4])), old[("d1", "train", 0)][1][[19, 0, 2]]
    )
    new = rng.random((3, 6), np.float32)
    with locked(store.work):
        (block,) = store.plan([(("d1", "train", 0), np.array([1, 3, 99]))])
        with npy_file(block, new.shape) as fh:
            fh.write(new.tobytes())
        assert store.commit(identity) == 3
    moved = Store(path, key)
    assert h5.plain(h5py.File(path, "r").attrs["featcache_store"]) == 2 and verify(path)["ok"]
    assert [s["file"] for s in moved.meta()["segments"]] == ["000001.h5", "000002.h5"]  # the old rows, then the fill
    got = moved.gather(("d1", "train", 0), np.array([99, 0, 1, 38, 3]))
    assert np.array_equal(
        got, np.stack([new[2], old[("d1", "train", 0)][1][0], new[0], old[("d1", "train", 0)][1][19], new[1]])
    )
    assert np.array_equal(moved.gather(("d1", "test", 0), np.arange(5)), old[("d1", "test", 0)][1])
    assert moved.meta()["images"] == 28 and len(crc32_rows(got)) == 5


def _fill(store, need, index: np.ndarray, rows, block: int) -> None:
    """Fill `store` with `index`'s rows as extract does: a plan of blocks, each block file, then the commit."""
    from featcache.files import locked, npy_file

    with locked(store.work):
        blocks = [(need, index[a : a + block]) for a in range(0, len(index), block)]
        for (_, got), file in zip(blocks, store.plan(blocks)):
            with npy_file(file, (len(got), rows.shape[1])) as fh:
                fh.write(rows[got].tobytes())
        (store.work / "meta.json").write_text(json.dumps({"key": "bb", "name": "bb", "dim": int(rows.shape[1])}))
        store.commit({"dataset": "made-up"})


@settings(max_examples=25, deadline=None)
@given(
    fills=st.lists(st.sets(st.integers(0, 399), min_size=1, max_size=60), min_size=1, max_size=4),
    block=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_gathers_through_any_sequence_of_fills_return_each_rows_own_bytes(tmp_path_factory, fills, block, seed):
    """Fills of random row sets (blocks of any size): every gather, in any order, returns each row's own bytes
    from a fresh Store as from the one that filled; a flipped bit in one row is refused in one line by the gather
    that reads it, and only by it."""
    from featcache.extraction.store import DamagedStore, Store, rows_folder

    folder, rng = tmp_path_factory.mktemp("fills"), np.random.default_rng(seed)
    rows = rng.standard_normal((400, 5)).astype(np.float32)  # [source index, D]
    need, path, held = ("d", "train", 0), folder / "made.bb.0123456789abcdef.h5", set()
    for rows_of_fill in fills:
        store = Store(path, None)
        new = np.array(sorted(set(rows_of_fill) - held), np.int64)
        if len(new):
            _fill(store, need, new, rows, block)
        held |= set(rows_of_fill)
        wanted = rng.permutation(np.array(sorted(held)))[: rng.integers(1, len(held) + 1)]
        for reader in (store, Store(path, None)):
            assert np.array_equal(reader.gather(need, wanted), rows[wanted])
            assert np.array_equal(reader.held()[need], np.array(sorted(held)))
    assert Store(path, None).check() == [] and len(Store(path, None).meta()["segments"]) == sum(
        1 for i, f in enumerate(fills) if set(f) - set().union(*fills[:i])
    )
    victim = int(rng.choice(sorted(held)))
    for part_file in sorted(rows_folder(path).glob("0*.h5")):
        with h5py.File(part_file, "r") as f:
            g = f["d/train/features"]
            index, at = g["index"][...], g["rows"].id.get_offset()
        if victim in index:
            with open(part_file, "r+b") as fh:
                fh.seek(at + int(np.searchsorted(index, victim)) * 20 + 4)
                byte = fh.read(1)
                fh.seek(-1, 1)
                fh.write(bytes([byte[0] ^ 0x10]))
    others = np.array(sorted(held - {victim}), np.int64)
    assert np.array_equal(Store(path, None).gather(need, others), rows[others])
    with pytest.raises(DamagedStore, match="does not match its crc32"):
        Store(path, None).gather(need, np.array([victim]))


def test_a_gather_fills_its_rows_in_place_through_short_reads_and_the_buffer_limit(tmp_path, monkeypatch):
    """A gather reads each run of consecutive rows once, straight into the rows' places: through reads the kernel
    cuts short (13 bytes at most) and runs of more buffers than one read takes, in any order, repeats included, its
    rows are each row's own bytes; rows past the file's end raise the bytes short."""
    from featcache.extraction import store as S

    rows = np.random.default_rng(0).standard_normal((300, 5)).astype(np.float32)  # [source index, D]
    need, path = ("d", "train", 0), tmp_path / "made.bb.0123456789abcdef.h5"
    _fill(S.Store(path, None), need, np.arange(0, 300, 2), rows, 40)  # two segments that interleave
    _fill(S.Store(path, None), need, np.arange(1, 300, 2), rows, 40)
    real = os.preadv
    monkeypatch.setattr(S, "IOV_MAX", 3)
    monkeypatch.setattr(S.os, "preadv", lambda fd, bufs, at: real(fd, [bufs[0][:13]], at))
    wanted = np.random.default_rng(1).permutation(np.r_[np.arange(300), [7, 7, 0, 299]])
    for order in (wanted, np.sort(wanted), np.arange(40, 140)):
        assert np.array_equal(S.Store(path, None).gather(need, order), rows[order])
    part = S.Store(path, None).parts(need)[0]
    part.shape = (part.shape[0] + 10**6, *part.shape[1:])  # rows past the file's end
    with pytest.raises(OSError, match="bytes short"):
        part.read(part.shape[0] - 2, part.shape[0])


def test_a_run_segment_is_gathered_without_its_index_and_verified_whole(tmp_path):
    """A fill of consecutive indices names its run (`first`): a gather reads no index and only the crc32s of its
    rows, each checked against its row, so a flipped bit in a row's crc is refused by the gather that reads it and
    only by it (`digest`, which hashes every crc, checks the array whole); a flipped bit in the index array, which
    no gather reads, is refused by `check` (verify), and so is a changed `first` (the segment's metadata checksum)."""
    from featcache.extraction.store import DamagedStore, Store, rows_folder

    rows = np.random.default_rng(0).standard_normal((100, 5)).astype(np.float32)  # [source index, D]
    need, path = ("d", "train", 0), tmp_path / "made.bb.0123456789abcdef.h5"
    _fill(Store(path, None), need, np.arange(100), rows, 30)
    (segment,) = sorted(rows_folder(path).glob("0*.h5"))
    with h5py.File(segment, "r") as f:
        g = f["d/train/features"]
        assert int(g["index"].attrs["first"]) == 0
        index_at, crc_at = g["index"].id.get_offset(), g["crc"].id.get_offset()

    def flip(at: int) -> None:
        with open(segment, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x10]))

    flip(crc_at + 4 * 7)
    assert np.array_equal(Store(path, None).gather(need, np.arange(8, 100)), rows[8:])
    with pytest.raises(DamagedStore, match="a row does not match its crc32"):
        Store(path, None).gather(need, np.array([3, 7]))
    with pytest.raises(DamagedStore, match="an index does not match its crc32"):  # info's digest hashes every crc
        Store(path, None).digest()
    flip(crc_at + 4 * 7)
    flip(index_at + 8 * 50)
    assert np.array_equal(Store(path, None).gather(need, np.arange(100)), rows)
    with pytest.raises(DamagedStore, match="an index does not match its crc32"):
        Store(path, None).check()
    flip(index_at + 8 * 50)
    assert Store(path, None).check() == []
    with h5py.File(segment, "r+") as f:
        f["d/train/features/index"].attrs["first"] = np.int64(1)
    with pytest.raises(DamagedStore, match="metadata checksum mismatch"):
        Store(path, None).gather(need, np.arange(3))
