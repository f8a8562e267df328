"""Checksums and `featcache verify`, staleness, and determinism: a damaged or stale cache is never used silently, a
change of any input gives a new cache, and the same command gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from harness import BACKBONES, lines, one_thread, run_cli, sha256, write_folders

from featcache.cache.identity import content_key, versions
from featcache import cache as C
from featcache.cache import h5, load
from featcache.extraction.plan import extract

FLIPS = 96  # single-bit flips spread evenly over a cache file


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def cache(images, tmp_path_factory) -> Path:
    with one_thread():
        res = extract(
            dataset="imagefolder",
            data_root=images,
            backbone=BACKBONES,
            image_size=32,
            batch_size=4,
            out=tmp_path_factory.mktemp("cache"),
        )
    return Path(res["cache"])


def contents(path: Path) -> dict:
    """Every attribute and every array of a cache, as read back."""
    with h5py.File(path, "r") as f:
        out = {"/": h5.plain_attrs(f)}
        for name, obj in h5.objects(f):
            data = obj[...].tobytes() if isinstance(obj, h5py.Dataset) else None
            out[name] = (h5.plain_attrs(obj), data)
    return out


def test_each_dataset_carries_the_sha256_of_its_bytes_and_verify_passes(cache):
    with h5py.File(cache, "r") as f:
        datasets = h5.objects(f, h5py.Dataset)
        for _, ds in datasets:
            assert ds.attrs["sha256"] == hashlib.sha256(ds[...].tobytes()).hexdigest()
        assert len(f.attrs["meta_sha256"]) == 64
    report = C.verify(cache)
    assert report["ok"] and report["problems"] == [] and report["stale"] == [] and report["arrays"] == len(datasets)
    shown = run_cli("verify", str(cache))
    assert shown.code == 0 and lines(shown.stdout)[0].startswith(f"ok: {cache} ({len(datasets)} arrays")
    assert json.loads(run_cli("verify", str(cache), "--json").stdout)["ok"] is True


def test_every_bit_flip_is_detected_or_changes_nothing(cache, tmp_path):
    """One bit flipped at evenly spread offsets: `verify` refuses the file, or every array and attribute reads back
    exactly as written (the bit fell in unused space). Never silently different data."""
    reference = contents(cache)
    raw = cache.read_bytes()
    damaged = tmp_path / "flip.h5"
    detected = 0
    for i in range(FLIPS):
        flipped = bytearray(raw)
        flipped[i * len(raw) // FLIPS + 3] ^= 1 << (i % 8)
        damaged.write_bytes(flipped)
        report = C.verify(damaged)
        if report["ok"]:
            assert contents(damaged) == reference, f"flip {i} changed the data and passed verify"
        else:
            detected += 1
            assert all("\n" not in p for p in report["problems"])
    assert detected >= FLIPS // 2  # most of the file is array bytes


def rewrite(path: Path, **attrs) -> None:
    """Store other root attributes and re-seal, as if the cache had been written that way."""
    with h5py.File(path, "r+") as f:
        C.write_attrs(f, attrs)
        h5.seal(f)


def test_cache_from_other_library_versions_is_used_with_one_warning_line(cache, tmp_path):
    old = Path(shutil.copy(cache, tmp_path / "old.h5"))
    with h5py.File(old, "r") as f:
        meta = C.read_attrs(f)
    stored = meta["versions"] | {"torch": "1.0.0", "featcache": "0.0.1"}
    manifest = meta["manifest"] | {"versions": stored}
    rewrite(old, versions=stored, manifest=manifest, key=content_key(manifest), featcache_version="0.0.1")
    report = C.verify(old)
    assert report["ok"] and report["stale"] == [
        f"featcache 0.0.1 (now {versions()['featcache']})",
        f"torch 1.0.0 (now {versions()['torch']})",
    ]
    trained = run_cli(
        "train",
        "--cache",
        str(old),
        "--algo",
        "fedavg",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--set",
        "batch_size=8",
        "--out",
        str(tmp_path / "runs"),
        "--json",
    )
    assert trained.code == 0, trained.stderr
    (warning,) = [line for line in lines(trained.stderr) if "extracted with" in line]
    assert warning.startswith(f"warning: cache {old} was extracted with featcache 0.0.1") and "torch 1.0.0" in warning


def test_a_tampered_key_is_a_problem(cache, tmp_path):
    copy = Path(shutil.copy(cache, tmp_path / "c.h5"))
    rewrite(copy, key="0" * 64)
    assert C.verify(copy)["problems"] == ["the stored key is not the hash of the stored manifest"]


def test_loads_check_each_file_version_once_reading_every_feature_byte_once(cache, tmp_path, monkeypatch):
    """The first load of a file version checks its structure once, and each feature array on the very read that fills
    the tensors: loading train then test reads every feature byte exactly once, a second load checks nothing again,
    and a new version of the file (another mtime) is checked again."""
    copy = Path(shutil.copy(cache, tmp_path / "c.h5"))
    with h5py.File(copy, "r") as f:
        sizes = {name: ds.nbytes for name, ds in h5.objects(f, h5py.Dataset) if name.endswith("/concat")}
    read: dict[str, int] = {}
    real_getitem, real_direct = h5py.Dataset.__getitem__, h5py.Dataset.read_direct

    def count(ds, out) -> None:
        if ds.name.endswith("/concat"):
            read[ds.name[1:]] = read.get(ds.name[1:], 0) + np.asarray(out).nbytes

    monkeypatch.setattr(h5py.Dataset, "__getitem__", lambda ds, key: (out := real_getitem(ds, key), count(ds, out))[0])
    monkeypatch.setattr(
        h5py.Dataset, "read_direct", lambda ds, dest, *a, **k: (real_direct(ds, dest, *a, **k), count(ds, dest))
    )  # all of dest
    real_into = load.read_into  # the loader's low-level read of a slice of rows

    def into(dsid, start, out) -> None:
        real_into(dsid, start, out)
        name = h5py.h5i.get_name(dsid).decode()
        if name.endswith("/concat"):
            read[name[1:]] = read.get(name[1:], 0) + out.nbytes

    monkeypatch.setattr(load, "read_into", into)
    structure, features = [], []
    real_structure, real_features = load._check_structure, load._feature_problems
    monkeypatch.setattr(load, "_check_structure", lambda f, p: structure.append(1) or real_structure(f, p))
    monkeypatch.setattr(load, "_feature_problems", lambda name, *a: features.append(name) or real_features(name, *a))
    train = C.load_clients(copy, "train")
    test = C.load_clients(copy, "test")
    assert read == sizes and len(structure) == 1 and sorted(features) == sorted(sizes)
    assert train.counts.sum() + test.counts.sum() == train.meta["images"]
    read.clear()
    C.load_clients(copy, "train")
    assert len(structure) == 1 and len(features) == len(sizes)  # nothing checked again
    assert read == {k: v for k, v in sizes.items() if k.startswith("train/")}
    os.utime(copy, ns=(1, 1))  # another version of the file: checked again
    C.load_clients(copy, "train")
    assert len(structure) == 2 and len(features) == len(sizes) + len(sizes) // 2


# -- a changed input gives a new cache (the key covers it) ---------------------------------------------------------


def small(images: Path, out: Path, **options) -> dict:
    args = dict(dataset="imagefolder", data_root=images, backbone=["test_resnet=random"], image_size=32, out=out)
    return extract(**(args | options))


def test_new_checkpoint_content_under_the_same_path_gives_a_new_cache(images, tmp_path):
    ckpt = tmp_path / "model.pth"
    state = timm.create_model("test_resnet", num_classes=0).state_dict()
    torch.save(state, ckpt)
    first = small(images, tmp_path, backbone=[f"test_resnet={ckpt}"])
    state["conv1.0.weight"].mul_(2)
    torch.save(state, ckpt)
    second = small(images, tmp_path, backbone=[f"test_resnet={ckpt}"])
    assert not second["cache_hit"] and second["cache"] != first["cache"]


def test_image_size_gives_a_new_cache(images, tmp_path):
    first = small(images, tmp_path)
    second = small(images, tmp_path, image_size=40)
    assert not second["cache_hit"] and second["cache"] != first["cache"]
    assert small(images, tmp_path)["cache_hit"]


def test_touching_an_image_file_keeps_the_cache_and_a_changed_byte_gives_a_new_one(tmp_path):
    """A dataset is known by its bytes: a new mtime alone is the same data (one re-hash, no embedding), a changed
    pixel is new data."""
    images = write_folders(tmp_path / "images", domains=("d1",), classes=("a", "b"), per_class=4)
    first = small(images, tmp_path / "out")
    target = images / "d1" / "a" / "img_000.png"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, new mtime
    touched = small(images, tmp_path / "out")
    assert touched["cache_hit"] and touched["cache"] == first["cache"]
    Image.new("RGB", (32, 32), (1, 2, 3)).save(target)
    changed = small(images, tmp_path / "out")
    assert not changed["cache_hit"] and changed["cache"] != first["cache"]


def test_partition_alpha_gives_a_new_cache(images, tmp_path):
    label = dict(partition="label", clients=2, domains=["d1"])
    first = small(images, tmp_path, alpha=0.5, **label)
    second = small(images, tmp_path, alpha=1.0, **label)
    assert not second["cache_hit"] and second["cache"] != first["cache"]


# -- same command, same bytes ------------------------------------------------------------------------------------


def test_same_extract_twice_gives_identical_cache_bytes(images, cache, tmp_path):
    again = extract(
        dataset="imagefolder", data_root=images, backbone=BACKBONES, image_size=32, batch_size=4, out=tmp_path
    )
    assert not again["cache_hit"] and Path(again["cache"]).name == cache.name
    assert sha256(again["cache"]) == sha256(cache)


def test_same_train_command_twice_gives_identical_result_bytes(cache, tmp_path):
    files, texts = [], []
    for _ in range(2):  # the very same command (its --out too: the result file records the command line)
        run = run_cli(
            "train",
            "--cache",
            str(cache),
            "--algo",
            "fedavg",
            "--rounds",
            "3",
            "--seeds",
            "0,1",
            "--set",
            "batch_size=8",
            "--out",
            str(tmp_path / "a"),
            "--json",
        )
        assert run.code == 0, run.stderr
        files.append(Path(json.loads(run.stdout)["result_file"]))
        texts.append(files[-1].read_bytes())
    assert files[0] == files[1] and texts[0] == texts[1]
    other = run_cli(
        "train",
        "--cache",
        str(cache),
        "--algo",
        "fedavg",
        "--rounds",
        "3",
        "--seeds",
        "0,1",
        "--set",
        "batch_size=8",
        "--out",
        str(tmp_path / "b"),
        "--json",
    )
    moved = json.loads(Path(json.loads(other.stdout)["result_file"]).read_bytes())
    # another --out: the same file name (what it trains) and numbers; only the recorded command differs
    assert Path(json.loads(other.stdout)["result_file"]).name == files[0].name
    assert {k: v for k, v in moved.items() if k != "provenance"} == {
        k: v for k, v in json.loads(texts[0]).items() if k != "provenance"
    }
