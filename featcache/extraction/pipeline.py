"""The input pipeline of `featcache extract`: each image read and decoded once, then resized and normalised for every
backbone as batched tensor ops.

A *chunk* is up to `batch_size` images of one (client, split) block. Preparing it (`Chunks[k]`) decodes every image
once, applies the optional image noise at the image's own resolution, and then:

- when the images share one size and there are no augmented views (array datasets such as offline-digits, Digit-5,
  CIFAR; folders of equal-size photos), returns them as one uint8 batch [B, 3, h, w]; `to_device` moves it to the
  device and resizes it there, once per input geometry, in one batched op (`Chunks(resize=True)`, for a CPU pass
  with input workers, resizes it in the worker instead: the main process keeps its core and its memory for the
  forward);
- otherwise resizes (or, for views, augments) each image for each input geometry and returns the uint8 batches
  {geometry: [B*V, 3, H, W]}, an image's V views in consecutive rows.

`loader` runs `Chunks` in worker processes (torch's DataLoader: `prefetch` bounded by the free shared memory, pinned
host memory on CUDA) when there is per-image work to spread, or in this process when a chunk is one array slice. A
worker moves what it prepared into shared memory itself, so a full `/dev/shm` or a file size limit is one error
line (left to DataLoader's queue thread, the failure is printed there and the pass waits forever). The bytes are
the same either way and whatever the chunk size: every operation acts on each image alone (a batch's resize equals
each image's own).
`normalise_into` turns uint8 rows into the backbone's float input on the device, in place in the forward's buffer;
the forward's batches are fixed apart from the chunks (`FORWARD_BATCH`, used by `embed.py`).

Resizing is torchvision's `resize` on uint8 tensors with antialiasing (within one grey level of PIL's), rounded to
uint8 as PIL's is; `DESCRIPTION` records the exact operations in each backbone's metadata and in the cache key.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import multiprocessing
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .backbones.models import Lazy
from .datasets.base import ArrayImages
from ..devices import device_kind
from ..errors import UserError
from ..threads import asked, cores

if TYPE_CHECKING:
    import torch
else:
    torch = Lazy("torch")  # loaded by the first image prepared: a cache hit or a re-partition never needs it

SHM = "/dev/shm"  # where DataLoader's workers put what they send on Linux
FORWARD_BATCH = {"cpu": 64, "cuda": 256}  # rows in every forward, by device type (64: cache-resident on a CPU)

DESCRIPTION = {
    "version": 3,  # bump on any change to what the operations below compute
    "decode": "PIL, converted to RGB (16-bit grey scaled to 0..255); noise at the image's resolution, rounded to uint8",
    "resize": "torchvision.transforms.v2.functional.resize(uint8 [B, 3, h, w], (H, W), interpolation, "
    "antialias=True) -> uint8; no crop",
    "normalise": "x / 255, then (x - mean) / std per channel, float32; channels_last",
    "views": "per (image, view) seed: RandomResizedCrop((H, W), scale=(0.5, 1)), RandomHorizontalFlip, "
    "ColorJitter(0.4, 0.4, 0.4) on uint8 tensors (torchvision.transforms.v2)",
    "forward": f"every forward exactly {FORWARD_BATCH['cpu']} rows on a CPU, {FORWARD_BATCH['cuda']} on CUDA, "
    "the last padded with zero images; float32 matmuls at 'highest' precision, oneDNN on; on CUDA fp16 "
    "autocast, cuDNN deterministic without benchmark",
}


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
        if not 0 <= self.p < 1 or not 0 <= self.scale < float("inf"):  # NaN fails too
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


@dataclass(frozen=True)
class Geometry:
    """What a backbone's input size and resampling make of an image: backbones that share one share the pixels."""

    height: int
    width: int
    interpolation: str  # 'bicubic' | 'bilinear' | 'nearest' ...

    @classmethod
    def of(cls, preprocessing: dict) -> "Geometry":
        _, h, w = preprocessing["input_size"]
        return cls(int(h), int(w), preprocessing["interpolation"])


@dataclass(frozen=True)
class Chunk:
    block: int  # index of the (client, split, group) block the rows belong to
    domain: str
    split: str
    rows: np.ndarray  # [B] indices into data.domains[domain][split]
    views: int = 0  # augmented views per image; 0: the plain (resized) image


@dataclass(frozen=True)
class Failed:
    """A user error met while preparing a chunk (a damaged image), carried out of a worker process as a value so it
    stays one line (DataLoader would re-raise it with the worker's traceback in its message)."""

    message: str


class Chunks:
    """Chunk k -> (block, prepared uint8 images), a map-style dataset for `loader`; see the module docstring for the
    two forms."""

    def __init__(
        self, data, chunks: list[Chunk], geometries: list[Geometry], noise, seed: int, resize: bool = False
    ) -> None:
        self.data, self.chunks, self.geometries, self.noise, self.seed = data, chunks, geometries, noise, seed
        self.resize = resize  # a shared-size batch resized here too, not by `to_device`

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int):
        chunk = self.chunks[k]
        try:
            prepared = self._prepare(chunk)
            if torch.utils.data.get_worker_info() is not None:
                _share(prepared)
            return chunk.block, prepared
        except UserError as e:
            return chunk.block, Failed(str(e))

    def _prepare(self, chunk: Chunk) -> torch.Tensor | dict[Geometry, torch.Tensor]:
        images = self.data.domains[chunk.domain][chunk.split]
        stack = images.batch(chunk.rows) if self.noise is None else None  # [B, h, w, 3] uint8, or None
        if stack is None:
            pixels = [self._decode(images, chunk, int(i)) for i in chunk.rows]  # each [h, w, 3] uint8
            if len({p.shape for p in pixels}) == 1:
                stack = np.stack(pixels)
        if stack is not None and not chunk.views:
            x = torch.from_numpy(np.ascontiguousarray(stack)).permute(0, 3, 1, 2).contiguous()  # [B, 3, h, w]
            return {g: resize(x, g) for g in self.geometries} if self.resize else x  # each [B, 3, H, W]
        if stack is not None:
            pixels = list(stack)
        tensors = [torch.from_numpy(np.ascontiguousarray(p)).permute(2, 0, 1) for p in pixels]  # each [3, h, w]
        if chunk.views:
            return {
                g: torch.cat([self._views(x, chunk, int(i), g) for x, i in zip(tensors, chunk.rows)])
                for g in self.geometries
            }  # [B*V, 3, H, W] uint8
        return {g: torch.cat([resize(x[None], g) for x in tensors]) for g in self.geometries}  # [B, 3, H, W]

    def _decode(self, images, chunk: Chunk, i: int) -> np.ndarray:
        x = np.array(images.image(i))  # [h, w, 3] uint8, writable
        if self.noise is None:
            return x
        return self.noise.apply(x, np.random.default_rng(image_seed(self.seed, chunk.domain, chunk.split, i, -1)))

    def _views(self, x: torch.Tensor, chunk: Chunk, i: int, g: Geometry) -> torch.Tensor:
        """[V, 3, H, W] uint8: the image's V augmented views; a view's crop box depends on its seed and the image
        alone, so backbones of different input sizes see the same crops."""
        augment = _augmentation(g)
        out = []
        with torch.random.fork_rng(devices=[]):
            for v in range(chunk.views):
                torch.manual_seed(image_seed(self.seed, chunk.domain, chunk.split, i, v))
                out.append(augment(x))
        return torch.stack(out)


def _share(prepared: torch.Tensor | dict[Geometry, torch.Tensor]) -> None:
    """Moves a worker's prepared tensors into shared memory, a failure as one UserError naming the limit."""
    try:
        for t in prepared.values() if isinstance(prepared, dict) else [prepared]:
            t.share_memory_()
    except RuntimeError as e:  # torch ends its message with the errno: "... File too large (27)"
        found = re.search(r"\((\d+)\)$", str(e))
        code = int(found.group(1)) if found else None
        reason = os.strerror(code) if code else str(e)
        if code == errno.EFBIG:
            what = f"file size limit reached while writing prepared images to shared memory ({reason}, ulimit -f)"
            fix = "raise the limit"
        else:
            what = f"cannot write prepared images to shared memory, {SHM} ({reason})"
            fix = "free space there (a container's --shm-size)"
        raise UserError(
            f"{what}: {fix} or pass --workers 0, and run the same command again; finished blocks are kept and resumed"
        ) from None


def resize(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    """uint8 [B, 3, h, w] -> uint8 [B, 3, H, W], on whatever device x lives."""
    if tuple(x.shape[-2:]) == (g.height, g.width):
        return x
    from torchvision.transforms import InterpolationMode  # lazy: torchvision (a heavy import) only when resizing
    from torchvision.transforms.v2 import functional as F

    return F.resize(x, [g.height, g.width], interpolation=InterpolationMode(g.interpolation), antialias=True)


@functools.lru_cache(maxsize=None)
def _augmentation(g: Geometry):
    """The views' transform at geometry g, built once per process (it holds no state: the seeds are global)."""
    from torchvision.transforms import InterpolationMode  # lazy: torchvision (a heavy import) only when views are made
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.RandomResizedCrop(
                (g.height, g.width), scale=(0.5, 1.0), interpolation=InterpolationMode(g.interpolation), antialias=True
            ),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(0.4, 0.4, 0.4),
        ]
    )


def image_seed(seed: int, domain: str, split: str, index: int, view: int) -> int:
    """The seed of one image's noise (view -1) or one of its augmented views."""
    h = hashlib.sha256(f"{seed}|{domain}|{split}|{index}|{view}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def default_workers(data, views: int) -> int:
    """Worker processes for `loader`: none when every chunk is one array slice (nothing per image to spread), else
    one per core this process may run on."""
    if not views and all(isinstance(s, ArrayImages) for splits in data.domains.values() for s in splits.values()):
        return 0
    return cores()


@contextmanager
def forward_threads(device: torch.device | str):
    """torch's intra-op threads while the CPU runs the forward passes: `extract(threads=N)`'s N, else one fewer than
    the cores this process may use (at least 1, never more than were set), restored on exit; a GPU's forward is left
    alone. The core left over takes the input workers' decoding and resizing, which would otherwise deschedule a
    forward thread mid-op (featcache/threads.py: why that costs more than the thread gives). The count does not
    depend on the worker count, so neither do the features' bytes."""
    before = torch.get_num_threads()
    if device_kind(device) == "cpu":
        torch.set_num_threads(asked() or min(before, max(1, cores() - 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def forward_batch(device: torch.device | str) -> int:
    """Rows in every forward on `device` (`FORWARD_BATCH`): fixed, so an image's bytes never depend on how many
    images an extraction embeds, in which chunks, or how many threads run the forward."""
    return FORWARD_BATCH[device_kind(device)]


def default_batch_size(device: torch.device | str) -> int:
    """Images prepared per chunk when none is asked for: one forward's worth."""
    return forward_batch(device)


def loader(chunks: Chunks, workers: int, device: torch.device | str):
    """Prepared chunks in order: (block, uint8 images), prepared up to `prefetch` chunks per worker ahead."""
    if workers == 0:
        return (chunks[k] for k in range(len(chunks)))
    from torch.utils.data import DataLoader

    try:  # the workers' queues need semaphores, which multiprocessing makes in SHM: where it cannot, say so
        multiprocessing.Lock()
    except OSError as e:  # a read-only or missing /dev/shm: not the store's or the output's folder
        raise UserError(
            f"cannot start {workers} image worker(s): multiprocessing cannot make a semaphore in {SHM} "
            f"({e.strerror or e}): make {SHM} writable or pass --workers 0"
        ) from None
    return DataLoader(
        chunks,
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        prefetch_factor=prefetch(chunks, workers),
        pin_memory=device_kind(device) == "cuda",
        persistent_workers=False,
    )


def prefetch(chunks: Chunks, workers: int) -> int:
    """Chunks each worker prepares ahead: 4, or as many as half of `SHM`'s free space holds for every worker (at
    least 1), since the chunks in flight live there: a container's 64 MB /dev/shm holds two 224 px chunks of 64
    images, not eight. A chunk's size is what it holds resized to every input geometry."""
    rows = max((len(c.rows) * max(c.views, 1) for c in chunks.chunks), default=0)
    size = rows * 3 * sum(g.height * g.width for g in chunks.geometries)  # uint8 bytes
    try:
        free = os.statvfs(SHM)
    except OSError:  # no such folder (macOS): torch shares memory another way
        return 4
    return max(1, min(4, free.f_bavail * free.f_frsize // 2 // max(1, workers * size)))


def to_device(prepared, geometries: list[Geometry], device: torch.device) -> dict[Geometry, torch.Tensor]:
    """A prepared chunk on the device at every input geometry (uint8). A shared-size batch is copied once and
    resized there; per-image results are copied as they are."""
    if isinstance(prepared, Failed):
        raise UserError(prepared.message)
    if isinstance(prepared, torch.Tensor):
        x = prepared.to(device, non_blocking=True)  # [B, 3, h, w] uint8
        return {g: resize(x, g) for g in geometries}
    return {g: t.to(device, non_blocking=True) for g, t in prepared.items()}


def normalise_into(out: torch.Tensor, x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 x [B, 3, H, W] -> out [B, 3, H, W] float32 (any layout, on x's device): (x / 255 - mean) / std per
    channel, computed in place in `out`; returns out."""
    mean, std = (torch.tensor(v, dtype=torch.float32, device=x.device).view(1, 3, 1, 1) for v in (mean, std))
    return out.copy_(x).div_(255).sub_(mean).div_(std)


def normalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 [B, 3, H, W] channels_last: (x / 255 - mean) / std per channel."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device, memory_format=torch.channels_last)
    return normalise_into(out, x, mean, std)
