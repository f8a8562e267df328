"""Data identity by content: every on-disk reader gives the same store and cache keys for the same images however
the root is spelled, linked, moved or copied; a changed byte changes them; the sidecar of the files' hashes spares
later runs the reads; `info` shows where each store came from and flags duplicates."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import pickle
import shutil
import struct
import warnings
from pathlib import Path

import h5py
import pytest
from fixtures_disk import READERS
from harness import copy_store, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.cache import h5
from featcache.extraction import contents as contents_module
from featcache.extraction.contents import Contents
from featcache.extraction.datasets import dataset_identity, list_datasets, load_dataset
from featcache.extraction.datasets.base import PathImages
from featcache.cache.identity import content_key
from featcache.extraction.plan import extract
from featcache.extraction.stores import duplicates, info

BACKBONE = ["test_efficientnet=random"]
PATH_READERS = ("office10", "domainnet", "pacs", "imagefolder")  # images as files; the others hold arrays


def identity(name: str, root, folder=None) -> dict:
    return dataset_identity(name, root, contents=Contents(folder))[0]


def run(name: str, root, out: Path, store: Path, **extra) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights
        return extract(
            dataset=name,
            backbone=BACKBONE,
            data_root=root,
            out=out,
            store=store,
            workers=0,
            **{"image_size": 16} | READERS[name][1] | extra,
        )


def store_files(store: Path) -> list[str]:
    return sorted(p.name for p in store.glob("*.h5"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per reader: the dataset at `base/data/NAME`, a byte copy elsewhere, a link to it, and an empty folder
    `base/elsewhere/deeper` to run from."""
    base = tmp_path_factory.mktemp("identity")
    (base / "elsewhere" / "deeper").mkdir(parents=True)
    out = {}
    for name, (write, _) in READERS.items():
        root = base / "data" / name
        write(root)
        copy = shutil.copytree(root, base / "copies" / "nested" / name, symlinks=False)
        (base / "links").mkdir(exist_ok=True)
        (base / "links" / name).symlink_to(root, target_is_directory=True)
        out[name] = {"base": base, "root": root, "copy": copy, "link": base / "links" / name}
    return out


def test_every_on_disk_reader_has_a_fixture():
    recipes = {"offline-digits"}  # built in: identified by its code and packages
    assert set(list_datasets()) - recipes == set(READERS)


def spell(where: dict, target: str, cwd: str, dots: int, detour: bool, slash: bool, absolute: bool) -> str:
    """`where[target]` written another way, for a process running in `cwd`: relative or absolute, with './'
    segments, a 'data/../' detour through an existing folder and a trailing slash."""
    base, path = where["base"], where[target]
    start = {"base": base, "elsewhere": base / "elsewhere" / "deeper", "data": base / "data"}[cwd]
    text = str(path) if absolute else os.path.relpath(path, start)
    head, tail = os.path.split(text)
    if detour and os.path.basename(head) not in ("", ".", ".."):  # up from the parent folder and into it again
        head = os.path.join(head, "..", os.path.basename(head))
    text = os.path.join(head, *(["."] * dots), tail)
    return text + ("/" if slash else "")


@settings(max_examples=40)
@given(
    name=st.sampled_from(sorted(READERS)),
    target=st.sampled_from(["root", "copy", "link"]),
    cwd=st.sampled_from(["base", "elsewhere", "data"]),
    dots=st.integers(0, 2),
    detour=st.booleans(),
    slash=st.booleans(),
    absolute=st.booleans(),
)
def test_the_key_of_a_dataset_is_its_content_not_its_path(roots, name, target, cwd, dots, detour, slash, absolute):
    where = roots[name]
    reference = identity(name, where["root"])
    text = spell(where, target, cwd, dots, detour, slash, absolute)
    start = {
        "base": where["base"],
        "elsewhere": where["base"] / "elsewhere" / "deeper",
        "data": where["base"] / "data",
    }[cwd]
    before = os.getcwd()
    os.chdir(start)
    try:
        assert Path(text).resolve() == Path(where[target]).resolve(), text  # the spelling names the folder
        assert identity(name, text) == reference, text
    finally:
        os.chdir(before)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(READERS))
def test_every_reader_embeds_nothing_the_second_time_however_the_root_is_given(roots, tmp_path, monkeypatch, name):
    """The first extraction fills the store; each other spelling (relative, from another folder, through a link,
    with ./ .. and a trailing slash, a copy elsewhere) is a store hit into a fresh --out (nothing embedded, the same
    cache name and bytes) and a cache hit in the first --out."""
    where, store = roots[name], tmp_path / "store"
    first = run(name, where["root"], tmp_path / "first", store)
    assert sum(first["embedded"].values()) > 0
    kept = store_files(store)
    assert len(kept) == 1
    spellings = {
        "relative": ("base", os.path.relpath(where["root"], where["base"])),
        "relative from elsewhere": (
            "elsewhere",
            os.path.relpath(where["root"], where["base"] / "elsewhere" / "deeper"),
        ),
        "link": ("base", str(where["link"])),
        "dots and slash": ("data", f"./{name}/../{name}/./"),
        "copy": ("base", str(where["copy"])),
    }
    for i, (label, (cwd, text)) in enumerate(spellings.items()):
        monkeypatch.chdir(
            {
                "base": where["base"],
                "data": where["base"] / "data",
                "elsewhere": where["base"] / "elsewhere" / "deeper",
            }[cwd]
        )
        again = run(name, text, tmp_path / f"out{i}", store)
        assert again["embedded"] == dict.fromkeys(first["embedded"], 0), label
        assert Path(again["cache"]).name == Path(first["cache"]).name and not again["cache_hit"], label
        assert Path(again["cache"]).read_bytes() == Path(first["cache"]).read_bytes(), label
        assert run(name, text, tmp_path / "first", store)["cache_hit"], label
        assert store_files(store) == kept, label
    sources = {s["root"] for s in info(store)["stores"][0]["sources"]}
    assert sources == {str(where["root"])}  # hits add no source: only a fill reads images


# --- a changed byte changes the key ----------------------------------------------------------------------------------


def _flip_file(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _change_pickle_pixel(path: Path) -> None:
    images, labels = pickle.loads(path.read_bytes())  # the test's own file
    images = images.copy()
    images.flat[0] ^= 0xFF
    path.write_bytes(pickle.dumps((images, labels), pickle.HIGHEST_PROTOCOL))


def _change_py2_pixel(path: Path) -> None:
    """The first pixel of a CIFAR batch: the bytes after the 8-bit string header of its 'data' array."""
    data = path.read_bytes()
    n = max(int.from_bytes(data[i + 1 : i + 5], "little") for i in range(len(data) - 5) if data[i : i + 1] == b"T")
    _flip_file(path, data.index(b"T" + struct.pack("<I", n)) + 5)


def _change_idx_pixel(path: Path) -> None:
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[16] ^= 0xFF  # after the idx header of a 3-d array
    path.write_bytes(gzip.compress(bytes(raw)))


def _change_mat_pixel(path: Path) -> None:
    from scipy.io import loadmat, savemat

    mat = loadmat(path)
    x = mat["X"].copy()
    x.flat[0] ^= 0xFF
    savemat(path, {"X": x, "y": mat["y"]})


def _change_usps_pixel(path: Path) -> None:
    lines = bz2.decompress(path.read_bytes()).decode().splitlines()
    label, first, *rest = lines[0].split()
    lines[0] = " ".join([label, "1:0.5" if first != "1:0.5" else "1:-0.5", *rest])
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def _first_image(root: Path) -> Path:
    return sorted(p for p in root.rglob("*.png"))[0]


CHANGE = {  # dataset -> (the file to change, below the root; how to change one image in it)
    "digit5": (lambda r: r / "MNIST" / "partitions" / "train_part0.pkl", _change_pickle_pixel),
    "cifar10": (lambda r: r / "cifar-10-batches-py" / "data_batch_1", _change_py2_pixel),
    "cifar100": (lambda r: r / "cifar-100-python" / "train", _change_py2_pixel),
    "mnist": (lambda r: r / "MNIST" / "raw" / "train-images-idx3-ubyte.gz", _change_idx_pixel),
    "svhn": (lambda r: r / "train_32x32.mat", _change_mat_pixel),
    "usps": (lambda r: r / "usps.bz2", _change_usps_pixel),
    **{name: (_first_image, lambda p: _flip_file(p, p.stat().st_size - 20)) for name in PATH_READERS},
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_one_changed_image_changes_the_key_even_at_the_same_size_and_mtime(tmp_path, monkeypatch, name):
    monkeypatch.setattr(contents_module, "RACY_NS", 0)  # the sidecar trusts every entry: it must still see this
    root, store = tmp_path / "root", tmp_path / "store"
    store.mkdir()
    READERS[name][0](root)
    primed = Contents(store)
    before = dataset_identity(name, root, contents=primed)[0]
    primed.save()
    assert identity(name, root, store) == before  # the sidecar alone gives the same key
    file = CHANGE[name][0](root)
    st = file.stat()
    CHANGE[name][1](file)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    if name in PATH_READERS:
        assert file.stat().st_size == st.st_size and file.stat().st_mtime_ns == st.st_mtime_ns
    assert identity(name, root, store) != before
    assert identity(name, root) != before


def test_labels_split_and_names_are_part_of_the_key(tmp_path):
    root = tmp_path / "root"
    READERS["imagefolder"][0](root)
    before = identity("imagefolder", root)
    assert load_dataset("imagefolder", root).fingerprint() == before["fingerprint"]
    other_split = load_dataset("imagefolder", root, seed=1).fingerprint()
    assert other_split != before["fingerprint"]
    os.rename(root / "d1" / "a" / "img_000.png", root / "d1" / "a" / "img_100.png")  # the same bytes, renamed
    assert identity("imagefolder", root) != before
    os.rename(root / "d1" / "a" / "img_100.png", root / "d1" / "b" / "img_100.png")  # ... and labelled b
    assert identity("imagefolder", root) != before


# --- the sidecar: a later run needs only stat() --------------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch) -> list[Path]:
    """The files whose bytes the content hashing reads."""
    read: list[Path] = []
    original = contents_module._hash
    monkeypatch.setattr(contents_module, "_hash", lambda path: read.append(Path(path)) or original(path))
    return read


@pytest.mark.parametrize("name", ["office10", "pacs"])
def test_a_later_run_reads_no_image_bytes_and_a_copy_is_read_once(tmp_path, monkeypatch, counted, name):
    monkeypatch.setattr(contents_module, "RACY_NS", 0)
    root, store = tmp_path / "root", tmp_path / "store"
    READERS[name][0](root)
    first = run(name, root, tmp_path / "a", store)
    n = sum(len(s) for splits in load_dataset(name, root).domains.values() for s in splits.values())
    assert len(counted) == n and len(set(counted)) == n  # every image hashed once
    counted.clear()
    decoded = []
    for method in ("image", "side"):
        original = getattr(PathImages, method)
        monkeypatch.setattr(PathImages, method, lambda self, *i, _o=original: decoded.append(i) or _o(self, *i))
    again = run(name, root, tmp_path / "b", store)  # a store hit into a fresh --out
    assert again["embedded"] == dict.fromkeys(first["embedded"], 0)
    assert counted == [] and decoded == []  # stat() only: no byte of an image read
    assert run(name, str(root) + "/", tmp_path / "a", store)["cache_hit"] and counted == []
    copy = shutil.copytree(root, tmp_path / "copy")
    assert run(name, copy, tmp_path / "c", store)["embedded"] == dict.fromkeys(first["embedded"], 0)
    assert len(counted) == n and not decoded  # the copy is hashed once ...
    counted.clear()
    assert run(name, copy, tmp_path / "d", store)["embedded"] == dict.fromkeys(first["embedded"], 0)
    assert counted == []  # ... and then known
    assert len(list(store.glob(".contents-*.json"))) == 2  # one sidecar per real root


def test_files_changed_just_before_hashing_are_hashed_again(tmp_path, counted):
    """A file hashed in the timestamp tick it was written in could be rewritten at the same size without any stat
    field changing: such entries are not trusted until they are older than RACY_NS."""
    root, store = tmp_path / "root", tmp_path / "store"
    store.mkdir()
    READERS["imagefolder"][0](root)
    for _ in range(2):  # just written: every run reads them again, and does not rewrite the sidecar for that
        c = Contents(store)
        dataset_identity("imagefolder", root, contents=c)
        c.save()
        assert c.reads == 18
    assert len(list(store.glob(".contents-*.json"))) == 1
    sidecar = next(store.glob(".contents-*.json"))
    entries = json.loads(sidecar.read_text())["files"]
    aged = {name: [*e[:6], e[6] + 10 * contents_module.RACY_NS] for name, e in entries.items()}
    sidecar.write_text(json.dumps({"root": os.path.realpath(root), "files": aged}))  # as if hashed much later
    c = Contents(store)
    dataset_identity("imagefolder", root, contents=c)
    assert c.reads == 0


def test_a_file_replaced_by_an_equal_one_is_read_again_and_keeps_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(contents_module, "RACY_NS", 0)
    root, store = tmp_path / "root", tmp_path / "store"
    store.mkdir()
    READERS["imagefolder"][0](root)
    c = Contents(store)
    before = dataset_identity("imagefolder", root, contents=c)[0]
    c.save()
    victim = _first_image(root)
    st = victim.stat()
    shutil.copy2(victim, victim.with_suffix(".tmp"))
    os.replace(victim.with_suffix(".tmp"), victim)  # a new inode, the same bytes and mtime
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    c = Contents(store)
    assert dataset_identity("imagefolder", root, contents=c)[0] == before and c.reads == 1


def test_a_damaged_or_foreign_sidecar_only_costs_a_read(tmp_path, monkeypatch):
    monkeypatch.setattr(contents_module, "RACY_NS", 0)
    root, store = tmp_path / "root", tmp_path / "store"
    store.mkdir()
    READERS["imagefolder"][0](root)
    c = Contents(store)
    before = dataset_identity("imagefolder", root, contents=c)[0]
    c.save()
    sidecar = next(store.glob(".contents-*.json"))
    for text in (
        "{not json",
        json.dumps({"root": "/elsewhere", "files": {}}),
        json.dumps([1, 2]),
        json.dumps({"root": os.path.realpath(root), "files": {"d1/a/img_000.png": [1, 2]}}),
    ):
        sidecar.write_text(text)
        c = Contents(store)
        assert dataset_identity("imagefolder", root, contents=c)[0] == before and c.reads >= 1


# --- what info shows, and duplicates -----------------------------------------------------------------------------


def _rekeyed(store_file: Path, change, sources: bool = True) -> Path:
    """A copy of a store file whose identity `change` edits, under the key of the edited identity (with a valid
    metadata checksum), as another featcache would have written it (without `sources`: as one that recorded none)."""
    with h5py.File(store_file, "r") as f:
        ident = json.loads(f.attrs["identity"])
    change(ident)
    key = content_key(ident)
    target = store_file.with_name(f"{store_file.name.rsplit('.', 2)[0]}.{key[:16]}.h5")
    copy_store(store_file, target)
    with h5py.File(target, "r+") as f:
        f.attrs["identity"] = json.dumps(ident, sort_keys=True)
        f.attrs["key"] = key
        if not sources:
            del f.attrs["sources"]
        f.attrs["meta_sha256"] = h5.meta_sha256(f)
    return target


def test_info_shows_each_stores_origin_and_flags_duplicates(tmp_path):
    root, store = tmp_path / "root", tmp_path / "store"
    READERS["imagefolder"][0](root)
    first = run("imagefolder", root, tmp_path / "a", store)
    run("imagefolder", root, tmp_path / "b", store, image_size=24)  # other preprocessing: another store, no duplicate
    shown = {s["image_size"]: s for s in info(store)["stores"]}
    assert set(shown) == {16, 24} and info(store)["duplicates"] == []
    current = shown[16]
    assert current["dataset"] == "imagefolder" and current["identity"] == "content"
    assert current["sources"] == [{"root": str(root)}] and current["preprocessing"]["input_size"] == [3, 16, 16]
    assert current["fingerprint"] == identity("imagefolder", root)["fingerprint"] and not current["stale"]
    with h5py.File(current["file"], "r") as f:
        assert current["key"] == h5.plain(f.attrs["key"])

    def older_code(ident):
        ident["code"] = "0" * 64

    def legacy(ident):  # made before data was identified by content: by paths, no sources recorded
        ident["code"] = "1" * 64
        ident["dataset"] = {"name": "imagefolder", "fingerprint": "2" * 64}

    stale = _rekeyed(Path(current["file"]), older_code)
    old = _rekeyed(Path(current["file"]), legacy, sources=False)
    broken = copy_store(Path(current["file"]), store / "imagefolder.broken.0123456789abcdef.h5")
    with h5py.File(broken, "r+") as f:
        f.attrs["images"] = 7  # the metadata checksum no longer matches
    found = info(store)["stores"]
    assert [s["problem"] for s in found if "problem" in s] == ["metadata checksum mismatch"]
    shown = {Path(s["file"]).name: s for s in found if "problem" not in s}
    assert shown[old.name]["identity"] == "legacy" and shown[old.name]["sources"] == []
    assert shown[stale.name]["stale"] and shown[old.name]["stale"]
    groups = duplicates(store)
    assert [[Path(s["file"]).name for s in g] for g in groups] == [
        [Path(current["file"]).name, *sorted([stale.name, old.name])]
    ]
    assert shown[Path(current["file"]).name]["duplicates"] == sorted([str(stale), str(old)])
    result = run_cli("info", str(store))
    assert result.code == 0, result.stderr
    text = " ".join(result.stdout.split())
    for fragment in (
        str(root),
        "16 px",
        "24 px",
        current["fingerprint"][:16],
        "duplicate",
        "older featcache",
        "not recorded",
        "bicubic",
        "damaged",
    ):
        assert fragment in text, fragment
    assert "hold the same embeddings" in result.stderr
    as_json = json.loads(run_cli("info", str(store), "--json").stdout)
    assert len(as_json["duplicates"]) == 1 and first["images"] > 0
