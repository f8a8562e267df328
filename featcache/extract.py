"""`featcache extract`: run each frozen backbone once over every client's images and stream the embeddings to HDF5.

The cache key is computed before any model or image is touched, from everything that determines the embeddings
(dataset identity, partition, backbone weights, preprocessing options, views, noise, seed, library versions), so a
repeated command is a cache hit that costs a hash and a file lookup. A miss writes to a temporary file in the output
folder that is renamed into place only when every (backbone, client, split) block is written.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
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
    progress: Progress | None = None,
) -> dict:
    """Extract (or find cached) embeddings; returns {cache, cache_hit, key, images, backbones, seconds}."""
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

    identity, data = dataset_identity(dataset, data_root, download)
    manifest = {
        "dataset": identity,
        "partition": spec.to_dict(),
        "backbones": [weights_identity(b) for b in backbone],
        "image_size": image_size,
        "views": views,
        "noise": asdict(noise) if noise else None,
        "seed": seed,
        "versions": C.versions(),
    }
    key = C.cache_key(manifest)
    path = C.cache_path(Path(out), dataset, key)
    if path.is_file():
        with C.open_cache(path) as f:
            images = int(f.attrs["images"])
            keys = C.read_attrs(f)["backbones"]
        return _result(path, True, key, images, keys, t0)

    data = data or load_dataset(dataset, data_root, download=download)
    parts = make_partition(data, spec)
    from .backbones import create_backbone

    models = [create_backbone(b, image_size=image_size) for b in backbone]
    dev = _device(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            images = _write_layout(f, data, parts, models, manifest, key, views)
            for bb in models:
                _run_backbone(f, bb, data, parts, views, noise, seed, batch_size, dev, progress)
            _write_concat(f, [bb.key for bb in models], views)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _result(path, False, key, images, [bb.key for bb in models], t0)


def _result(path: Path, hit: bool, key: str, images: int, keys: list[str], t0: float) -> dict:
    return {"cache": str(path), "cache_hit": hit, "key": key, "images": images, "backbones": keys,
            "seconds": round(time.perf_counter() - t0, 3)}


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for but CUDA is not available: use --device cpu")
    return torch.device(device)


def _write_layout(f: h5py.File, data, parts, models, manifest: dict, key: str, views: int) -> int:
    """Create every group and label array; return the number of distinct images (train + test)."""
    domains = list(dict.fromkeys(p.domain for p in parts))  # the domains clients hold, in client order
    C.write_attrs(f, {
        "featcache_format": C.FORMAT, "featcache_version": C.versions()["featcache"], "key": key,
        "manifest": manifest, "backbones": [bb.key for bb in models], "classes": list(data.classes),
        "domains": domains, "dataset": data.name, "partition": manifest["partition"],
        "counts": partition_counts(data, parts), "views": views, "versions": manifest["versions"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    for bb in models:
        C.write_attrs(f.create_group(f"backbones/{bb.key}"), {
            "name": bb.name, "weights": bb.weights, "weights_sha256": bb.weights_sha256, "dim": bb.dim,
            "preprocessing": bb.preprocessing,
        })
    images = 0
    for c, part in enumerate(parts):
        g = f.create_group(f"clients/{c:03d}")
        g.attrs["domain"] = part.domain
        for split in SPLITS:
            idx = getattr(part, split)  # [n] int64
            s = g.create_group(split)
            s["labels"] = data.domains[part.domain][split].labels[idx]
            s["source_index"] = idx
            s["domain"] = np.full(len(idx), domains.index(part.domain), dtype=np.int16)
            for bb in models:
                s.create_dataset(f"features/{bb.key}", (len(idx), bb.dim), "f4")
                if views and split == "train":
                    s.create_dataset(f"views/{bb.key}", (len(idx), views, bb.dim), "f4")
            images += len(idx)
        g["train/val_index"] = part.val
    f.attrs["images"] = images
    return images


def _image_seed(seed: int, domain: str, split: str, index: int, view: int) -> int:
    h = hashlib.sha256(f"{seed}|{domain}|{split}|{index}|{view}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _batches(bb, images, domain: str, split: str, idx: np.ndarray, views: int, noise, seed: int, batch_size: int
             ) -> Iterator[torch.Tensor]:
    """Preprocessed input batches [B, 3, S, S]; with views, each image contributes its V augmented views in a row."""
    eval_tf, view_tf = bb.transform(train=False), bb.transform(train=True)

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
        return torch.stack(out)

    chunks = [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
    with ThreadPoolExecutor(1) as pool:  # prepare batch k+1 while the backbone runs on batch k
        yield from pool.map(prepare, chunks)


@torch.inference_mode()
def _run_backbone(f, bb, data, parts, views, noise, seed, batch_size, dev, progress) -> None:
    model = bb.model.to(dev)
    cuda = dev.type == "cuda"
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    jobs = [(c, part, split, v) for c, part in enumerate(parts) for split in SPLITS
            for v in ((0, views) if views and split == "train" else (0,))]
    total = sum(len(getattr(p, s)) for _, p, s, _ in jobs)
    done = 0
    for c, part, split, v in jobs:
        idx = getattr(part, split)  # [n]
        images = data.domains[part.domain][split]
        dset = f[f"clients/{c:03d}/{split}/{'views' if v else 'features'}/{bb.key}"]
        row = 0
        for x in _batches(bb, images, part.domain, split, idx, v, noise, seed, batch_size):  # [B*max(v,1), 3, S, S]
            x = x.to(dev, non_blocking=True)
            if cuda:
                x = x.to(memory_format=torch.channels_last)
            with torch.autocast(dev.type, dtype=torch.float16, enabled=cuda):
                z = model(x).float().cpu().numpy()  # [B*max(v,1), D]
            n = len(z) // max(v, 1)
            dset[row : row + n] = z.reshape(n, v, -1) if v else z
            row += n
            done += n
            if progress:
                progress(f"{bb.key}", done, total)
    bb.model.to("cpu")


def _write_concat(f: h5py.File, keys: list[str], views: int, rows_per_block: int = 4096) -> None:
    """features/concat (and views/concat) = per-backbone embeddings side by side, in `keys` order."""
    for g in f["clients"].values():
        for split in SPLITS:
            for group in ("features", "views") if views and split == "train" else ("features",):
                parts = [g[f"{split}/{group}/{k}"] for k in keys]
                shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
                out = g[split][group].create_dataset("concat", shape, "f4")
                for r in range(0, shape[0], rows_per_block):
                    out[r : r + rows_per_block] = np.concatenate([p[r : r + rows_per_block] for p in parts], -1)
