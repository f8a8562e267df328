"""The extraction input pipeline: one decode per image for every backbone, batched resizing equal to per-image
resizing, embeddings that agree with the PIL path on real digits and photos, cache bytes that depend neither on the
worker count nor on the backend (Ray), and built-in datasets kept beside the caches."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from harness import BACKBONES, everything_in, one_thread, sha256, store_files
from PIL import Image
from sklearn.datasets import load_sample_images

from featcache import cache as C
from featcache.extraction import pipeline as P
from featcache.extraction.backbones import create_backbone
from featcache.extraction.datasets import keep_dataset, load_dataset
from featcache.extraction.datasets.base import ArrayImages, Dataset, PathImages
from featcache.errors import UserError
from featcache.extraction.plan import Noise, extract


def write_photos(root, sizes=((120, 90), (97, 131), (160, 100))):
    """root/{domain}/{class}/*.jpg: crops of scikit-learn's two sample photos (real content) in several sizes."""
    photos = load_sample_images().images  # 2 x [427, 640, 3]
    for d, domain in enumerate(("d1", "d2")):
        for k, cls in enumerate(("china", "flower")):
            for i, (w, h) in enumerate(sizes * 2):
                top, left = 40 * i + 20 * d, 60 * i
                crop = photos[k][top : top + 2 * h, left : left + 2 * w]
                path = root / domain / cls / f"{i}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(crop).resize((w, h)).save(path, quality=90)
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return write_photos(tmp_path_factory.mktemp("photos"))


def cached_and_reference(res: dict, data, spec: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(cached features, features of the PIL path: per-image `Backbone.transform()` then the model) of every image."""
    bb = create_backbone(spec, image_size=image_size)
    tf = bb.transform()
    cached, reference = [], []
    with h5py.File(res["cache"]) as f, torch.inference_mode():
        for c, row in enumerate(C.read_attrs(f)["counts"]["clients"]):
            for split in ("train", "test"):
                images = data.domains[row["domain"]][split]
                rows = C.client_rows(f, split, c, "source_index")
                cached.append(C.client_rows(f, split, c))  # one backbone: all columns
                reference.append(bb.model(torch.stack([tf(images.image(int(i))) for i in rows])).numpy())
    return np.concatenate(cached), np.concatenate(reference)


@pytest.mark.parametrize("dataset", ["offline-digits", "photos"])
def test_embeddings_agree_with_the_pil_path_on_real_digits_and_photos(tmp_path, photos, dataset):
    if dataset == "photos":
        args, data = dict(dataset="imagefolder", data_root=photos), load_dataset("imagefolder", photos)
    else:
        args = dict(dataset="offline-digits", domains=["mnist", "synth"], per_class=3, test_per_class=2)
        data = load_dataset("offline-digits")
    res = extract(**args, backbone=["efficientnet_lite0"], image_size=48, out=tmp_path)
    ours, pil = cached_and_reference(res, data, "efficientnet_lite0", 48)  # [N, D] each
    cosine = (ours * pil).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(pil, axis=1)
    assert len(cosine) == res["images"] and cosine.min() >= 0.99, cosine.min()
    assert not np.array_equal(ours, pil)  # a different (batched, antialiased tensor) resize, not the same code


def test_every_image_is_decoded_once_for_all_backbones(tmp_path, photos, monkeypatch):
    decoded = []
    original = PathImages.image
    monkeypatch.setattr(PathImages, "image", lambda self, i: decoded.append((id(self), i)) or original(self, i))
    res = extract(dataset="imagefolder", data_root=photos, backbone=BACKBONES, image_size=32, workers=0, out=tmp_path)
    assert len(decoded) == len(set(decoded)) == res["images"]
    with h5py.File(res["cache"]) as f:  # two backbones of two geometries (bilinear, bicubic) were fed
        interpolations = [
            json.loads(f[f"backbones/{k}"].attrs["preprocessing"])["interpolation"] for k in res["backbones"]
        ]
        assert sorted(interpolations) == ["bicubic", "bilinear"]
        assert f["train/features/concat"].shape[1] > 0


def test_arrays_come_as_one_uint8_batch_and_mixed_sizes_per_geometry(tmp_path):
    arrays = ArrayImages(np.arange(5 * 6 * 7, dtype=np.uint8).reshape(5, 6, 7), np.zeros(5))  # grey [5, 6, 7]
    files = [tmp_path / f"{i}.png" for i in range(3)]
    for i, f in enumerate(files):
        Image.fromarray(np.full((8 + i, 9, 3), 40 * i, np.uint8)).save(f)
    data = Dataset("t", ["a"], {"d": {"train": arrays, "test": PathImages(files, np.zeros(3))}})
    small, large = P.Geometry(4, 4, "bilinear"), P.Geometry(10, 12, "bicubic")
    chunks = P.Chunks(
        data,
        [
            P.Chunk(0, "d", "train", np.array([4, 1, 2])),
            P.Chunk(1, "d", "test", np.arange(3)),
            P.Chunk(2, "d", "train", np.array([0, 3]), views=2),
        ],
        [small, large],
        None,
        0,
    )
    block, batch = chunks[0]
    assert block == 0 and batch.dtype == torch.uint8 and batch.shape == (3, 3, 6, 7)  # grey repeated to RGB
    assert torch.equal(batch[:, 0], torch.from_numpy(arrays.images[[4, 1, 2]]))
    _, mixed = chunks[1]
    assert {g: tuple(x.shape) for g, x in mixed.items()} == {small: (3, 3, 4, 4), large: (3, 3, 10, 12)}
    _, views = chunks[2]
    assert views[large].shape == (4, 3, 10, 12) and not torch.equal(views[large][0], views[large][1])
    assert torch.equal(chunks[2][1][large], views[large])  # seeded per (image, view): the same again
    on_device = P.to_device(batch, [small, large], torch.device("cpu"))
    assert torch.equal(on_device[small], torch.cat([P.resize(x[None], small) for x in batch]))


def test_batched_resize_equals_per_image_resize_and_is_near_pil():
    photo = load_sample_images().images[1][:200, :300]  # [200, 300, 3]
    x = torch.from_numpy(np.stack([photo, photo[::-1], 255 - photo])).permute(0, 3, 1, 2).contiguous()
    for g in (P.Geometry(64, 64, "bicubic"), P.Geometry(48, 80, "bilinear"), P.Geometry(224, 224, "bicubic")):
        batched = P.resize(x, g)  # [3, 3, H, W] uint8
        assert torch.equal(batched, torch.cat([P.resize(xi[None], g) for xi in x]))
        pil = np.asarray(Image.fromarray(photo).resize((g.width, g.height), Image.Resampling[g.interpolation.upper()]))
        diff = np.abs(batched[0].permute(1, 2, 0).numpy().astype(int) - pil.astype(int))
        assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 3


def test_cache_bytes_do_not_depend_on_the_worker_count(tmp_path, photos):
    def caches(name: str, workers: tuple[int, int], **kw) -> dict[int, str]:
        return {w: extract(**kw, image_size=32, workers=w, out=tmp_path / f"{name}{w}")["cache"] for w in workers}

    digits = dict(dataset="offline-digits", domains=["optdigits"], per_class=2, test_per_class=1)
    with one_thread():
        files = caches("files", (0, 2), dataset="imagefolder", data_root=photos, backbone=BACKBONES, batch_size=3)
        views = caches("views", (0, 1), **digits, noise=Noise("laplace", 0.1, 0.1), views=2)
        # one shared-size batch per chunk: resized by the input workers, or in this process with none
        shared = caches("shared", (0, 2), **digits)
    assert sha256(files[0]) == sha256(files[2]) and sha256(views[0]) == sha256(views[1])
    assert sha256(shared[0]) == sha256(shared[2])


def test_a_damaged_image_read_by_a_worker_is_one_line(tmp_path, photos):
    import shutil

    root = shutil.copytree(photos, tmp_path / "photos")
    (root / "d2" / "flower" / "1.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(UserError) as err:
        extract(
            dataset="imagefolder",
            data_root=root,
            backbone=["test_resnet=random"],
            image_size=32,
            workers=2,
            out=tmp_path / "out",
        )
    assert "1.jpg" in str(err.value) and "\n" not in str(err.value) and "repair or delete" in str(err.value)
    assert not any((tmp_path / "out").rglob("*.h5"))


def test_built_in_dataset_is_kept_beside_the_caches_and_read_back(tmp_path):
    built = load_dataset("offline-digits", domains=["optdigits"])
    keep_dataset(built, tmp_path, domains=["optdigits"])
    (kept,) = tmp_path.glob(".offline-digits-*.npz")
    again = load_dataset("offline-digits", store=tmp_path, domains=["optdigits"])
    assert again.classes == built.classes and list(again.domains) == ["optdigits"]
    for split in ("train", "test"):
        np.testing.assert_array_equal(
            again.domains["optdigits"][split].images, built.domains["optdigits"][split].images
        )
        np.testing.assert_array_equal(
            again.domains["optdigits"][split].labels, built.domains["optdigits"][split].labels
        )
    kept.write_bytes(b"damaged")  # a damaged file is built again, never an error
    assert (
        load_dataset("offline-digits", store=tmp_path, domains=["optdigits"]).domains["optdigits"]["test"].labels.size
    )


def test_extract_keeps_the_built_dataset_only_after_success(tmp_path):
    with pytest.raises(UserError):
        extract(dataset="offline-digits", domains=["mnst"], per_class=1, test_per_class=1, out=tmp_path)
    assert not any(tmp_path.iterdir())
    extract(dataset="offline-digits", domains=["optdigits"], per_class=1, test_per_class=1, image_size=32, out=tmp_path)
    assert len(list(tmp_path.glob(".offline-digits-*.npz"))) == 1


def test_worker_and_batch_size_defaults_follow_the_data_and_device(photos):
    arrays = load_dataset("offline-digits", domains=["optdigits"])
    assert P.default_workers(arrays, views=0) == 0 and P.default_workers(arrays, views=2) >= 1
    assert P.default_workers(load_dataset("imagefolder", photos), views=0) >= 1
    assert P.default_batch_size(torch.device("cuda")) == 256 and P.default_batch_size(torch.device("cpu")) == 64


@pytest.mark.slow
def test_ray_backend_writes_the_same_bytes_as_the_local_one(tmp_path, photos):
    ray = pytest.importorskip("ray")
    args = dict(dataset="imagefolder", data_root=photos, backbone=BACKBONES, image_size=32, batch_size=3)
    with one_thread():
        local = extract(**args, out=tmp_path / "local")
    ray.init(num_cpus=2, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        remote = extract(**args, backend="ray", out=tmp_path / "ray")
        again = extract(**args, backend="ray", out=tmp_path / "ray")
    finally:
        ray.shutdown()
    assert Path(remote["cache"]).name == Path(local["cache"]).name and sha256(remote["cache"]) == sha256(local["cache"])
    assert not remote["cache_hit"] and again["cache_hit"]
    filled = store_files(tmp_path / "ray")
    assert sum(Path(f).parent.name == "store" for f in filled) == 2  # one store per backbone
    assert filled == store_files(tmp_path / "local")  # the stores the Ray tasks filled hold the local pass's bytes
    # the cache, the store folder, its stores, their segment folders and segments, the sidecar of the images'
    # hashes: no parts folder, no partial
    sidecars = [f"store/{p.name}" for p in (tmp_path / "ray" / "store").glob(".contents-*.json")]
    folders = {str(Path(f).parent) for f in filled if f.count("/") == 2}
    assert len(sidecars) == 1 and everything_in(tmp_path / "ray") == sorted(
        [Path(local["cache"]).name, "store", *sidecars, *folders, *filled]
    )


def test_tasks_of_one_store_that_finish_together_fill_it_as_one_pass(tmp_path, photos, monkeypatch):
    """The Ray backend's shares of one fill, run here as two threads, write each backbone's meta.json at the same
    moment: each task waits at a barrier with its file written, then both rename it (under a temporary name shared by
    the writers, the second rename found nothing: FileNotFoundError). The fill ends with the bytes of a local one."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import contextmanager
    from dataclasses import replace
    from threading import Barrier, Lock

    from featcache.extraction import embed as E
    from featcache.extraction import plan

    together, original, built = Barrier(2, timeout=60), E.synced, E.build
    met: list[str] = []
    one_at_a_time = Lock()  # random weights are drawn from torch's one global generator: a process of its own each

    def build(run, j: int):
        with one_at_a_time:
            return built(run, j)

    @contextmanager
    def synced(path):
        try:
            with original(path) as fh:
                yield fh
                if path.name == "meta.json":
                    together.wait()  # both tasks' files written, neither renamed
                    met.append(path.parent.name)
        except BaseException:
            together.abort()  # the other task waits no more
            raise

    class Threads:
        """`Ray.embed`'s shares (every second block) as threads, each building its own backbones."""

        def device(self, name: str) -> str:
            return "cpu"

        def embed(self, blocks, data, run, progress, phases) -> dict:
            shares = [blocks[i::2] for i in range(2)]
            with ThreadPoolExecutor(2) as pool:
                found = list(pool.map(lambda share: E.embed(share, data, replace(run, workers=0)), shares))
            return found[0] | found[1]

    args = dict(dataset="imagefolder", data_root=photos, backbone=BACKBONES, image_size=32, batch_size=3, workers=0)
    with one_thread():
        local = extract(**args, out=tmp_path / "local")
        monkeypatch.setattr(E, "synced", synced)
        monkeypatch.setattr(E, "build", build)
        monkeypatch.setitem(plan.BACKENDS, "threads", Threads)
        monkeypatch.setattr(P, "cores", lambda: 2)  # every forward on one thread, as the local pass's
        tasks = extract(**args, backend="threads", out=tmp_path / "tasks")
    assert len(met) == 2 * len(BACKBONES)  # each backbone's meta.json written by both tasks at once
    assert sha256(tasks["cache"]) == sha256(local["cache"]) and not any((tmp_path / "tasks").rglob("*.partial"))
    for store in (tmp_path / "local" / "store").glob("*.h5"):
        assert sha256(tmp_path / "tasks" / "store" / store.name) == sha256(store)


def test_a_client_without_test_images_gets_empty_blocks(tmp_path):
    from fixtures_disk import write_digit5

    write_digit5(tmp_path / "d", folders=("MNIST",), parts=10, per_part=2, n_test=5)
    res = extract(
        dataset="digit5",
        data_root=tmp_path / "d",
        backbone=["test_resnet=random"],
        image_size=32,
        per_class=1,
        domains=["mnist"],
        test_split="train-mix",  # test images of the train classes only: none here (the whole split has some)
        out=tmp_path / "out",
    )
    with h5py.File(res["cache"]) as f:
        sizes = np.diff(f["test/offsets"][...]).tolist()
        assert 0 in sizes and C.client_rows(f, "train", 0).shape[0] > 0


def _chunks(rows: int, views: int, sides: list[int]) -> P.Chunks:
    chunk = P.Chunk(0, "d", "train", np.arange(rows), views)
    return P.Chunks(None, [chunk], [P.Geometry(s, s, "bicubic") for s in sides], None, 0)


def _free(monkeypatch, free: int | None) -> None:
    def statvfs(path):
        if free is None:
            raise FileNotFoundError(path)
        return type("Stat", (), {"f_bavail": free // 4096, "f_frsize": 4096})()

    monkeypatch.setattr(P.os, "statvfs", statvfs)


@pytest.mark.parametrize(
    "free,workers,expected",
    [(64 << 20, 2, 1), (8 << 30, 2, 4), (128 << 20, 2, 3), (1 << 20, 16, 1), (None, 2, 4)],
)
def test_prefetch_keeps_the_chunks_in_flight_within_half_the_free_shared_memory(monkeypatch, free, workers, expected):
    """A container's 64 MB /dev/shm: one 224 px chunk of 64 images ahead per worker, not four (which failed there);
    no /dev/shm (macOS): torch's default depth."""
    _free(monkeypatch, free)
    assert P.prefetch(_chunks(64, 0, [224]), workers) == expected


@settings(max_examples=200, deadline=None)
@given(
    free=st.integers(0, 1 << 34),
    workers=st.integers(1, 32),
    rows=st.integers(1, 256),
    views=st.integers(0, 4),
    sides=st.lists(st.integers(16, 512), min_size=1, max_size=3),
)
def test_prefetch_is_1_to_4_and_fits_whenever_above_1(free, workers, rows, views, sides):
    with pytest.MonkeyPatch.context() as m:
        _free(m, free)
        depth = P.prefetch(_chunks(rows, views, sides), workers)
    size = rows * max(views, 1) * 3 * sum(s * s for s in sides)
    assert 1 <= depth <= 4 and (depth == 1 or depth * workers * size <= (free // 4096 * 4096) // 2)
