"""Damaged image files, met by the embedding pass's own decode (each image file is decoded once): wherever the file
lies (the first image embedded, one after finished blocks, the last), whatever it is (a JPEG cut short, bytes that
are no image), with one backbone or two, in this process or in worker processes, `featcache extract` is one line
naming the file, exit code 2, and leaves nothing behind: no cache, no store, no parts folder, no folder it made. A
damaged file no partition picks is never decoded: the extraction that first picks it is refused the same way and
leaves the stores it found as they were. A killed fill's resume point survives a damaged file met while resuming.

JPEG folders (2 domains x 3 classes x 30 images of 10 px), batch size 4 (blocks of 64 images), one torch thread.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from harness import (
    BACKBONES,
    Result,
    ctrl_c_after_first_block,
    everything_in,
    folder_extract_args,
    one_line_error,
    run_cli,
    sha256,
    write_folders,
)

from featcache.extraction.datasets.base import ArrayImages, PathImages
from featcache.extraction.plan import extract

pytestmark = pytest.mark.usefixtures("single_thread")

DAMAGES = {
    "jpeg-cut-short": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "not-an-image": lambda path: path.write_bytes(b"\xff\xd8 these bytes are no image"),
}
WHERE = ("first", "after-finished-blocks", "last")  # in the order the pass decodes the images


def args(root: Path, out: Path, backbones: list[str], *extra: str) -> list[str]:
    return folder_extract_args(root, out, *extra, backbones=backbones)


def refused(result: Result, bad: Path) -> None:
    """One error line naming `bad` and the fix, exit code 2 (the random-weight backbones' warning lines aside)."""
    kept = [line for line in result.stderr.splitlines() if "has RANDOM weights" not in line]
    line = one_line_error(Result(result.code, result.stdout, "\n".join(kept)), f"cannot read image {bad} (")
    assert line.endswith("repair or delete the file"), line


def tree(folder: Path) -> dict[str, tuple]:
    """Every path below `folder` with its kind, size and modification time."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in folder.rglob("*")
    }


class Decodes:
    """Spies on `PathImages.image` (in this process: workers 0): the files decoded, in order."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[Path] = []
        real = PathImages.image

        def image(images, i):
            self.paths.append(images.paths[i])
            return real(images, i)

        monkeypatch.setattr(PathImages, "image", image)


class Finished:
    """Spies on the block files renamed into place (`.npy`), and on the decode the pass met a damaged file at: how
    many blocks were finished by then."""

    def __init__(self, monkeypatch) -> None:
        self.blocks = 0
        real = os.replace

        def replace(src, dst, *a, **k):
            real(src, dst, *a, **k)
            self.blocks += str(dst).endswith(".npy")

        monkeypatch.setattr(os, "replace", replace)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> tuple[Path, list[Path]]:
    """The folder and its files in the order the pass decodes them (from a clean extraction, workers 0)."""
    root = write_folders(tmp_path_factory.mktemp("jpegs"), per_class=30, suffix=".jpg")
    with pytest.MonkeyPatch.context() as m:
        decodes = Decodes(m)
        res = run_cli(*args(root, tmp_path_factory.mktemp("clean"), BACKBONES[:1], "--workers", "0"))
    assert res.code == 0, res.stderr
    assert len(decodes.paths) == len(set(decodes.paths)) == json.loads(res.stdout)["images"] == 180
    return root, decodes.paths


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backbones", [1, 2])
@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
@pytest.mark.parametrize("where", WHERE)
def test_a_damaged_file_met_while_embedding_is_one_line_and_leaves_nothing(
    jpegs, tmp_path, monkeypatch, where, damage, backbones, workers
):
    source, order = jpegs
    root = shutil.copytree(source, tmp_path / "images")
    bad = root / order[{"first": 0, "after-finished-blocks": len(order) // 2, "last": -1}[where]].relative_to(source)
    damage(bad)
    before = tree(tmp_path)
    finished = Finished(monkeypatch)
    out = tmp_path / "o" / "out"  # its parent made by the run too, and removed
    result = run_cli(*args(root, out, BACKBONES[:backbones], "--workers", str(workers)))
    refused(result, bad)
    assert tree(tmp_path) == before  # no cache, store, parts folder or folder of this run
    assert (finished.blocks > 0) == (where != "first")  # the later cases did remove finished blocks


def test_a_damaged_file_no_partition_picks_is_never_decoded(jpegs, tmp_path, monkeypatch):
    """A file outside every client's images is not read; the extraction that first picks it, through the store the
    first one filled, is one line and leaves the store and the cache as they were."""
    source, _ = jpegs
    root = shutil.copytree(source, tmp_path / "images")
    few = ("--per-class", "2", "--test-per-class", "2")
    decodes = Decodes(monkeypatch)
    assert run_cli(*args(root, tmp_path / "probe", BACKBONES, "--workers", "0", *few)).code == 0
    picked = set(decodes.paths)
    bad = next(p for p in sorted(root.rglob("*.jpg")) if p not in picked)
    DAMAGES["not-an-image"](bad)
    decodes.paths.clear()
    out = tmp_path / "out"
    first = run_cli(*args(root, out, BACKBONES, "--workers", "0", *few))
    assert first.code == 0, first.stderr
    assert sorted(decodes.paths) == sorted(picked) and bad not in decodes.paths  # each picked file once
    kept = {name: sha256(out / name) for name in everything_in(out) if (out / name).is_file()}
    refused(run_cli(*args(root, out, BACKBONES)), bad)
    assert {name: sha256(out / name) for name in everything_in(out) if (out / name).is_file()} == kept
    assert not list((out / "store").glob(".*.parts"))


def test_a_damaged_file_met_while_resuming_keeps_the_resume_point(jpegs, tmp_path, monkeypatch):
    """A killed fill's plan and finished blocks are the resume point: a damaged file met while resuming is one line
    and keeps them (no partial file); once the file is repaired, the same command ends with the clean run's
    bytes."""
    source, order = jpegs
    root = shutil.copytree(source, tmp_path / "images")
    clean = json.loads(run_cli(*args(root, tmp_path / "clean", BACKBONES, "--workers", "0")).stdout)
    out = tmp_path / "out"
    with ctrl_c_after_first_block(monkeypatch):
        assert run_cli(*args(root, out, BACKBONES, "--workers", "0")).code == 130
    bad = root / order[-1].relative_to(source)
    whole = bad.read_bytes()
    DAMAGES["jpeg-cut-short"](bad)
    refused(run_cli(*args(root, out, BACKBONES, "--workers", "0")), bad)
    parts = list((out / "store").glob(".*.parts"))
    assert parts and all((p / "plan.json").is_file() for p in parts) and not list(out.rglob("*.partial"))
    assert not list(out.glob("*.h5"))  # no cache
    bad.write_bytes(whole)
    again = json.loads(run_cli(*args(root, out, BACKBONES, "--workers", "0")).stdout)
    assert sha256(again["cache"]) == sha256(clean["cache"]) and not list((out / "store").glob(".*.parts"))


@pytest.mark.parametrize("kind", ["folders", "arrays"])
def test_each_image_is_decoded_once_for_every_backbone(jpegs, tmp_path, monkeypatch, kind):
    """Files: one `PathImages.image` per image and no other decode; arrays: each image sliced once, as part of a
    batch, never one by one. Two backbones, in this process."""
    if kind == "folders":
        decodes = Decodes(monkeypatch)
        res = extract(
            dataset="imagefolder", data_root=jpegs[0], backbone=BACKBONES, image_size=32, workers=0, out=tmp_path
        )
        assert sorted(decodes.paths) == sorted(jpegs[1]) and len(decodes.paths) == res["images"]
        return
    rows: list[tuple[int, int]] = []  # (image set, row)
    real = ArrayImages.batch

    def batch(images, r):
        rows.extend((id(images), int(i)) for i in r)
        return real(images, r)

    monkeypatch.setattr(ArrayImages, "batch", batch)
    monkeypatch.setattr(ArrayImages, "image", lambda *a: pytest.fail("an array image decoded one by one"))
    res = extract(
        dataset="offline-digits",
        domains=["optdigits"],
        per_class=3,
        test_per_class=2,
        backbone=BACKBONES,
        image_size=32,
        workers=0,
        out=tmp_path,
    )
    assert len(rows) == len(set(rows)) == res["images"]


def test_a_damaged_file_is_its_one_line_without_the_image_size_note(jpegs, tmp_path):
    """The note on the chosen --image-size is told once the caches are written, never before the error line."""
    source, order = jpegs
    root = shutil.copytree(source, tmp_path / "images")
    bad = root / order[-1].relative_to(source)
    DAMAGES["not-an-image"](bad)
    cut = args(root, tmp_path / "out", BACKBONES)
    i = cut.index("--image-size")
    refused(run_cli(*cut[:i], *cut[i + 2 :]), bad)
    assert not (tmp_path / "out").exists()
