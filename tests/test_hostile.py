"""Hostile and broken input through the `featcache` command line: each is refused with one line on stderr and exit
code 2, no traceback, and nothing written (no file in --out, no parts folder); the inputs that should work do.

The commands run in this process through the console entry point (`harness.run_cli`), so the ~30 cases take
seconds; test_extract.py and test_faults.py run the same entry point as real subprocesses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import timm
import torch
from fixtures_disk import dump, write_digit5, write_image
from harness import edit_cache, everything_in, lines, one_line_error, one_thread, run_cli, write_folders

from featcache.extraction.backbones import create_backbone
from featcache.extraction.datasets.base import PathImages
from featcache.errors import UserError
from featcache.extraction.plan import extract


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
    "image-size-zero": (given("--image-size", "0"), "--image-size must be a whole number of pixels >= 1 (got 0)"),
    "noise-scale-nan": (given("--noise", "laplace", "--noise-scale", "nan"), "noise needs 0 <= p < 1 and scale >= 0"),
    "more-clients-than-images": (given("--partition", "iid", "--clients", "1000"), "1000 clients but only"),
    "unknown-backbone": (given("--backbone", "test_resnett"), "did you mean: test_resnet"),
    "checkpoint-missing-keys": (lambda t: checkpoint(t, lambda s: s.pop("conv1.0.weight")), "missing: conv1.0.weight"),
    "checkpoint-extra-keys": (lambda t: checkpoint(t, lambda s: s.update(extra=torch.ones(2))), "unexpected: extra"),
    "checkpoint-runs-code": (malicious_checkpoint, "pickles objects other than tensors"),
    "checkpoint-garbage": (garbage_checkpoint, "cannot read checkpoint"),
    "checkpoint-missing-file": (lambda t: ["--backbone", f"test_resnet={t / 'none.pth'}"], "does not exist"),
    "digit5-pickle-runs-code": (malicious_digit5, "refusing to unpickle posix.system"),
    "missing-data-root": (lambda t: ["--data-root", str(t / "nowhere")], "is not a folder"),
    "unknown-domain": (given("--domains", "d3"), "unknown domain 'd3'"),
    "unknown-partition": (given("--partition", "dirichlet"), "unknown partition scheme"),
    "too-many-classes-per-client": (given("--partition", "pathological", "--classes-per-client", "5"),
                                    "classes_per_client=5"),
    "val-fraction-one": (given("--val-fraction", "1"), "val_fraction must be in [0, 1)"),
    "negative-views": (given("--views", "-1"), "--views must be >= 0"),
    "noise-p-too-large": (given("--noise", "gaussian", "--noise-p", "1.5"), "noise needs 0 <= p < 1"),
    "unknown-noise": (given("--noise", "uniform"), "unknown noise"),
    "backbone-twice": (given("--backbone", "test_resnet=random", "--backbone", "test_resnet=random"), "listed twice"),
    "cuda-without-cuda": (given("--device", "cuda"), "CUDA is not available"),
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
    result = run_cli("extract", "--dataset", "imagefolder", "--data-root", str(tmp_path / "images"), *backbone,
                     "--image-size", "32", "--batch-size", "4", "--out", str(out), *extra)
    one_line_error(result, needle)
    assert everything_in(out) == []
    assert not (tmp_path / "pwned").exists(), "the pickle's code ran"


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
        res = extract(dataset="imagefolder", data_root=root, backbone=["test_resnet=random"], image_size=32,
                      out=tmp_path_factory.mktemp("cache"))
    return Path(res["cache"])


def poke(name: str, value) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        f[name][0, 0] = value

    return edit


def flip_feature_bit(f: h5py.File) -> None:
    ds = f["clients/000/train/features/concat"]
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
    "nan-features": (tamper(poke("clients/001/test/features/concat", np.nan), reseal=True),
                     "clients/001/test/features/concat: NaN or Inf values"),
    "inf-features": (tamper(poke("clients/000/train/features/concat", np.inf), reseal=True),
                     "NaN or Inf values"),
    "bit-flip": (tamper(flip_feature_bit, reseal=False), "clients/000/train/features/concat: sha256 mismatch"),
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
    args = {"train": ["train", "--cache", str(bad), "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--set",
                      "batch_size=8", "--out", str(runs)],
            "verify": ["verify", str(bad)]}[command]
    one_line_error(run_cli(*args), needle)
    assert everything_in(runs) == []


def test_grid_refuses_a_damaged_cache(good_cache, tmp_path):
    bad = CACHE_CASES["bit-flip"][0](good_cache, tmp_path)
    result = run_cli("grid", "--cache", str(bad), "--algo", "fedavg", "--grid", "lr=0.1,0.01", "--seeds", "0",
                     "--rounds", "1", "--set", "batch_size=8", "--out", str(tmp_path / "runs"))
    one_line_error(result, "sha256 mismatch")


def test_nan_loss_stops_training_in_one_line(good_cache, tmp_path):
    result = run_cli("train", "--cache", str(good_cache), "--algo", "fedavg", "--rounds", "2", "--seeds", "0",
                     "--set", "lr=1e38", "--set", "optimizer=sgd", "--set", "batch_size=8", "--out",
                     str(tmp_path / "runs"))
    one_line_error(result, "loss became NaN/Inf")
    assert everything_in(tmp_path / "runs") == []


# -- inputs that look odd but must work ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode,suffix", [("L", ".png"), ("RGBA", ".png"), ("I;16", ".png"), ("P", ".gif"),
                                         ("RGB", ".jpg")])
def test_grey_rgba_16bit_and_palette_images_extract(tmp_path, mode, suffix):
    write_folders(tmp_path / "images", domains=("d1",), classes=("a", "b"), per_class=4, mode=mode, suffix=suffix)
    result = run_cli("extract", "--dataset", "imagefolder", "--data-root", str(tmp_path / "images"), "--backbone",
                     "test_resnet=random", "--image-size", "32", "--out", str(tmp_path / "out"), "--json")
    assert result.code == 0, result.stderr
    assert run_cli("verify", *[str(p) for p in (tmp_path / "out").glob("*.h5")]).code == 0


def test_class_only_in_test_is_allowed_with_one_warning_line(tmp_path):
    """Decision: allowed (a domain may lack classes), warned: the domain's clients are never tested on that class,
    as a client's test labels follow its train labels."""
    root = tmp_path / "images"
    for split, classes in (("train", ("a", "b")), ("test", ("a", "b", "c"))):
        write_folders(root / "d1", domains=(split,), classes=classes, per_class=4)
    result = run_cli("extract", "--dataset", "imagefolder", "--data-root", str(root), "--backbone",
                     "test_resnet=random", "--image-size", "32", "--out", str(tmp_path / "out"), "--json")
    assert result.code == 0, result.stderr
    warned = [line for line in lines(result.stderr) if "imagefolder:" in line]
    assert warned == ["warning: imagefolder: domain 'd1' has test images but no training images of ['c']: its "
                      "clients are never tested on them"]


def test_allow_partial_loads_a_checkpoint_with_missing_keys_and_says_so(tmp_path):
    images(tmp_path)
    args = ["extract", "--dataset", "imagefolder", "--data-root", str(tmp_path / "images"),
            *checkpoint(tmp_path, lambda s: s.pop("conv1.0.weight")), "--image-size", "32", "--out",
            str(tmp_path / "out"), "--json"]
    one_line_error(run_cli(*args), "pass --allow-partial")
    result = run_cli(*args, "--allow-partial")
    assert result.code == 0, result.stderr
    assert [line for line in lines(result.stderr) if "partial load" in line][0].startswith("warning: partial load")
