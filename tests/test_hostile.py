"""Hostile and broken input through the `featcache` command line: each is refused with one line on stderr and exit
code 2, no traceback, and nothing written (no file in --out, no parts folder); the inputs that should work do.

The commands run in this process through the console entry point (`harness.run_cli`), so the ~30 cases take
seconds; test_extract.py and test_faults.py run the same entry point as real subprocesses.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import struct
import sys
import threading
import time
import types
import zlib
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import timm
import torch
from fixtures_disk import dump, write_digit5, write_image
from harness import (
    ctrl_c_after_first_block,
    edit_cache,
    everything_in,
    lines,
    one_line_error,
    one_thread,
    run_cli,
    write_folders,
)

from featcache import cache as C
from featcache.extraction.backbones import create_backbone
from featcache.extraction.datasets import load_dataset
from featcache.extraction.datasets.base import PathImages
from featcache.errors import UserError
from featcache.extraction.plan import extract
from featcache.reproduce import reproduce


pytestmark = pytest.mark.usefixtures("single_thread")


class RunsCommand:
    """Unpickling this runs a shell command (what a malicious pickle does)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def images(tmp: Path) -> Path:
    return write_folders(tmp / "images", classes=("a", "b"), per_class=4)


def checkpoint(tmp: Path, edit: Callable[[dict], None]) -> list[str]:
    state = timm.create_model("test_resnet", num_classes=0).state_dict()
    edit(state)
    torch.save(state, tmp / "ckpt.pth")
    return ["--backbone", f"test_resnet={tmp / 'ckpt.pth'}"]


def truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def corrupt_image(tmp: Path) -> list[str]:
    (tmp / "images" / "d2" / "b" / "img_001.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    return []  # d1's blocks finish before d2's image fails: they must be removed too


def truncated_image(tmp: Path) -> list[str]:
    truncate(tmp / "images" / "d2" / "a" / "img_002.png")
    return []


def empty_class_folder(tmp: Path) -> list[str]:
    (tmp / "images" / "d1" / "zebra").mkdir()
    return []


def garbage_checkpoint(tmp: Path) -> list[str]:
    (tmp / "junk.pth").write_bytes(np.random.default_rng(0).bytes(256))
    return ["--backbone", f"test_resnet={tmp / 'junk.pth'}"]


def malicious_checkpoint(tmp: Path) -> list[str]:
    return checkpoint(tmp, lambda state: state.update(x=RunsCommand(f"touch {tmp / 'pwned'}")))


def malicious_digit5(tmp: Path) -> list[str]:
    root = tmp / "digit5"
    write_digit5(root, folders=("MNIST",), parts=10, per_part=2, n_test=5)
    dump(RunsCommand(f"touch {tmp / 'pwned'}"), root / "MNIST" / "test.pkl")
    return ["--dataset", "digit5", "--data-root", str(root)]


def given(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: list(args)


def zero_byte_jpg(tmp: Path) -> list[str]:
    (tmp / "images" / "d2" / "b" / "empty.jpg").write_bytes(b"")
    return []


def decompression_bomb(tmp: Path) -> list[str]:
    """A valid PNG whose header claims 20000 x 20000 pixels (a 70-byte file): Pillow's limit refuses it."""
    png = write_image(tmp / "small.png", size=(1, 1)).read_bytes()
    ihdr = png.index(b"IHDR")
    header = b"IHDR" + struct.pack(">II", 20000, 20000) + png[ihdr + 12 : ihdr + 17]
    bomb = png[:ihdr] + header + struct.pack(">I", zlib.crc32(header)) + png[ihdr + 21 :]
    (tmp / "images" / "d1" / "b" / "bomb.png").write_bytes(bomb)
    (tmp / "small.png").unlink()
    return []


def named_pipe(tmp: Path) -> list[str]:
    os.mkfifo(tmp / "images" / "d1" / "a" / "pipe.png")  # reading it would block forever
    return []


def symlink_loop(tmp: Path) -> list[str]:
    (tmp / "images" / "d2" / "a" / "loop.png").symlink_to("loop.png")
    return []


def device_file(tmp: Path) -> list[str]:
    (tmp / "images" / "d2" / "a" / "zero.png").symlink_to("/dev/zero")
    return []


def office10(tmp: Path, train: list[str]) -> list[str]:
    """FedBN's Office-Caltech-10 pickles for the site amazon (its test list: one good image), listing `train`."""
    root = tmp / "office"
    write_image(root / "amazon" / "mug" / "a.jpg")
    dump((train, ["mug"] * len(train)), root / "amazon_train.pkl")
    dump((["amazon/mug/a.jpg"], ["mug"]), root / "amazon_test.pkl")
    return ["--dataset", "office10", "--data-root", str(root), "--domains", "amazon"]


def listed_outside_by_dots(tmp: Path) -> list[str]:
    write_image(tmp / "outside" / "mug" / "secret.jpg")
    return office10(tmp, ["amazon/mug/a.jpg", "amazon/mug/../../../outside/mug/secret.jpg"])


def listed_link_outside(tmp: Path) -> list[str]:
    write_image(tmp / "outside" / "mug" / "secret.jpg")
    args = office10(tmp, ["amazon/mug/a.jpg", "amazon/mug/link.jpg"])
    (tmp / "office" / "amazon" / "mug" / "link.jpg").symlink_to(tmp / "outside" / "mug" / "secret.jpg")
    return args


def empty_digit5_test(tmp: Path) -> list[str]:
    root = tmp / "digit5"
    write_digit5(root, folders=("MNIST",), parts=10, per_part=2, n_test=5)
    dump((np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.int64)), root / "MNIST" / "test.pkl")
    return ["--dataset", "digit5", "--data-root", str(root)]


def nested_digit5_test(tmp: Path) -> list[str]:
    """A test.pkl of (images, labels) whose labels are 10^5 nested lists (written by opcodes: `pickle.dump` itself
    recurses): it loads without recursion, and str() or numpy of it overflowed the stack."""
    root = tmp / "digit5"
    write_digit5(root, folders=("MNIST",), parts=10, per_part=2, n_test=5)
    n = 10**5
    (root / "MNIST" / "test.pkl").write_bytes(b"\x80\x02K\x00" + b"]" * n + b"a" * (n - 1) + b"\x86.")
    return ["--dataset", "digit5", "--data-root", str(root)]


# name -> (extra arguments, made in the test's tmp folder holding images/{d1,d2}/{a,b}; text the one line contains).
# Later options override the image-folder defaults; a case naming --backbone replaces the default (a checkpoint).
EXTRACT_CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "corrupt-image": (corrupt_image, "cannot read image"),
    "truncated-image": (truncated_image, "d2/a/img_002.png"),
    "empty-class-folder": (empty_class_folder, "class 'zebra' has no images in any domain"),
    "alpha-zero": (given("--partition", "label", "--clients", "2", "--alpha", "0"), "alpha must be a finite number"),
    "alpha-negative": (given("--partition", "label", "--clients", "2", "--alpha", "-0.5"), "alpha must be a finite"),
    "alpha-nan": (given("--partition", "label", "--clients", "2", "--alpha", "nan"), "alpha must be a finite number"),
    "seed-too-large": (given("--seed", "18446744073709551616"), "seed must be in 0..4294967295"),
    "image-size-zero": (
        given("--image-size", "0"),
        "--image-size must be a whole number of pixels from 8 to 2048 (got 0)",
    ),
    "image-size-one": (given("--image-size", "1"), "--image-size must be a whole number of pixels from 8 to 2048"),
    "image-size-huge": (given("--image-size", "100000"), "pixels from 8 to 2048 (got 100000); omit it for the"),
    "clients-10-to-the-30": (
        given("--partition", "iid", "--clients", "1" + "0" * 30),  # refused before any list
        "1000000000000000000000000000000 clients but only",
    ),
    "out-name-too-long": (lambda t: ["--out", str(t / ("o" * 300))], "is 300 bytes, over the file system's limit"),
    "store-name-too-long": (lambda t: ["--store", str(t / ("s" * 256))], "--store: the name 'sss"),
    "out-empty": (given("--out", ""), "--out is an empty path"),
    "data-root-empty": (given("--data-root", ""), "--data-root is an empty path"),
    "noise-scale-nan": (given("--noise", "laplace", "--noise-scale", "nan"), "noise needs 0 <= p < 1 and scale >= 0"),
    "more-clients-than-images": (given("--partition", "iid", "--clients", "1000"), "1000 clients but only"),
    "unknown-backbone": (given("--backbone", "test_resnett"), "did you mean: test_resnet"),
    "checkpoint-missing-keys": (lambda t: checkpoint(t, lambda s: s.pop("conv1.0.weight")), "missing: conv1.0.weight"),
    "checkpoint-extra-keys": (lambda t: checkpoint(t, lambda s: s.update(extra=torch.ones(2))), "unexpected: extra"),
    "checkpoint-runs-code": (malicious_checkpoint, "pickles objects other than tensors"),
    "checkpoint-garbage": (garbage_checkpoint, "cannot read checkpoint"),
    "checkpoint-missing-file": (lambda t: ["--backbone", f"test_resnet={t / 'none.pth'}"], "does not exist"),
    "digit5-pickle-runs-code": (malicious_digit5, "refusing to unpickle posix.system"),
    "digit5-pickle-nested-10^5-deep": (nested_digit5_test, "nests lists, tuples or dicts more than 32 deep"),
    "missing-data-root": (lambda t: ["--data-root", str(t / "nowhere")], "is not a folder"),
    "unknown-domain": (given("--domains", "d3"), "unknown domain 'd3'"),
    "unknown-partition": (given("--partition", "dirichlet"), "unknown partition scheme"),
    "too-many-classes-per-client": (
        given("--partition", "pathological", "--classes-per-client", "5"),
        "classes_per_client=5",
    ),
    "val-fraction-one": (given("--val-fraction", "1"), "val_fraction must be in [0, 1)"),
    "negative-views": (given("--views", "-1"), "--views must be a whole number >= 0 (got -1)"),
    "noise-p-too-large": (given("--noise", "gaussian", "--noise-p", "1.5"), "noise needs 0 <= p < 1"),
    "unknown-noise": (given("--noise", "uniform"), "unknown noise"),
    "backbone-twice": (given("--backbone", "test_resnet=random", "--backbone", "test_resnet=random"), "listed twice"),
    "cuda-without-cuda": (given("--device", "cuda"), "CUDA is not available"),
    # images: each file the partition picks decoded once, in the embedding pass; only regular files are read
    "zero-byte-jpg": (zero_byte_jpg, "d2/b/empty.jpg (cannot identify image file)"),
    "decompression-bomb": (decompression_bomb, "could be decompression bomb"),
    "named-pipe": (named_pipe, "d1/a/pipe.png is a named pipe, not an image file"),
    "symlink-loop": (symlink_loop, "loop.png (Too many levels of symbolic links)"),
    "device": (device_file, "zero.png is a character device, not an image file"),
    # FedBN datasets: what a list names stays inside --data-root; no empty split
    "fedbn-list-dots-outside": (listed_outside_by_dots, "outside --data-root"),
    "fedbn-list-link-outside": (listed_link_outside, "outside --data-root"),
    "fedbn-list-empty": (lambda t: office10(t, []), "amazon_train.pkl lists no images"),
    "digit5-test-pkl-empty": (empty_digit5_test, "test.pkl holds no images"),
    # output folders
    "out-is-dev-null": (given("--out", "/dev/null"), "--out /dev/null is a file, not a folder"),
}


@pytest.mark.parametrize("case", EXTRACT_CASES.values(), ids=EXTRACT_CASES.keys())
def test_bad_extract_input_is_one_line_and_leaves_nothing(tmp_path, case):
    make, needle = case
    images(tmp_path)
    extra = make(tmp_path)
    if "--device" in extra and torch.cuda.is_available():
        pytest.skip("CUDA is available on this machine")
    backbone = [] if "--backbone" in extra else checkpoint(tmp_path, lambda state: None)  # random: a warning line
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    result = run_cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        *backbone,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--out",
        str(out),
        *extra,
    )
    one_line_error(result, needle)
    assert not out.exists() and snapshot(tmp_path) == before  # not even an empty folder
    assert not (tmp_path / "pwned").exists(), "the pickle's code ran"


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every path below `folder` (links not followed) with its kind, size and modification time."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


DAMAGED_CHECKPOINTS = 64  # random byte strings, and as many prefixes of a real checkpoint


def test_damaged_checkpoints_are_user_errors_never_another_exception(tmp_path):
    """The weights-only unpickler trips over random bytes in many ways (IndexError, 'Unsupported operand', ...);
    each must reach the user as one line."""
    real = tmp_path / "real.pth"
    torch.save(timm.create_model("test_resnet", num_classes=0).state_dict(), real)
    whole = real.read_bytes()
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(int(n)) for n in rng.integers(1, 4096, DAMAGED_CHECKPOINTS)]
    blobs += [whole[: len(whole) * k // (DAMAGED_CHECKPOINTS + 1)] for k in range(1, DAMAGED_CHECKPOINTS + 1)]
    for i, blob in enumerate(blobs):
        path = tmp_path / f"damaged{i}.pth"
        path.write_bytes(blob)
        with pytest.raises(UserError, match="cannot read checkpoint") as refused:
            create_backbone(f"test_resnet={path}")
        assert "\n" not in str(refused.value)


DAMAGED_IMAGE_FORMATS = {".png": "RGB", ".jpg": "RGB", ".gif": "P", ".bmp": "RGB", ".tif": "RGB"}
DAMAGED_PER_FORMAT = 24  # cut short, bits flipped, or random bytes behind a valid header, in turn


def test_damaged_images_are_user_errors_naming_the_file_or_still_decode(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for suffix, mode in DAMAGED_IMAGE_FORMATS.items():
        whole = write_image(tmp_path / f"real{suffix}", mode, size=(16, 12), seed=1).read_bytes()
        for k in range(DAMAGED_PER_FORMAT):
            blob = bytearray(whole)
            if k % 3 == 0:
                blob = blob[: max(1, len(blob) * (k + 1) // (DAMAGED_PER_FORMAT + 1))]
            elif k % 3 == 1:
                blob[rng.integers(len(blob))] ^= 1 << int(rng.integers(8))
            else:
                blob = blob[:16] + rng.bytes(len(blob))
            paths.append(tmp_path / f"damaged{len(paths)}{suffix}")
            paths[-1].write_bytes(bytes(blob))
    images = PathImages(paths, [0] * len(paths))
    refused = 0
    for i, path in enumerate(paths):
        try:
            assert images.image(i).mode == "RGB"  # a flipped pixel bit still decodes: nothing to detect
        except UserError as e:
            refused += 1
            assert str(path) in str(e) and "\n" not in str(e)
    assert refused >= len(paths) // 2


# -- caches handed to train / grid / verify --------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> Path:
    root = write_folders(tmp_path_factory.mktemp("images"), classes=("a", "b"), per_class=16)
    with one_thread():
        res = extract(
            dataset="imagefolder",
            data_root=root,
            backbone=["test_resnet=random"],
            image_size=32,
            out=tmp_path_factory.mktemp("cache"),
        )
    return Path(res["cache"])


def poke(name: str, value) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        f[name][0, 0] = value

    return edit


def flip_feature_bit(f: h5py.File) -> None:
    ds = f["train/features/concat"]
    row = ds[0]  # [D] float32
    row.view(np.uint32)[3] ^= 1 << 9
    ds[0] = row


def set_attr(name: str, value) -> Callable[[h5py.File], None]:
    return lambda f: f.attrs.__setitem__(name, value)


def copied(src: Path, tmp: Path) -> Path:
    return Path(shutil.copy(src, tmp / "c.h5"))


def not_hdf5(src: Path, tmp: Path) -> Path:
    (tmp / "c.h5").write_text("features")
    return tmp / "c.h5"


def tamper(edit: Callable[[h5py.File], None], reseal: bool) -> Callable[[Path, Path], Path]:
    """A copy of the good cache edited in place; `reseal` makes the checksums match, so only content checks help."""

    return lambda src, tmp: edit_cache(copied(src, tmp), edit, reseal)


# name -> (make the bad cache from a good one in a tmp folder, text the one line contains)
CACHE_CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "nan-features": (
        tamper(poke("test/features/concat", np.nan), reseal=True),
        "test/features/concat: NaN or Inf values",
    ),
    "inf-features": (tamper(poke("train/features/concat", np.inf), reseal=True), "NaN or Inf values"),
    "bit-flip": (tamper(flip_feature_bit, reseal=False), "train/features/concat: sha256 mismatch"),
    "counts-disagree": (tamper(set_attr("images", 1), reseal=True), "images attribute says 1"),
    "metadata-edited": (tamper(set_attr("classes", '["a", "z"]'), reseal=False), "metadata checksum mismatch"),
    "truncated": (lambda src, tmp: truncate(copied(src, tmp)), "not a readable HDF5"),
    "not-hdf5": (not_hdf5, "not a readable HDF5"),
    "old-format": (tamper(set_attr("featcache_format", 1), reseal=True), "has cache format 1 (written by featcache"),
    "missing": (lambda src, tmp: tmp / "none.h5", "does not exist"),
}


@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize("case", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_bad_cache_is_refused_by_train_and_verify_in_one_line(good_cache, tmp_path, case, command):
    make, needle = case
    bad = make(good_cache, tmp_path)
    runs = tmp_path / "runs"
    args = {
        "train": [
            "train",
            "--cache",
            str(bad),
            "--algo",
            "fedavg",
            "--rounds",
            "1",
            "--seeds",
            "0",
            "--set",
            "batch_size=8",
            "--out",
            str(runs),
        ],
        "verify": ["verify", str(bad)],
    }[command]
    one_line_error(run_cli(*args), needle)
    assert everything_in(runs) == []


def test_grid_refuses_a_damaged_cache(good_cache, tmp_path):
    bad = CACHE_CASES["bit-flip"][0](good_cache, tmp_path)
    result = run_cli(
        "grid",
        "--cache",
        str(bad),
        "--algo",
        "fedavg",
        "--grid",
        "lr=0.1,0.01",
        "--seeds",
        "0",
        "--rounds",
        "1",
        "--set",
        "batch_size=8",
        "--out",
        str(tmp_path / "runs"),
    )
    one_line_error(result, "sha256 mismatch")


def test_nan_loss_stops_training_in_one_line(good_cache, tmp_path):
    result = run_cli(
        "train",
        "--cache",
        str(good_cache),
        "--algo",
        "fedavg",
        "--rounds",
        "2",
        "--seeds",
        "0",
        "--set",
        "lr=1e38",
        "--set",
        "optimizer=sgd",
        "--set",
        "batch_size=8",
        "--set",
        "drop_last=false",
        "--out",
        str(tmp_path / "runs"),
    )
    one_line_error(result, "loss became NaN/Inf")
    assert everything_in(tmp_path / "runs") == []


# -- inputs that look odd but must work ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,suffix", [("L", ".png"), ("RGBA", ".png"), ("I;16", ".png"), ("P", ".gif"), ("RGB", ".jpg")]
)
def test_grey_rgba_16bit_and_palette_images_extract(tmp_path, mode, suffix):
    write_folders(tmp_path / "images", domains=("d1",), classes=("a", "b"), per_class=4, mode=mode, suffix=suffix)
    result = run_cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
        "--out",
        str(tmp_path / "out"),
        "--json",
    )
    assert result.code == 0, result.stderr
    assert run_cli("verify", *[str(p) for p in (tmp_path / "out").glob("*.h5")]).code == 0


def test_class_only_in_test_is_allowed_with_one_warning_line(tmp_path):
    """Decision: allowed (a domain may lack classes), warned: the domain's clients are never tested on that class,
    as a client's test labels follow its train labels."""
    root = tmp_path / "images"
    for split, classes in (("train", ("a", "b")), ("test", ("a", "b", "c"))):
        write_folders(root / "d1", domains=(split,), classes=classes, per_class=4)
    result = run_cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(root),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
        "--out",
        str(tmp_path / "out"),
        "--json",
    )
    assert result.code == 0, result.stderr
    warned = [line for line in lines(result.stderr) if "imagefolder:" in line]
    assert warned == [
        "warning: imagefolder: domain 'd1' has test images but no training images of ['c']: its "
        "clients are never tested on them"
    ]


def test_allow_partial_loads_a_checkpoint_with_missing_keys_and_says_so(tmp_path):
    images(tmp_path)
    args = [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        *checkpoint(tmp_path, lambda s: s.pop("conv1.0.weight")),
        "--image-size",
        "32",
        "--out",
        str(tmp_path / "out"),
        "--json",
    ]
    one_line_error(run_cli(*args), "pass --allow-partial")
    result = run_cli(*args, "--allow-partial")
    assert result.code == 0, result.stderr
    assert [line for line in lines(result.stderr) if "partial load" in line][0].startswith("warning: partial load")


def test_fedbn_list_may_name_a_link_whose_target_is_inside_data_root(tmp_path):
    office10(tmp_path, ["amazon/mug/a.jpg", "amazon/mug/link.jpg"])
    target = write_image(tmp_path / "office" / "elsewhere" / "b.jpg", seed=3)
    (tmp_path / "office" / "amazon" / "mug" / "link.jpg").symlink_to(target)
    train = load_dataset("office10", tmp_path / "office").domains["amazon"]["train"]
    assert train.paths[1].name == "link.jpg" and train.image(1).size == (6, 5)


# -- pipeline files: each key's type and range, one line naming the key ---------------------------------------------


def pipeline_edit(old: str, new: str) -> Callable[[str], bytes]:
    def edit(text: str) -> bytes:
        assert old in text
        return text.replace(old, new, 1).encode()

    return edit


# name -> (the toy pipeline of test_reproduce edited, as bytes; text the one line contains)
PIPELINE_CASES: dict[str, tuple[Callable[[str], bytes], str]] = {
    "invalid-utf8": (
        lambda text: text.encode().replace(b"a toy table", b"a toy \xff table"),
        "not UTF-8 text (byte 29 is 0xff)",
    ),
    "views-string": (
        pipeline_edit("per_class = 10", 'per_class = 10\nviews = "2"'),
        "[extract]: views must be a whole number >= 0 (got '2')",
    ),
    "batch-size-string": (
        pipeline_edit("set = { tau = 0.1 }", 'set = { tau = 0.1, batch_size = "64" }'),
        "[[run]] 2: batch_size: expected an int like 32, not the string '64'",
    ),
    "extract-batch-size-string": (
        pipeline_edit("per_class = 10", 'per_class = 10\nbatch_size = "64"'),
        "[extract]: batch_size must be a whole number >= 1 (got '64')",
    ),
    "dataset-number": (
        pipeline_edit('dataset = "offline-digits"', "dataset = 5"),
        "[extract]: dataset must be a dataset name (a string) (got 5)",
    ),
    "image-size-negative": (
        pipeline_edit("per_class = 10", "per_class = 10\nimage_size = -32"),
        "[extract]: image_size must be a whole number of pixels from 8 to 2048 (got -32)",
    ),
    "grid-value-string": (
        pipeline_edit('algo = "fedavg"', 'algo = "fedavg"\ngrid = { lr = ["12"] }'),
        "[[run]] 1: grid lr: expected a float like",
    ),
    "grid-axis-not-a-list": (
        pipeline_edit('algo = "fedavg"', 'algo = "fedavg"\ngrid = { lr = "12" }'),
        "[[run]] 1: grid lr must be a list of values",
    ),
    "backbone-not-a-list": (
        pipeline_edit('backbone = ["efficientnet_lite0", "efficientnet_lite1"]', 'backbone = "efficientnet_lite0"'),
        "[extract]: backbone must be a list of backbone names (got 'efficientnet_lite0'): write "
        'backbone = ["efficientnet_lite0"]',
    ),
    "name-250-characters": (
        pipeline_edit('name = "toy"', f'name = "{"t" * 250}"'),
        "use 1 to 64 letters, digits, '.', '_' and '-'",
    ),
}


@pytest.mark.parametrize("case", PIPELINE_CASES.values(), ids=PIPELINE_CASES.keys())
def test_bad_pipeline_values_are_one_line_naming_the_key(tmp_path, case):
    from test_reproduce import PIPELINE

    edit, needle = case
    (tmp_path / "toy.toml").write_bytes(edit(PIPELINE))
    before = snapshot(tmp_path)
    result = run_cli(
        "reproduce",
        str(tmp_path / "toy.toml"),
        "--profile",
        "quick",
        "--out",
        str(tmp_path / "res"),
        "--cache",
        str(tmp_path / "cache"),
    )
    one_line_error(result, needle)
    assert snapshot(tmp_path) == before
    with pytest.raises(UserError, match=re.escape(needle)):
        reproduce(tmp_path / "toy.toml", profile="quick", out=tmp_path / "res", cache=tmp_path / "cache")


# -- info runs verify's structural checks -------------------------------------------------------------------------


def first_backbone(f: h5py.File) -> str:
    return json.loads(f.attrs["backbones"])[0]


def shift_columns(f: h5py.File) -> None:
    f[f"backbones/{first_backbone(f)}"].attrs["columns"] = "[1, 9]"


def longer_labels(f: h5py.File) -> None:
    labels = f["test/labels"][...]  # [n]
    del f["test/labels"]
    f["test/labels"] = np.concatenate([labels, labels[:1]])


def drop_array(f: h5py.File) -> None:
    del f["test/domain"]


# name -> (edit of a good cache, resealed so the checksums agree; text the one line contains)
INFO_CASES: dict[str, tuple[Callable[[h5py.File], None], str]] = {
    "concat-columns": (shift_columns, "do not follow the backbones before it"),
    "shapes": (longer_labels, "test/labels: int64 ["),
    "class-list": (set_attr("classes", '["a"]'), "values outside 0..0"),
    "dropped-array": (drop_array, "test/domain: missing"),
}


@pytest.mark.parametrize("case", INFO_CASES.values(), ids=INFO_CASES.keys())
def test_info_refuses_what_verify_refuses_in_one_line(good_cache, tmp_path, case):
    edit, needle = case
    bad = edit_cache(copied(good_cache, tmp_path), edit, reseal=True)
    before = snapshot(tmp_path)
    line = one_line_error(run_cli("info", str(bad)), needle)
    assert "is damaged" in line and snapshot(tmp_path) == before
    with pytest.raises(UserError, match=re.escape(needle)):
        C.info(bad)
    assert needle in " ".join(C.verify(bad)["problems"])


# -- output folders that cannot be written ------------------------------------------------------------------------


def not_writable(folder: Path, monkeypatch) -> Path:
    """`folder`, read-only for a user; root writes anywhere, so the permission check is shown what a user sees."""
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, m, *a, **k: (
                False if m & os.W_OK and Path(p).resolve() == folder.resolve() else real(p, m, *a, **k)
            ),
        )
    return folder


@pytest.mark.parametrize("where", ["default-out-in-read-only-cwd", "read-only-out", "reproduce-read-only-cache"])
def test_read_only_output_folders_are_one_line(tmp_path, monkeypatch, where):
    images(tmp_path)
    ro = not_writable(tmp_path / "ro", monkeypatch)
    extract = [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
    ]
    if where == "default-out-in-read-only-cwd":
        monkeypatch.chdir(ro)
        args, needle = extract, "--out cache: . is not writable"
    elif where == "read-only-out":
        args, needle = [*extract, "--out", str(ro)], f"--out {ro}: {ro} is not writable"
    else:
        from test_reproduce import PIPELINE

        (tmp_path / "toy.toml").write_text(PIPELINE)
        args = [
            "reproduce",
            str(tmp_path / "toy.toml"),
            "--profile",
            "quick",
            "--out",
            str(tmp_path / "res"),
            "--cache",
            str(ro / "cache"),
        ]
        needle = f"--cache {ro / 'cache'}: {ro} is not writable"
    before = snapshot(tmp_path)
    one_line_error(run_cli(*args), needle)
    assert snapshot(tmp_path) == before


def test_a_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path, monkeypatch):
    images(tmp_path)

    def too_large(fd):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    backbone = checkpoint(tmp_path, lambda state: None)
    monkeypatch.setattr("featcache.files.os.fsync", too_large)
    result = run_cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        *backbone,
        "--image-size",
        "32",
        "--out",
        str(tmp_path / "out"),
    )
    line = one_line_error(result, "file size limit reached while writing")
    assert "disk full" not in line and "ulimit -f" in line


# -- migrate ------------------------------------------------------------------------------------------------------


@pytest.fixture
def format2(tmp_path) -> Path:
    from test_cache_format import format2_copy

    new, old = format2_copy(tmp_path)
    new.unlink()
    return old


def test_two_migrates_of_one_file_one_converts_the_other_says_so(format2):
    start = threading.Barrier(2)
    outcomes: list = []

    def migrate() -> None:
        start.wait()
        try:
            outcomes.append(C.migrate(format2)["to_format"])
        except UserError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=migrate) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(map(str, outcomes)) == sorted(["4", f"{format2} is already cache format 4: nothing to migrate"])
    assert C.verify(format2)["ok"] and [p.name for p in format2.parent.iterdir()] == [format2.name]


def test_migrate_onto_a_read_only_file_is_one_line_and_stages_nothing(format2, monkeypatch):
    original = format2.read_bytes()
    format2.chmod(0o444)
    if os.geteuid() == 0:  # root writes anywhere: show the check what a user (or an immutable file) gives
        real = os.access
        monkeypatch.setattr(
            os, "access", lambda p, m, *a, **k: False if m & os.W_OK and Path(p) == format2 else real(p, m, *a, **k)
        )
    line = one_line_error(run_cli("migrate", str(format2)), "it is read-only or immutable")
    assert str(format2) in line
    assert format2.read_bytes() == original and [p.name for p in format2.parent.iterdir()] == [format2.name]


def test_migrate_whose_final_rename_is_refused_leaves_no_staged_file(format2, monkeypatch):
    """What an immutable file (chattr +i) gives the rename: EPERM after the whole new file is written."""
    original = format2.read_bytes()

    real = os.replace

    def refuse(src, dst):
        if Path(dst) != format2:
            return real(src, dst)
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    one_line_error(run_cli("migrate", str(format2)), "cannot migrate")
    assert format2.read_bytes() == original and [p.name for p in format2.parent.iterdir()] == [format2.name]


# -- a Ray address that does not answer ---------------------------------------------------------------------------


class FakeRay(types.ModuleType):
    """Stands in for `ray` (installed or not): joining a cluster would wait forever, so it must never be asked to."""

    def __init__(self) -> None:
        super().__init__("ray")

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs):
        raise AssertionError("ray.init was called with an address nobody answers at: it would wait forever")


@pytest.mark.parametrize(
    "address,needle",
    [
        ("bogus:1", "no Ray cluster answers there"),
        ("127.0.0.1:1", "Connection refused"),
        ("10.0.0.1:6379", "timed out"),
        ("nonsense", "is not HOST:PORT"),
    ],
)
def test_a_ray_address_that_does_not_answer_is_one_line_in_bounded_time(tmp_path, monkeypatch, address, needle):
    images(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", FakeRay())
    monkeypatch.setenv("RAY_ADDRESS", address)
    if address.startswith("10."):  # a host that drops packets: the connect must give up after the timeout

        def dropped(where, timeout):
            assert timeout <= 30
            raise TimeoutError("timed out")

        monkeypatch.setattr(socket, "create_connection", dropped)
    t0 = time.monotonic()
    result = run_cli(
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        "--backbone",
        "test_resnet=random",
        "--image-size",
        "32",
        "--backend",
        "ray",
        "--out",
        str(tmp_path / "out"),
    )
    one_line_error(result, needle)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out").exists()


# -- the store folder: names taken by the user, read-only and immutable files, damaged resume points ----------------


def store_args(tmp: Path, *extra: str) -> list[str]:
    """An extraction of the test's image folders into tmp/out, one backbone (a checkpoint: no random-weights
    warning line), small blocks, no workers."""
    backbone = ["--backbone", f"test_resnet={tmp / 'ckpt.pth'}"]
    if not (tmp / "ckpt.pth").is_file():
        backbone = checkpoint(tmp, lambda state: None)
    return [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp / "images"),
        *backbone,
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--workers",
        "0",
        "--out",
        str(tmp / "out"),
        *extra,
    ]


def store_name(tmp: Path) -> str:
    """The file name the store of `store_args` gets (the same in any --out)."""
    result = run_cli(*store_args(tmp), "--out", str(tmp / "probe"), "--json")
    assert result.code == 0, result.stderr
    (store,) = (tmp / "probe" / "store").glob("*.h5")
    shutil.rmtree(tmp / "probe")
    return store.name


def killed_fill(tmp: Path, monkeypatch) -> Path:
    """A fill stopped (Ctrl-C) right after its first finished block: its parts folder, the resume point."""
    with ctrl_c_after_first_block(monkeypatch):
        assert run_cli(*store_args(tmp)).code == 130
    (work,) = (tmp / "out" / "store").glob(".*.parts")
    assert list(work.glob("*.npy"))
    return work


def first_block(work: Path) -> Path:
    return sorted(work.glob("*.npy"))[0]


# name -> damage done to a killed fill's parts folder
DAMAGED_PARTS: dict[str, Callable[[Path], object]] = {
    "plan-not-json": lambda work: (work / "plan.json").write_text("garbage"),
    "plan-without-its-keys": lambda work: (work / "plan.json").write_text('[{"x": 1}]'),
    "block-header-cut": lambda work: first_block(work).write_bytes(first_block(work).read_bytes()[:100]),
    "block-rows-cut": lambda work: first_block(work).write_bytes(first_block(work).read_bytes()[:200]),
}


@pytest.mark.parametrize("damage", DAMAGED_PARTS.values(), ids=DAMAGED_PARTS.keys())
def test_a_damaged_parts_folder_is_one_line_naming_it_and_how_to_remove_it(tmp_path, monkeypatch, damage):
    images(tmp_path)
    work = killed_fill(tmp_path, monkeypatch)
    damage(work)
    kept = snapshot(work)
    line = one_line_error(run_cli(*store_args(tmp_path)), f"the parts folder {work} (finished blocks of a killed fill)")
    assert "is damaged" in line and "remove it (rm -r)" in line
    assert snapshot(work) == kept  # kept as it was, for the user to look at or remove
    assert not list((tmp_path / "out").glob("*.h5")) and not list((tmp_path / "out" / "store").glob("*.h5"))
    shutil.rmtree(work)  # what the line says to do
    assert run_cli(*store_args(tmp_path)).code == 0


def test_a_full_disk_while_writing_the_store_names_the_parts_folder_it_keeps(tmp_path, monkeypatch):
    images(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr("featcache.extraction.store._write", full)
        result = run_cli(*store_args(tmp_path))
    (work,) = (tmp_path / "out" / "store").glob(".*.parts")
    line = one_line_error(result, "disk full while writing")
    assert f"the finished blocks are kept in {work} and resumed (rm -r the folder to start over instead)" in line
    assert list(work.glob("*.npy")) and not list((tmp_path / "out").glob("*.h5"))
    again = run_cli(*store_args(tmp_path), "--json")  # the same command resumes
    assert again.code == 0, again.stderr
    assert not work.exists()


def test_store_names_taken_by_a_folder_or_a_file_are_one_line(tmp_path):
    images(tmp_path)
    name = store_name(tmp_path)
    store = tmp_path / "out" / "store"
    (store / name).mkdir(parents=True)
    args = store_args(tmp_path)
    before = snapshot(tmp_path)
    one_line_error(
        run_cli(*args),
        f"{store / name} is a folder, not a file, and featcache keeps a "
        "store under that name: move it, or pass --store another folder",
    )
    assert snapshot(tmp_path) == before
    (store / name).rmdir()
    (store / f".{name}.parts").write_text("mine")  # a user's file where a fill keeps its blocks
    line = one_line_error(run_cli(*store_args(tmp_path)), f"{store / f'.{name}.parts'} is in the way")
    assert "move or rename it" in line and (store / f".{name}.parts").read_text() == "mine"
    assert not list((tmp_path / "out").glob("*.h5"))


def test_a_store_that_cannot_be_replaced_is_one_line_and_stays_as_it_was(tmp_path, monkeypatch):
    """What an immutable store file (chattr +i) gives the rename of its new version: EPERM after the fill; root
    cannot see it from the mode, so the rename is refused here as the kernel would."""
    images(tmp_path)
    assert run_cli(*store_args(tmp_path, "--partition", "iid", "--per-class", "1", "--test-per-class", "1")).code == 0
    (store,) = (tmp_path / "out" / "store").glob("*.h5")
    held = store.read_bytes()
    real = os.replace

    def immutable(src, dst, *args, **kwargs):
        if Path(dst) == store:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(dst))
        return real(src, dst, *args, **kwargs)

    caches = sorted((tmp_path / "out").glob("*.h5"))
    monkeypatch.setattr(os, "replace", immutable)
    line = one_line_error(run_cli(*store_args(tmp_path)), f"cannot write {store}: Operation not permitted")
    assert "pass --store a folder you can write to" in line
    assert store.read_bytes() == held and sorted((tmp_path / "out").glob("*.h5")) == caches
    assert not list(store.parent.glob(".*.parts")) and not list(store.parent.glob("*.partial"))


def test_a_read_only_store_folder_is_one_line_before_any_work(tmp_path, monkeypatch):
    images(tmp_path)
    (tmp_path / "out").mkdir()
    ro = not_writable(tmp_path / "out" / "store", monkeypatch)
    args = store_args(tmp_path)
    before = snapshot(tmp_path)
    one_line_error(
        run_cli(*args),
        f"--store {ro}: {ro} is not writable (permission denied): pass --store a folder you can write to",
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--backbone", "test_resnett"], "did you mean: test_resnet"),
        (["--partition", "iid", "--clients", "1000"], "1000 clients but only"),
        (["--domains", "d3"], "unknown domain 'd3'"),
    ],
    ids=["unknown-backbone", "too-many-clients", "unknown-domain"],
)
def test_refused_input_is_its_one_line_without_the_image_size_note(tmp_path, extra, needle):
    """The note on the chosen --image-size comes once the input passed its checks, never before an error line."""
    images(tmp_path)
    backbone = [] if "--backbone" in extra else checkpoint(tmp_path, lambda state: None)
    args = [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(tmp_path / "images"),
        *backbone,
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]
    one_line_error(run_cli(*args), needle)
    assert not (tmp_path / "out").exists()


def test_the_api_takes_a_lone_string_where_it_takes_a_list(tmp_path):
    """domains="d1" is the domain d1, not the letters d and 1; backbone="x" is one backbone."""
    root = images(tmp_path)
    common = dict(dataset="imagefolder", data_root=root, image_size=32, partition="iid", out=tmp_path / "out")
    with one_thread():
        lone = extract(backbone="test_resnet=random", domains="d2", **common)
        listed = extract(backbone=["test_resnet=random"], domains=("d2",), **common)
    assert lone["domains"] == ["d2"] and listed["key"] == lone["key"] and listed["cache_hit"]
    with pytest.raises(UserError, match=r"domains must be a str or a list of them, not int 2"):
        extract(backbone="test_resnet=random", domains=2, **common)


def test_out_of_memory_while_embedding_advises_the_extraction_settings(tmp_path, monkeypatch):
    """The allocator's failure in `extract` names --batch-size and --image-size, not training settings."""
    images(tmp_path)

    def oom(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 180000000000 bytes")

    monkeypatch.setattr("featcache.extraction.plan._fill", oom)
    line = one_line_error(run_cli(*store_args(tmp_path)), "out of memory (RuntimeError: DefaultCPUAllocator")
    assert line.endswith("lower --batch-size or --image-size") and "proj_dim" not in line
    assert not list((tmp_path / "out").rglob("*.h5"))
