"""An image's embedding depends on the image, the backbone and the preprocessing alone: not on the other images of
its forward, their number, its place among them, the chunks and blocks the pass cut, the user's --batch-size and
--workers, or the torch threads. So a content key names one set of bytes: a sweep's caches equal the single runs'
byte for byte, and two extractions filling one store at once leave the bytes of one after the other.

The first test drives the embedding pass itself (`embed.embed`) over random arrangements of the same images and
compares every row with the image embedded alone; the others run `extract` end to end (tiny random-weight timm
models at 32 px, and EfficientNet-Lite0 on offline-digits, the command the bug was found with).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from fixtures_disk import write_image
from harness import BACKBONES, sha256, store_files, write_folders
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.extraction import embed as E
from featcache.extraction import pipeline as P
from featcache.extraction.datasets.base import ArrayImages, PathImages
from featcache.extraction.plan import extract

REPO = Path(__file__).resolve().parent.parent
N_ARRAY, N_FILES = 90, 12  # images of the two splits of the pass's dataset: more than one forward's 64


@contextmanager
def forward_threads(n: int):
    """The embedding pass on n torch threads (it keeps one core free: `P.cores` says n + 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with mock.patch.object(P, "cores", lambda: n + 1):
            yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def backbone(spec: str, image_size: int):
    return E.create_backbone(spec, image_size=image_size)


@pytest.fixture(scope="module")
def built_once():
    """Each backbone built once for the passes below (a frozen model holds no state between forwards)."""
    with mock.patch.object(E, "build", lambda run, j: backbone(run.specs[j], run.image_size)):
        yield


@pytest.fixture(scope="module")
def pass_data(tmp_path_factory):
    """Two splits of one domain: 28x28 grey arrays (prepared as one batch and resized together) and PNG files of
    mixed sizes (each decoded and resized alone)."""
    folder = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    arrays = ArrayImages(rng.integers(0, 256, (N_ARRAY, 28, 28), dtype=np.uint8), np.arange(N_ARRAY) % 3)
    paths = [write_image(folder / f"{i:02d}.png", size=(9 + i % 5, 7 + i % 3), seed=i) for i in range(N_FILES)]
    files = PathImages(paths, np.arange(N_FILES) % 3)
    return Images(domains={"d": {"train": arrays, "test": files}})


class Images(SimpleNamespace):
    """What the pass reads of a dataset (`domains`), with a short repr for Hypothesis's failure report."""

    def __repr__(self) -> str:
        return f"Images({N_ARRAY} arrays, {N_FILES} files)"


def run_pass(
    data,
    layout: list[tuple[str, list[int]]],
    folder: Path,
    specs: list[str],
    batch_size: int = 64,
    threads: int = 1,
    noise: P.Noise | None = None,
    views: int = 0,
) -> dict[str, dict[str, dict[int, bytes]]]:
    """One embedding pass over `layout` ((split, increasing rows) per block, in that order): backbone spec ->
    split -> source index -> the bytes of its row (of its `views` rows, with views)."""
    folder.mkdir(parents=True, exist_ok=True)
    blocks = [
        E.Block("d", split, views, np.asarray(rows, np.int64), {j: folder / f"b{b}.{j}.npy" for j in range(len(specs))})
        for b, (split, rows) in enumerate(layout)
    ]
    run = E.Settings(
        tuple(specs),
        32,
        noise,
        0,
        batch_size,
        0,
        "cpu",
        False,
        tuple(folder / f"meta{j}.json" for j in range(len(specs))),
    )
    with forward_threads(threads):
        E.embed(blocks, data, run)
    out = {spec: {"train": {}, "test": {}} for spec in specs}
    for block in blocks:
        for j, spec in enumerate(specs):
            rows = np.load(block.files[j])  # [n, D] or [n, V, D]
            assert rows.dtype == np.float32 and len(rows) == len(block.rows)
            out[spec][block.split] |= {int(i): row.tobytes() for i, row in zip(block.rows, rows)}
    return out


@pytest.fixture(scope="module")
def alone(pass_data, built_once, tmp_path_factory):
    """Every image embedded alone: prepared as a chunk of its own and forwarded as the only image of its forward,
    on one thread; for a few images, checked against a pass that embeds that image alone."""
    dev = torch.device("cpu")
    out = {spec: {"train": {}, "test": {}} for spec in BACKBONES}
    with forward_threads(1), torch.inference_mode():
        for spec in BACKBONES:
            bb = backbone(spec, 32)
            g, model = P.Geometry.of(bb.preprocessing), bb.model.to(memory_format=torch.channels_last)
            for split, n in (("train", N_ARRAY), ("test", N_FILES)):
                source = P.Chunks(pass_data, [P.Chunk(0, "d", split, np.array([i])) for i in range(n)], [g], None, 0)
                for i in range(n):
                    x = P.normalise(
                        P.to_device(source[i][1], [g], dev)[g], bb.preprocessing["mean"], bb.preprocessing["std"]
                    )  # [1, 3, 32, 32]
                    padded = torch.cat([x, x.new_zeros((P.forward_batch(dev) - 1, *x.shape[1:]))])  # [64, 3, 32, 32]
                    x = padded.contiguous(memory_format=torch.channels_last)
                    out[spec][split][i] = E._forward(model, x, 1, dev)[0].numpy().tobytes()
    folder = tmp_path_factory.mktemp("alone")
    for split, i in (("train", 0), ("train", N_ARRAY - 1), ("test", 3)):
        got = run_pass(pass_data, [(split, [i])], folder / f"{split}{i}", BACKBONES)
        assert all(got[spec][split][i] == out[spec][split][i] for spec in BACKBONES), (split, i)
    return out


@st.composite
def layouts(draw) -> list[tuple[str, list[int]]]:
    """Some of the images, cut into blocks at random places, the blocks in a random order (rows increasing within a
    block, as a plan makes them)."""
    blocks = []
    for split, n in (("train", N_ARRAY), ("test", N_FILES)):
        rows = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n)))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(rows) - 1)), max_size=5))) if len(rows) > 1 else []
        blocks += [(split, rows[a:b]) for a, b in zip([0, *cuts], [*cuts, len(rows)]) if rows[a:b]]
    if not blocks:
        blocks = [("train", [draw(st.integers(0, N_ARRAY - 1))])]
    return draw(st.permutations(blocks))


@settings(max_examples=12)
@given(layout=layouts(), batch_size=st.sampled_from([1, 2, 3, 5, 16, 63, 64, 65, 100]), threads=st.sampled_from([1, 2]))
def test_an_images_bytes_do_not_depend_on_what_else_the_pass_embeds(
    pass_data, built_once, alone, tmp_path_factory, layout, batch_size, threads
):
    """Whatever subset of the images a pass embeds, cut into whatever blocks and chunks (--batch-size), in whatever
    order, on 1 or 2 threads: each image's row is the bytes of the image embedded alone."""
    got = run_pass(pass_data, layout, tmp_path_factory.mktemp("pass"), BACKBONES, batch_size, threads)
    for spec, splits in got.items():
        for split, rows in splits.items():
            for i, row in rows.items():
                assert row == alone[spec][split][i], (spec, split, i, layout, batch_size, threads)


@pytest.mark.slow
def test_efficientnet_lite0_rows_do_not_depend_on_batch_mates_threads_or_noise(pass_data, built_once, tmp_path):
    """The pretrained backbone the demo uses (its 1x1 convolutions are where oneDNN's blocking follows the batch
    size): an image alone, at the end of a short chunk, among 63 others, on 1 and 2 threads; the per-image decode path
    (noise) too."""
    spec = ["efficientnet_lite0"]
    noise = P.Noise("gaussian", 0.05, 0.1)
    for kind in (None, noise):
        ref = {
            i: run_pass(pass_data, [("train", [i])], tmp_path / f"alone{i}{kind is None}", spec, noise=kind)[spec[0]][
                "train"
            ][i]
            for i in (0, 17, 39)
        }
        for n, (batch, threads) in enumerate([(1, 2), (7, 1), (64, 2), (40, 1)]):
            layout = [("train", list(range(18))), ("test", list(range(N_FILES))), ("train", list(range(18, 40)))]
            got = run_pass(pass_data, layout, tmp_path / f"p{n}{kind is None}", spec, batch, threads, kind)
            assert all(got[spec[0]]["train"][i] == row for i, row in ref.items()), (batch, threads, kind)


def test_augmented_views_do_not_depend_on_what_else_the_pass_embeds(pass_data, built_once, tmp_path):
    """Three views per image (each image's views consecutive rows, which a forward may split): an image's views are
    the bytes of that image's views embedded alone, in chunks of 1 and 64 images."""
    ref = {i: run_pass(pass_data, [("train", [i])], tmp_path / f"alone{i}", BACKBONES, views=3) for i in (0, 21, 47)}
    for batch in (1, 64):
        layout = [("train", list(range(0, 22))), ("train", list(range(22, 48)))]
        got = run_pass(pass_data, layout, tmp_path / f"b{batch}", BACKBONES, batch, views=3)
        for i, one in ref.items():
            assert all(got[spec]["train"][i] == one[spec]["train"][i] for spec in BACKBONES), (i, batch)


# -- end to end: sweeps and single runs, concurrent fills --------------------------------------------------------------


def cache_of(images: Path, out: Path, **options) -> dict:
    args = dict(
        dataset="imagefolder",
        data_root=images,
        backbone=BACKBONES,
        image_size=32,
        domains=["d1"],
        partition="label",
        out=out,
    )
    return extract(**(args | options))


SWEEP = st.fixed_dictionaries(
    {
        "clients": st.lists(st.integers(2, 4), min_size=1, max_size=2, unique=True),
        "alpha": st.lists(st.sampled_from([0.1, 0.5, 1.0, 5.0]), min_size=1, max_size=2, unique=True),
        "per_class": st.lists(st.integers(1, 3), min_size=1, max_size=2, unique=True),
    }
)


@pytest.mark.slow
@settings(max_examples=4)
@given(sweep=SWEEP, batch_size=st.sampled_from([1, 3, 8, 64]), workers=st.sampled_from([0, 2]))
def test_every_sweeps_caches_equal_the_single_runs_byte_for_byte(
    sweep_images, tmp_path_factory, sweep, batch_size, workers
):
    """A sweep (clients x alpha x per_class, one fill of the stores for all its settings) and each of its settings
    run alone into an empty folder, at another --batch-size and --workers: the same cache files, byte for byte.
    A first single run fills the sweep's store folder beforehand, so the sweep embeds only what it lacks."""
    root = tmp_path_factory.mktemp("sweep")
    settings_ = list(itertools.product(sweep["clients"], sweep["alpha"], sweep["per_class"]))
    first = dict(zip(("clients", "alpha", "per_class"), settings_[-1]))
    cache_of(sweep_images, root / "sweep", batch_size=5, **first)  # the store holds some of the images already
    swept = cache_of(
        sweep_images,
        root / "sweep",
        batch_size=batch_size,
        workers=workers,
        **{k: v if len(v) > 1 else v[0] for k, v in sweep.items()},
    )
    caches = swept["caches"] if "caches" in swept else [swept]
    assert len(caches) == len(settings_)
    for n, ((clients, alpha, per_class), one) in enumerate(zip(settings_, caches)):
        single = cache_of(sweep_images, root / f"single{n}", clients=clients, alpha=alpha, per_class=per_class)
        assert Path(single["cache"]).name == Path(one["cache"]).name
        assert sha256(single["cache"]) == sha256(one["cache"]), (clients, alpha, per_class)


@pytest.fixture(scope="module")
def sweep_images(tmp_path_factory):
    return write_folders(tmp_path_factory.mktemp("images"), domains=("d1",), classes=("a", "b", "c", "d"), per_class=9)


@pytest.mark.slow
def test_the_issues_sweep_on_offline_digits_equals_its_single_run(tmp_path):
    """The command the bug was found with, at a size CI affords: `--partition label --clients 2,4 --alpha 0.1,1`
    vs `--clients 2 --alpha 1` on offline-digits with EfficientNet-Lite0."""
    common = dict(
        dataset="offline-digits", partition="label", domains=["mnist"], per_class=7, test_per_class=5, image_size=32
    )
    sweep = extract(clients=[2, 4], alpha=[0.1, 1.0], out=tmp_path / "sweep", **common)
    for (clients, alpha), swept in zip(itertools.product([2, 4], [0.1, 1.0]), sweep["caches"]):
        if (clients, alpha) in ((2, 1.0), (4, 0.1)):
            single = extract(clients=clients, alpha=alpha, out=tmp_path / f"c{clients}a{alpha}", **common)
            assert Path(single["cache"]).name == Path(swept["cache"]).name
            assert sha256(single["cache"]) == sha256(swept["cache"]), (clients, alpha)


def folder_args(images: Path, out: Path, per_class: int, batch_size: int) -> list[str]:
    return [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(images),
        "--domains",
        "d1",
        "--partition",
        "label",
        "--clients",
        "2",
        "--per-class",
        str(per_class),
        *(a for b in BACKBONES for a in ("--backbone", b)),
        "--image-size",
        "32",
        "--batch-size",
        str(batch_size),
        "--out",
        str(out),
        "--json",
    ]


@pytest.mark.slow
def test_two_extractions_filling_one_store_at_once_leave_the_bytes_of_one_after_the_other(sweep_images, tmp_path):
    """Two processes with overlapping images (per_class 2 and 3 of the same pool) started together on one --out:
    their caches equal those of the two run one after the other, in either order, and the stores they filled those
    of one of the orders."""
    jobs = {2: 3, 3: 7}  # per_class -> --batch-size
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "featcache.cli", *folder_args(sweep_images, tmp_path / "at-once", p, b)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for p, b in jobs.items()
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    together = {Path(json.loads(out)["cache"]).name: sha256(json.loads(out)["cache"]) for out, _ in outputs}
    stores = []
    for order in (list(jobs), list(jobs)[::-1]):
        out = tmp_path / f"order-{'-'.join(map(str, order))}"
        one_by_one = {}
        for per_class in order:
            result = cache_of(sweep_images, out, clients=2, per_class=per_class, batch_size=64)
            one_by_one[Path(result["cache"]).name] = sha256(result["cache"])
        assert one_by_one == together, order  # a cache holds its rows whatever the order
        stores.append(store_files(out))
    assert store_files(tmp_path / "at-once") in stores  # the stores append: the segments of one order or the other
