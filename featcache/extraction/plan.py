"""`featcache extract`: run each frozen backbone once over every client's images and stream the embeddings to HDF5.

The cache key is computed before any model or image is touched, from everything that determines the embeddings
(dataset identity, partition, backbone weights, preprocessing options and pipeline, views, noise, seed, precision,
library versions), so a repeated command is a cache hit that costs a hash and a file lookup.

A miss builds every backbone once and makes one pass over the images (`pipeline.py`: each image decoded once, resized
and normalised for each backbone as batched tensor ops, per-image work in worker processes): each (client, split)
block's chunks are embedded by every backbone that still needs the block, and each backbone's rows of the block are
streamed to `.<cache>.parts/b{j}.*.npy.partial`, synced and renamed into place only when complete, so a killed
extraction resumes from its finished blocks (`--backend ray` runs shares of the blocks as Ray tasks, one per GPU, into
the same folder). Each backbone's metadata `b{j}.json` follows its blocks. `cache.write` then assembles the HDF5
file inside the parts folder, each backbone's blocks becoming its columns of the one `concat` array (hashed as they
are written), syncs it and renames it into place. An exclusive lock on the parts folder keeps two extractions of the
same cache from writing at once (the second waits, then finds the cache); readers only ever see finished caches.

When a run fails: a kill or Ctrl-C keeps the finished blocks (the same command resumes); a full disk keeps them too
and says so in one line (free space, run the same command again); any other error (bad input) removes the parts
folder when this run created it. Partial files never survive a failure that Python sees.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import time
from collections import deque
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .. import cache as C
from .identity import code_identity, content_key, versions
from . import pipeline as P
from .datasets import dataset_identity, keep_dataset, load_dataset
from ..devices import resolve_device
from ..errors import UserError
from .partition import PartitionSpec, make_partition, partition_counts

Progress = Callable[[str, int, int], None]  # (task label, items done so far, total items)
SPLITS = ("train", "test")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, quota, file size limit


class DiskFullError(UserError):
    """The disk filled up while writing; finished blocks are kept so the same command resumes."""


@dataclass(frozen=True)
class Noise:
    """Image-space privacy noise x~ = (1 - p) x + e, e ~ Laplace/Gaussian(0, scale) on [0, 1] pixels (Tan et al.,
    FedPCL, NeurIPS 2022, App. A.2.4)."""

    kind: str  # 'laplace' | 'gaussian'
    scale: float
    p: float

    def __post_init__(self):
        if self.kind not in _NOISE:
            raise UserError(f"unknown noise {self.kind!r}: use laplace or gaussian")
        if not 0 <= self.p < 1 or self.scale < 0:
            raise UserError(f"noise needs 0 <= p < 1 and scale >= 0 (got p={self.p}, scale={self.scale})")

    def apply(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 [H, W, 3] -> uint8 [H, W, 3], noised on [0, 1] pixels and rounded."""
        x = image.astype(np.float32) / 255.0  # [H, W, 3]
        x = (1 - self.p) * x + _NOISE[self.kind](rng, self.scale, x.shape)
        return (np.clip(x, 0, 1) * 255 + 0.5).astype(np.uint8)


_NOISE = {
    "laplace": lambda rng, s, shape: rng.laplace(0.0, s, shape).astype(np.float32),
    "gaussian": lambda rng, s, shape: rng.normal(0.0, s, shape).astype(np.float32),
}


def extract(
    dataset: str = "offline-digits",
    backbone: list[str] = ("efficientnet_lite0",),
    partition: str = "feature",
    clients: int | None = None,
    alpha: float = 0.5,
    per_class: int | None = None,
    test_per_class: int | None = None,
    classes_per_client: int = 2,
    domains: list[str] | None = None,
    val_fraction: float = 0.2,
    order: str = "shuffled",
    image_size: int | None = None,
    views: int = 0,
    noise: Noise | None = None,
    seed: int = 0,
    data_root: str | Path | None = None,
    download: bool = False,
    out: str | Path = "cache",
    batch_size: int | None = None,
    workers: int | None = None,
    device: str = "auto",
    backend: str = "local",
    allow_partial: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Extract (or find cached) embeddings; returns {cache, cache_hit, key, images, backbones, seconds}.

    `batch_size` (images per forward) and `workers` (input worker processes) default from the device and the
    dataset (`pipeline.default_batch_size`, `pipeline.default_workers`); neither changes the cache's bytes on one
    machine. `backend` 'ray' runs the blocks as Ray tasks. `allow_partial` loads checkpoints whose keys do not all
    match (the rest keeps a seeded random init)."""
    t0 = time.perf_counter()
    backbone = list(backbone)
    if not backbone:
        raise UserError("no backbone given: pass --backbone NAME (e.g. efficientnet_lite0)")
    if len(set(backbone)) != len(backbone):
        raise UserError(f"backbone listed twice in {backbone}: give each once")
    for flag, value, least in (("--views", views, 0), ("--workers", workers, 0), ("--batch-size", batch_size, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be >= {least} (got {value})")
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: use {' or '.join(BACKENDS)}")
    spec = PartitionSpec(
        scheme=partition, clients=clients, alpha=alpha, per_class=per_class, test_per_class=test_per_class,
        classes_per_client=classes_per_client, domains=tuple(domains) if domains else None,
        val_fraction=val_fraction, order=order, seed=seed,
    )
    from .backbones import weights_identity

    runner = BACKENDS[backend]()
    dev = runner.device(device)
    identity, data = dataset_identity(dataset, data_root, download)
    manifest = {
        "dataset": identity,
        "partition": spec.to_dict(),
        "backbones": [weights_identity(b) for b in backbone],
        "image_size": image_size,
        "views": views,
        "noise": asdict(noise) if noise else None,
        "seed": seed,
        "pipeline": P.DESCRIPTION,
        "code": code_identity()["sha256"],  # featcache's own preprocessing code (cache.PREPROCESSING_CODE)
        "precision": "float16" if dev.type == "cuda" else "float32",  # CUDA runs under fp16 autocast
        "allow_partial": allow_partial,
        "versions": versions(),
    }
    key = content_key(manifest)
    path = C.cache_path(Path(out), dataset, key)
    work = path.with_name(f".{path.name}.parts")  # finished (backbone, client, split) blocks: the resume point
    if path.is_file():
        _drop_leftover(work)
        return _hit(path, key, t0)

    phases = dict.fromkeys(("dataset", "models", "embedding", "assembly"), 0.0)  # seconds, for the report
    t = time.perf_counter()
    data = data or load_dataset(dataset, data_root, download=download, store=Path(out))
    _refuse_empty_classes(data)
    parts = make_partition(data, spec)
    phases["dataset"] = time.perf_counter() - t
    with _writing(work):
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(work) as resuming:
            if path.is_file():  # another process finished it while we waited for the lock
                shutil.rmtree(work)
                return _hit(path, key, t0)
            try:
                run = Settings(tuple(backbone), image_size, noise, seed, batch_size or P.default_batch_size(dev),
                               P.default_workers(data, views) if workers is None else workers, str(dev),
                               allow_partial)
                metas = _distinct_keys(_embedded(work, runner, data, parts, views, run, progress, phases))
                t = time.perf_counter()
                images = _assemble(path, work, data, parts, metas, manifest, key, views)
                phases["assembly"] = time.perf_counter() - t
            except BaseException as e:
                for partial in work.glob("*.partial"):
                    partial.unlink()
                if not (resuming or isinstance(e, (KeyboardInterrupt, DiskFullError))):
                    shutil.rmtree(work, ignore_errors=True)  # bad input: nothing of this run is worth keeping
                raise
            shutil.rmtree(work)
    with suppress(OSError):  # a built-in dataset's next miss reads its arrays instead of building them
        keep_dataset(data, out)
    return _result(path, False, key, images, [m["key"] for m in metas], t0) | {
        "phases": {k: round(v, 3) for k, v in phases.items()}}


def _refuse_empty_classes(data) -> None:
    """A class without a single image in any domain could be neither learned nor tested (an empty class folder)."""
    seen = sum(np.bincount(images.labels, minlength=len(data.classes))[: len(data.classes)]
               for splits in data.domains.values() for images in splits.values())  # [K] images per class
    empty = [c for c, n in zip(data.classes, seen) if n == 0]
    if empty:
        raise UserError(f"{data.name}: class {empty[0]!r} has no images in any domain (an empty class folder?): "
                        "add images of it or remove it")


@contextmanager
def _writing(target: Path) -> Iterator[None]:
    """Turn a full disk (or quota, or file size limit) while writing `target` into one `DiskFullError` line."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # HDF5 reports a failed write as a RuntimeError naming the errno
        found = re.search(r"errno = (\d+)", str(e))
        code = getattr(e, "errno", None) or (int(found.group(1)) if found else None)
        if code not in _DISK_FULL:
            raise
        raise DiskFullError(f"disk full while writing {target} ({os.strerror(code)}): free space and run the same "
                            "command again; finished blocks are kept and resumed") from None


@contextmanager
def _locked(work: Path) -> Iterator[bool]:
    """Hold the exclusive lock of the work folder; yields whether it holds finished blocks to resume from.
    The holder may delete the folder: a waiter then finds its lock file unlinked, and locks the new folder instead."""
    while True:
        work.mkdir(exist_ok=True)
        try:
            lock = open(work / "lock", "a")
        except FileNotFoundError:  # the holder removed the folder between our mkdir and open
            continue
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _same_file(lock, work / "lock"):
                yield any(work.glob("b*.npy")) or any(work.glob("b*.json"))
                return


def _same_file(handle, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev)


def _drop_leftover(work: Path) -> None:
    """Remove a parts folder left behind by an extraction killed after its final rename (when nobody holds it)."""
    try:
        with open(work / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(lock, work / "lock"):
                shutil.rmtree(work)
    except (FileNotFoundError, BlockingIOError):
        pass


@contextmanager
def _synced(path: Path) -> Iterator:
    """A file handle on `path.partial`; when the block ends without error the file is synced and renamed to `path`,
    so `path` exists only complete. Plain writes, not a memory map: a full disk is an OSError, never a SIGBUS."""
    partial = path.with_name(path.name + ".partial")
    with _writing(path), open(partial, "wb") as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)


@dataclass(frozen=True)
class Block:
    """One client's split, as plain features or as augmented views, for every backbone: the unit of resume."""

    client: int
    domain: str
    split: str
    views: int  # 0: features [n, D]; V: views [n, V, D]
    rows: np.ndarray  # [n] indices into data.domains[domain][split]

    def file(self, j: int) -> str:
        return f"b{j}.{self.client:03d}.{self.split}.{'views' if self.views else 'features'}.npy"


@dataclass(frozen=True)
class Settings:
    """What the embedding pass needs besides the images: the same for the local and the Ray backend."""

    specs: tuple[str, ...]
    image_size: int | None
    noise: Noise | None
    seed: int
    batch_size: int
    workers: int
    device: str
    allow_partial: bool


def _embedded(work: Path, runner, data, parts, views: int, run: Settings, progress, phases: dict) -> list[dict]:
    """Every block of every backbone in `work` (finished ones kept), then each backbone's `b{j}.json` metadata;
    returns the metadata in backbone order."""
    blocks, meta_files = _blocks(parts, views), [work / f"b{j}.json" for j in range(len(run.specs))]
    jobs = [(block, todo) for block in blocks
            if (todo := [j for j in range(len(run.specs)) if not (work / block.file(j)).is_file()])]
    metas = runner.embed(work, jobs, data, run, progress, phases) if jobs else {}
    for j, file in enumerate(meta_files):
        if not file.is_file():
            meta = metas.get(j) or _metadata(_build(run, j))  # all its blocks survived a kill, its metadata did not
            with _synced(file) as fh:
                fh.write(json.dumps(meta).encode())
    return [json.loads(file.read_text()) for file in meta_files]


def _build(run: Settings, j: int):
    from .backbones import create_backbone

    return create_backbone(run.specs[j], image_size=run.image_size, allow_partial=run.allow_partial)


def _metadata(bb) -> dict:
    return {"key": bb.key, "name": bb.name, "weights": bb.weights, "weights_sha256": bb.weights_sha256,
            "dim": bb.dim, "preprocessing": bb.preprocessing | {"pipeline": P.DESCRIPTION}}


def _rows_to_embed(jobs: list[tuple[Block, list[int]]]) -> dict[int, int]:
    """Backbone index -> the rows `jobs` embed with it (the progress total)."""
    total: dict[int, int] = {}
    for block, js in jobs:
        for j in js:
            total[j] = total.get(j, 0) + len(block.rows)
    return total


def _blocks(parts, views: int) -> list[Block]:
    return [Block(c, part.domain, split, v, getattr(part, split)) for c, part in enumerate(parts) for split in SPLITS
            for v in ((0, views) if views and split == "train" else (0,))]


def _embed(work: Path, jobs: list[tuple[Block, list[int]]], data, run: Settings, progress: Progress | None = None,
           phases: dict | None = None) -> dict[int, dict]:
    """One pass over the images of `jobs` (block, the backbones that still need it): each chunk of images is decoded
    once and embedded by every backbone that needs it; each block's rows are streamed to `work/b{j}.*.npy.partial`,
    renamed into place when the block is complete. Builds each backbone once; returns their metadata by index."""
    t = time.perf_counter()
    dev = torch.device(run.device)
    needed = sorted({j for _, js in jobs for j in js})
    built = {j: _build(run, j) for j in needed}
    models = {j: bb.model.to(dev, memory_format=torch.channels_last) for j, bb in built.items()}
    inputs = {j: (P.Geometry.of(bb.preprocessing), tuple(bb.preprocessing["mean"]), tuple(bb.preprocessing["std"]))
              for j, bb in built.items()}  # backbones with the same (geometry, mean, std) share one float input
    chunks = [P.Chunk(b, block.domain, block.split, block.rows[r : r + run.batch_size], block.views)
              for b, (block, _) in enumerate(jobs) for r in range(0, len(block.rows), run.batch_size)]
    source = P.Chunks(data, chunks, list(dict.fromkeys(g for g, _, _ in inputs.values())), run.noise, run.seed)
    total, done = _rows_to_embed(jobs), dict.fromkeys(needed, 0)
    if phases is not None:
        phases["models"] += (t1 := time.perf_counter()) - t
    for block, js in jobs:  # a client with no rows in a split (no chunk will visit it): empty blocks
        if len(block.rows) == 0:
            for j in js:
                with _block_file(work / block.file(j), 0, block.views, built[j].dim):
                    pass
    writer = _Writer(dev, lag=len(needed))
    with torch.inference_mode():
        for b, prepared in itertools.groupby(P.loader(source, run.workers, dev), key=lambda item: item[0]):
            block, js = jobs[b]
            with ExitStack() as files:
                fh = {j: files.enter_context(_block_file(work / block.file(j), len(block.rows), block.views,
                                                         built[j].dim)) for j in js}
                for _, images in prepared:
                    x = P.to_device(images, source.geometries, dev)  # {geometry: [B*V, 3, H, W] uint8}
                    floats = {}  # (geometry, mean, std) -> [B*V, 3, H, W] float32
                    for j in js:
                        if (key := inputs[j]) not in floats:
                            floats[key] = P.normalise(x[key[0]], key[1], key[2])
                        z = _forward(models[j], floats[key], dev)  # [B*V, D]
                        writer.put(fh[j], z)
                        done[j] += len(z) // max(block.views, 1)
                        if progress:
                            progress(built[j].key, done[j], total[j])
                writer.flush()
    if phases is not None:
        phases["embedding"] += time.perf_counter() - t1
    return {j: _metadata(bb) for j, bb in built.items()}


@contextmanager
def _block_file(path: Path, rows: int, views: int, dim: int) -> Iterator:
    """An open `.npy` of float32 [rows, dim] (or [rows, views, dim]) filled by plain writes, complete or absent."""
    with _synced(path) as fh:
        shape = (rows, views, dim) if views else (rows, dim)
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": shape})
        yield fh


class _Writer:
    """Writes embedded rows to their block files. On CUDA a batch's device-to-host copy is started at once and
    written `lag` batches later, so the copy and the disk write overlap the next forward passes."""

    def __init__(self, dev: torch.device, lag: int) -> None:
        self.cuda, self.lag, self.pending = dev.type == "cuda", lag, deque()

    def put(self, fh, z: torch.Tensor) -> None:
        if not self.cuda:
            fh.write(z.numpy().astype("<f4", copy=False).tobytes())
            return
        host = z.to("cpu", non_blocking=True)  # into pinned memory
        done = torch.cuda.Event()
        done.record()
        self.pending.append((fh, host, done))
        while len(self.pending) > self.lag:
            self._write_oldest()

    def flush(self) -> None:
        while self.pending:
            self._write_oldest()

    def _write_oldest(self) -> None:
        fh, host, done = self.pending.popleft()
        done.synchronize()
        fh.write(host.numpy().astype("<f4", copy=False).tobytes())


def _forward(model, x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """[B, 3, H, W] float32 on the device -> [B, D] float32 on the device (fp16 autocast on CUDA)."""
    with torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
        return model(x).float()


def _assemble(path: Path, work: Path, data, parts, metas, manifest, key, views) -> int:
    """Write the HDF5 cache from the finished blocks inside `work` (`cache.write`: each backbone's block becomes its
    columns of `concat`, hashed as written, synced and renamed into place); returns the number of images."""
    domains = list(dict.fromkeys(p.domain for p in parts))  # the domains clients hold, in client order
    header = {"key": key, "manifest": manifest, "dataset": data.name, "classes": list(data.classes),
              "domains": domains, "partition": manifest["partition"], "counts": partition_counts(data, parts),
              "views": manifest["views"], "versions": manifest["versions"]}
    with _writing(path):
        return C.write(path, header, metas, _clients(work, data, parts, len(metas), views),
                       partial=work / "cache.h5.partial")


def _distinct_keys(metas: list[dict]) -> list[dict]:
    """Backbones whose keys coincide (two checkpoints named alike in different folders) get '-2', '-3', ... in the
    order given, so each has its own group and columns."""
    seen: dict[str, int] = {}
    out = []
    for meta in metas:
        n = seen[meta["key"]] = seen.get(meta["key"], 0) + 1
        out.append(meta if n == 1 else meta | {"key": f"{meta['key']}-{n}"})
    return out


def _clients(work: Path, data, parts, backbones: int, views: int) -> Iterator[C.Client]:
    """Each client as `cache.write` takes it, its features the block files of every backbone (memory-mapped)."""
    for c, part in enumerate(parts):
        blocks = lambda split, group: [np.load(work / f"b{j}.{c:03d}.{split}.{group}.npy", mmap_mode="r")
                                       for j in range(backbones)]  # each [n, D_j] or [n, V, D_j]
        splits = {split: C.Split(data.domains[part.domain][split].labels[getattr(part, split)], getattr(part, split),
                                 blocks(split, "features"), blocks(split, "views") if views and split == "train"
                                 else None)
                  for split in SPLITS}
        yield C.Client(part.domain, splits["train"], splits["test"], part.val)


def _hit(path: Path, key: str, t0: float) -> dict:
    with C.open_cache(path) as f:
        return _result(path, True, key, int(f.attrs["images"]), C.read_attrs(f)["backbones"], t0)


def _result(path: Path, hit: bool, key: str, images: int, keys: list[str], t0: float) -> dict:
    return {"cache": str(path), "cache_hit": hit, "key": key, "images": images, "backbones": keys,
            "seconds": round(time.perf_counter() - t0, 3)}


class Local:
    """Blocks embedded in this process (input workers as child processes)."""

    def device(self, name: str) -> torch.device:
        return resolve_device(name)

    def embed(self, work, jobs, data, run, progress, phases) -> dict[int, dict]:
        return _embed(work, jobs, data, run, progress, phases)


class Ray:
    """Blocks as Ray tasks: one per GPU of the cluster, each building the backbones once and embedding its share of
    the blocks into the parts folder (which must be the same path on every node: a shared filesystem), or one per CPU
    where the cluster has no GPU. `ray.init()` joins RAY_ADDRESS when set, else starts a local Ray. This process
    keeps the lock, resumes and assembles exactly as the local backend does, so the cache bytes are the same."""

    def __init__(self) -> None:
        try:
            import ray
        except ImportError:
            raise UserError("--backend ray needs Ray: pip install 'featcache[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
        resources = ray.cluster_resources()
        self.ray, self.gpus, self.cpus = ray, int(resources.get("GPU", 0)), max(1, int(resources.get("CPU", 1)))

    def device(self, name: str) -> torch.device:
        if name not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device {name} with --backend ray: use auto, cpu or cuda (Ray assigns the GPUs)")
        if name == "cuda" and not self.gpus:
            raise UserError("--device cuda asked for but the Ray cluster has no GPU: use --device cpu")
        return torch.device("cuda" if name != "cpu" and self.gpus else "cpu")

    def embed(self, work, jobs, data, run, progress, phases) -> dict[int, dict]:
        t = time.perf_counter()
        cuda = run.device == "cuda"
        tasks = min(len(jobs), self.gpus if cuda else self.cpus)
        cpus = max(1, self.cpus // self.gpus) if cuda else 1
        task = self.ray.remote(num_gpus=1 if cuda else 0, num_cpus=cpus)(_embed)
        run = replace(run, workers=min(run.workers, cpus if cuda else 0))
        shared = self.ray.put(data)
        pending = {task.remote(work, jobs[i::tasks], shared, run): jobs[i::tasks] for i in range(tasks)}
        metas, done, total = {}, {}, _rows_to_embed(jobs)
        while pending:
            (finished,), _ = self.ray.wait(list(pending), num_returns=1)
            share = pending.pop(finished)
            try:
                metas |= self.ray.get(finished)
            except self.ray.exceptions.RayTaskError as e:  # keep a user error one line, not the task's traceback
                raise (e.cause if isinstance(e.cause, UserError) else e) from None
            for block, todo in share:
                for j in todo:
                    done[j] = done.get(j, 0) + len(block.rows)
                    if progress:
                        progress(metas[j]["key"], done[j], total[j])
        phases["embedding"] += time.perf_counter() - t
        return metas


BACKENDS = {"local": Local, "ray": Ray}
