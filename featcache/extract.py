"""`featcache extract`: run each frozen backbone once over every client's images and stream the embeddings to HDF5.

The cache key is computed before any model or image is touched, from everything that determines the embeddings
(dataset identity, partition, backbone weights, preprocessing options, views, noise, seed, precision, library
versions), so a repeated command is a cache hit that costs a hash and a file lookup. A miss embeds one (backbone,
client, split) block at a time into `.<cache>.parts/`, each block written to `*.partial`, synced and renamed into
place only when complete, so a killed extraction resumes from its finished blocks; the HDF5 file is then assembled
inside the parts folder, sealed with checksums (`cache.seal`), synced and renamed into place. An exclusive lock on the
parts folder keeps two extractions of the same cache from writing at once (the second waits, then finds the cache);
readers only ever see finished caches.

When a run fails: a kill or Ctrl-C keeps the finished blocks (the same command resumes); a full disk keeps them too
and says so in one line (free space, run the same command again); any other error (bad input) removes the parts
folder when this run created it. Partial files never survive a failure that Python sees.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import h5py
import numpy as np
import torch
from PIL import Image

from . import cache as C
from .datasets import dataset_identity, load_dataset
from .errors import UserError
from .partition import PartitionSpec, make_partition, partition_counts

Progress = Callable[[str, int, int], None]  # (task label, items done so far, total items)
SPLITS = ("train", "test")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, quota, file size limit


class DiskFullError(UserError):
    """The disk filled up while writing; finished blocks are kept so the same command resumes."""


@dataclass(frozen=True)
class Noise:
    """Image-space privacy noise x~ = (1 - p) x + e, e ~ Laplace/Gaussian(0, scale) on [0, 1] pixels (FedPCL A.2.4)."""

    kind: str  # 'laplace' | 'gaussian'
    scale: float
    p: float

    def __post_init__(self):
        if self.kind not in _NOISE:
            raise UserError(f"unknown noise {self.kind!r}: use laplace or gaussian")
        if not 0 <= self.p < 1 or self.scale < 0:
            raise UserError(f"noise needs 0 <= p < 1 and scale >= 0 (got p={self.p}, scale={self.scale})")

    def apply(self, img: Image.Image, rng: np.random.Generator) -> Image.Image:
        x = np.asarray(img, dtype=np.float32) / 255.0  # [H, W, 3]
        x = (1 - self.p) * x + _NOISE[self.kind](rng, self.scale, x.shape)
        return Image.fromarray((np.clip(x, 0, 1) * 255 + 0.5).astype(np.uint8))


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
    image_size: int | None = None,
    views: int = 0,
    noise: Noise | None = None,
    seed: int = 0,
    data_root: str | Path | None = None,
    download: bool = False,
    out: str | Path = "cache",
    batch_size: int = 64,
    device: str = "auto",
    allow_partial: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Extract (or find cached) embeddings; returns {cache, cache_hit, key, images, backbones, seconds}.
    `allow_partial` loads checkpoints whose keys do not all match (the rest keeps a seeded random init)."""
    t0 = time.perf_counter()
    backbone = list(backbone)
    if not backbone:
        raise UserError("no backbone given: pass --backbone NAME (e.g. efficientnet_lite0)")
    if len(set(backbone)) != len(backbone):
        raise UserError(f"backbone listed twice in {backbone}: give each once")
    if views < 0 or batch_size < 1:
        raise UserError(f"--views must be >= 0 and --batch-size >= 1 (got {views}, {batch_size})")
    spec = PartitionSpec(
        scheme=partition, clients=clients, alpha=alpha, per_class=per_class, test_per_class=test_per_class,
        classes_per_client=classes_per_client, domains=tuple(domains) if domains else None,
        val_fraction=val_fraction, seed=seed,
    )
    from .backbones import weights_identity

    dev = _device(device)
    identity, data = dataset_identity(dataset, data_root, download)
    manifest = {
        "dataset": identity,
        "partition": spec.to_dict(),
        "backbones": [weights_identity(b) for b in backbone],
        "image_size": image_size,
        "views": views,
        "noise": asdict(noise) if noise else None,
        "seed": seed,
        "precision": "float16" if dev.type == "cuda" else "float32",  # CUDA runs under fp16 autocast
        "allow_partial": allow_partial,
        "versions": C.versions(),
    }
    key = C.cache_key(manifest)
    path = C.cache_path(Path(out), dataset, key)
    work = path.with_name(f".{path.name}.parts")  # finished (backbone, client, split) blocks: the resume point
    if path.is_file():
        _drop_leftover(work)
        return _hit(path, key, t0)

    phases = dict.fromkeys(("dataset", "models", "embedding", "assembly"), 0.0)  # seconds, for the report
    t = time.perf_counter()
    data = data or load_dataset(dataset, data_root, download=download)
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
                metas = [_backbone_blocks(work, j, spec_j, data, parts, image_size, views, noise, seed, batch_size,
                                          dev, allow_partial, progress, phases) for j, spec_j in enumerate(backbone)]
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


def _backbone_blocks(work: Path, j: int, spec: str, data, parts, image_size, views, noise, seed, batch_size, dev,
                     allow_partial, progress, phases: dict) -> dict:
    """Embed every (client, split[, views]) block of backbone j into work/b{j}.*.npy, skipping finished blocks.
    Returns the backbone's metadata (also saved, so a finished backbone is never rebuilt on resume); adds the
    seconds spent building the model and embedding to `phases`."""
    meta_file = work / f"b{j}.json"
    jobs = [(c, part, split, v) for c, part in enumerate(parts) for split in SPLITS
            for v in ((0, views) if views and split == "train" else (0,))]
    blocks = [work / f"b{j}.{c:03d}.{split}.{'views' if v else 'features'}.npy" for c, _, split, v in jobs]
    if meta_file.is_file() and all(b.is_file() for b in blocks):
        return json.loads(meta_file.read_text())
    from .backbones import create_backbone

    t = time.perf_counter()
    bb = create_backbone(spec, image_size=image_size, allow_partial=allow_partial)
    meta = {"key": bb.key, "name": bb.name, "weights": bb.weights, "weights_sha256": bb.weights_sha256,
            "dim": bb.dim, "preprocessing": bb.preprocessing}
    model = bb.model.to(dev)
    if dev.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    total = sum(len(getattr(p, s)) for _, p, s, _ in jobs)
    phases["models"] += (t1 := time.perf_counter()) - t
    done = 0
    for (c, part, split, v), block in zip(jobs, blocks):
        idx = getattr(part, split)  # [n]
        if block.is_file():
            done += len(idx)
            continue
        shape = (len(idx), v, bb.dim) if v else (len(idx), bb.dim)
        with _synced(block) as fh:
            np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": shape})
            for x in _batches(bb, data.domains[part.domain][split], part.domain, split, idx, v, noise, seed,
                              batch_size):
                z = _forward(model, x, dev)  # [B*max(v,1), D] float32: an image's views are consecutive rows
                fh.write(z.astype("<f4", copy=False).tobytes())
                done += len(z) // max(v, 1)
                if progress:
                    progress(bb.key, done, total)
    phases["embedding"] += time.perf_counter() - t1
    with _synced(meta_file) as fh:
        fh.write(json.dumps(meta).encode())
    return meta


@torch.inference_mode()
def _forward(model, x: torch.Tensor, dev: torch.device) -> np.ndarray:
    x = x.to(dev, non_blocking=True)
    cuda = dev.type == "cuda"
    if cuda:
        x = x.to(memory_format=torch.channels_last)
    with torch.autocast(dev.type, dtype=torch.float16, enabled=cuda):
        return model(x).float().cpu().numpy()


def _assemble(path: Path, work: Path, data, parts, metas, manifest, key, views, rows_per_block: int = 4096) -> int:
    """Write the HDF5 cache from the finished blocks inside `work`, seal it with checksums, sync it and rename it
    into place."""
    partial = work / "cache.h5.partial"
    with _writing(path), _create_h5(partial) as f:
        images = _write_layout(f, data, parts, metas, manifest, key)
        for c in range(len(parts)):
            for split in SPLITS:
                for group in ("features", "views") if views and split == "train" else ("features",):
                    blocks = [np.load(work / f"b{j}.{c:03d}.{split}.{group}.npy", mmap_mode="r")
                              for j in range(len(metas))]
                    g = f[f"clients/{c:03d}/{split}"]
                    for m, b in zip(metas, blocks):
                        g.create_dataset(f"{group}/{m['key']}", data=b, track_times=False)
                    shape = (*blocks[0].shape[:-1], sum(b.shape[-1] for b in blocks))
                    cat = g.create_dataset(f"{group}/concat", shape, "f4", track_times=False)
                    for r in range(0, shape[0], rows_per_block):
                        cat[r : r + rows_per_block] = np.concatenate([b[r : r + rows_per_block] for b in blocks], -1)
        C.seal(f)
    with _writing(path), open(partial, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(partial, path)
    _sync_folder(path.parent)
    return images


def _create_h5(path: Path) -> h5py.File:
    """A new HDF5 file as `h5py.File(path, "w", track_order=True)` creates it, but without HDF5's sieve buffer: raw
    data reaches the disk when a dataset is written, so a full disk fails that write. With the buffer the failure
    surfaces while datasets close, leaving them half-closed, and freeing them later crashes the interpreter."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_sieve_buf_size(0)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    order = h5py.h5p.CRT_ORDER_TRACKED | h5py.h5p.CRT_ORDER_INDEXED
    fcpl.set_link_creation_order(order)
    fcpl.set_attr_creation_order(order)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (the new name survives a power cut, not only a kill)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hit(path: Path, key: str, t0: float) -> dict:
    with C.open_cache(path) as f:
        return _result(path, True, key, int(f.attrs["images"]), C.read_attrs(f)["backbones"], t0)


def _result(path: Path, hit: bool, key: str, images: int, keys: list[str], t0: float) -> dict:
    return {"cache": str(path), "cache_hit": hit, "key": key, "images": images, "backbones": keys,
            "seconds": round(time.perf_counter() - t0, 3)}


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for but CUDA is not available: use --device cpu")
    return torch.device(device)


def _write_layout(f: h5py.File, data, parts, metas: list[dict], manifest: dict, key: str) -> int:
    """Root attributes, backbone metadata and every client's labels; returns the number of images (train + test).
    No timestamps: the same inputs give a byte-identical file."""
    domains = list(dict.fromkeys(p.domain for p in parts))  # the domains clients hold, in client order
    C.write_attrs(f, {
        "featcache_format": C.FORMAT, "featcache_version": C.versions()["featcache"], "key": key,
        "manifest": manifest, "backbones": [m["key"] for m in metas], "classes": list(data.classes),
        "domains": domains, "dataset": data.name, "partition": manifest["partition"],
        "counts": partition_counts(data, parts), "views": manifest["views"], "versions": manifest["versions"],
    })
    for m in metas:
        C.write_attrs(f.create_group(f"backbones/{m['key']}"), {k: v for k, v in m.items() if k != "key"})
    images = 0
    for c, part in enumerate(parts):
        g = f.create_group(f"clients/{c:03d}")
        g.attrs["domain"] = part.domain
        for split in SPLITS:
            idx = getattr(part, split)  # [n] int64
            s = g.create_group(split)
            s.create_dataset("labels", data=data.domains[part.domain][split].labels[idx], track_times=False)
            s.create_dataset("source_index", data=idx, track_times=False)
            s.create_dataset("domain", data=np.full(len(idx), domains.index(part.domain), np.int16), track_times=False)
            images += len(idx)
        g.create_dataset("train/val_index", data=part.val, track_times=False)
    f.attrs["images"] = images
    return images


def _image_seed(seed: int, domain: str, split: str, index: int, view: int) -> int:
    h = hashlib.sha256(f"{seed}|{domain}|{split}|{index}|{view}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _batches(bb, images, domain: str, split: str, idx: np.ndarray, views: int, noise, seed: int, batch_size: int
             ) -> Iterator[torch.Tensor]:
    """Preprocessed input batches [B, 3, S, S]; with views, each image contributes its V augmented views in a row."""
    eval_tf, view_tf = bb.pil_transform(train=False), bb.pil_transform(train=True)

    def prepare(rows: np.ndarray) -> torch.Tensor:
        out = []
        for i in rows:
            img = images.image(int(i))
            if noise is not None:
                img = noise.apply(img, np.random.default_rng(_image_seed(seed, domain, split, int(i), -1)))
            if not views:
                out.append(eval_tf(img))
            for v in range(views):
                torch.manual_seed(_image_seed(seed, domain, split, int(i), v))
                out.append(view_tf(img))
        return bb.to_tensor(out)

    chunks = [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    # With a core to spare, batch k+1 is prepared while the backbone runs on batch k; without one, a preparing thread
    # would only stall the backbone's parallel regions, so batches are prepared in turn.
    spare = (os.cpu_count() or 1) > torch.get_num_threads()
    yield from _prefetched(prepare, chunks, ahead=1 if spare else 0)


def _prefetched(fn, items, ahead: int) -> Iterator:
    """map(fn, items), computing up to `ahead` results in a worker thread before they are asked for (bounded memory,
    unlike Executor.map, which runs ahead through all items)."""
    if ahead < 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(1) as pool:
        pending = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
