"""The one-decode embedding pass: every image a plan needs is decoded once and embedded by every backbone that
needs it, its rows streamed to block files (`files.npy_file`: complete or absent, the unit of resume).

`Local` runs the pass in this process (input workers as child processes); `Ray` runs shares of the blocks as Ray
tasks, one per GPU (or CPU) of the cluster, into the same folders (a shared filesystem). Both return each built
backbone's metadata, which the store records beside its rows.
"""

from __future__ import annotations

import json
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..cluster import ray_module
from ..devices import device_name
from ..errors import UserError
from . import pipeline as P
from .backbones import create_backbone
from .backbones.models import Lazy
from ..files import npy_file, synced

if TYPE_CHECKING:
    import torch
else:
    torch = Lazy("torch")  # loaded by the first pass that embeds: a cache hit or a re-partition never needs it

Progress = Callable[[str, int, int], None]  # (task label, items done so far, total items)


@dataclass(frozen=True)
class Block:
    """Rows of one (domain, split) as plain features (views 0: [n, D]) or augmented views ([n, V, D]), and the
    file each backbone that needs them writes them to."""

    domain: str
    split: str
    views: int
    rows: np.ndarray  # [n] increasing indices into data.domains[domain][split]
    files: dict[int, Path]  # backbone index -> block file


@dataclass(frozen=True)
class Settings:
    """What the embedding pass needs besides the images: the same for the local and the Ray backend."""

    specs: tuple[str, ...]
    image_size: int | None
    noise: P.Noise | None
    seed: int
    batch_size: int
    workers: int
    device: str
    allow_partial: bool
    meta_files: tuple[Path, ...]  # backbone j's metadata is written to meta_files[j] once it is built


def build(run: Settings, j: int):
    return create_backbone(run.specs[j], image_size=run.image_size, allow_partial=run.allow_partial)


def metadata(bb) -> dict:
    return {
        "key": bb.key,
        "name": bb.name,
        "weights": bb.weights,
        "weights_sha256": bb.weights_sha256,
        "dim": bb.dim,
        "preprocessing": bb.preprocessing | {"pipeline": P.DESCRIPTION},
    }


def rows_to_embed(blocks: list[Block]) -> dict[int, int]:
    """Backbone index -> the images `blocks` embed with it (the progress total)."""
    total: dict[int, int] = {}
    for block in blocks:
        for j in block.files:
            total[j] = total.get(j, 0) + len(block.rows)
    return total


def embed(
    blocks: list[Block], data, run: Settings, progress: Progress | None = None, phases: dict | None = None
) -> dict[int, dict]:
    """One pass over the images of `blocks`: each chunk of `run.batch_size` images is decoded once, and its rows
    join each of its backbones' queue; a backbone forwards its queue in batches of exactly `P.forward_batch` rows
    whatever block or chunk they came from (the last batch padded), and each block file is renamed into place when
    all its rows are written. Builds each backbone once, writes its metadata file; returns the metadata by backbone
    index."""
    t = time.perf_counter()
    dev = torch.device(run.device)
    built = {j: build(run, j) for j in sorted({j for b in blocks for j in b.files})}
    for j, bb in built.items():
        if not run.meta_files[j].is_file():
            with synced(run.meta_files[j]) as fh:
                fh.write(json.dumps(metadata(bb)).encode())
    models = {j: bb.model.to(dev, memory_format=torch.channels_last) for j, bb in built.items()}
    inputs = {
        j: (P.Geometry.of(bb.preprocessing), bb.preprocessing["mean"], bb.preprocessing["std"])
        for j, bb in built.items()
    }
    chunks = [
        P.Chunk(b, block.domain, block.split, block.rows[r : r + run.batch_size], block.views)
        for b, block in enumerate(blocks)
        for r in range(0, len(block.rows), run.batch_size)
    ]
    geometries = list(dict.fromkeys(g for g, _, _ in inputs.values()))
    source = P.Chunks(data, chunks, geometries, run.noise, run.seed, resize=run.workers > 0 and dev.type == "cpu")
    queues = {j: _Queue(P.forward_batch(dev), mean, std) for j, (_, mean, std) in inputs.items()}
    if phases is not None:
        phases["models"] += (t1 := time.perf_counter()) - t
    with torch.inference_mode(), P.forward_threads(dev), _numerics(dev), _Files(blocks, built, dev) as files:
        for b, prepared in P.loader(source, run.workers, dev):
            x = P.to_device(prepared, source.geometries, dev)  # {geometry: [B*V, 3, H, W] uint8}
            for j in blocks[b].files:
                for rows, n, parts in queues[j].put(b, x[inputs[j][0]]):
                    files.write(j, _forward(models[j], rows, n, dev), parts, progress)
        for j, queue in queues.items():
            for rows, n, parts in queue.rest():
                files.write(j, _forward(models[j], rows, n, dev), parts, progress)
    if phases is not None:
        phases["embedding"] += time.perf_counter() - t1
    return {j: metadata(bb) for j, bb in built.items()}


class _Queue:
    """One backbone's next forward: a buffer of exactly `size` rows, float32 channels_last on the device, filled with
    the normalised rows in the order they came, each run of them labelled with its block. Normalising straight into
    one buffer allocated once keeps the pass's host memory at what the model needs: a float copy of each chunk
    allocated between forwards would sit in the C library's heap under the next forward's activations."""

    def __init__(self, size: int, mean, std) -> None:
        self.size, self.mean, self.std = size, mean, std
        self.x: torch.Tensor | None = None  # [size, 3, H, W] float32 channels_last, allocated at the first rows
        self.rows, self.parts = 0, []  # rows filled; [(block, n), ...]

    def put(self, block: int, x: torch.Tensor):
        """Normalises x [n, 3, H, W] uint8 into the buffer, yielding (buffer, size, parts) each time it is full."""
        if self.x is None:
            shape = (self.size, *x.shape[1:])
            self.x = torch.empty(shape, dtype=torch.float32, device=x.device, memory_format=torch.channels_last)
        start = 0
        while start < len(x):
            n = min(self.size - self.rows, len(x) - start)
            P.normalise_into(self.x[self.rows : self.rows + n], x[start : start + n], self.mean, self.std)
            self.parts.append((block, n))
            self.rows, start = self.rows + n, start + n
            if self.rows == self.size:
                yield self._take()

    def rest(self):
        """The rows still waiting (fewer than `size`) as one last (buffer, n, parts), the rows after them zero."""
        if self.rows:
            self.x[self.rows :].zero_()
            yield self._take()

    def _take(self) -> tuple[torch.Tensor, int, list[tuple[int, int]]]:
        taken = (self.x, self.rows, self.parts)
        self.rows, self.parts = 0, []
        return taken


class _Files:
    """The block files of one pass, each opened at its first rows and renamed into place as soon as its last rows
    are written (an interrupted pass keeps the blocks it finished); on an error the open ones are left partial."""

    def __init__(self, blocks: list[Block], built: dict, dev: torch.device) -> None:
        self.blocks, self.built = blocks, built
        self.writer = _Writer(dev, lag=len(built))
        self.files = ExitStack()  # every file's own context, so an error reaches each open one
        self.open: dict[tuple[int, int], tuple[ExitStack, object]] = {}  # (block, backbone) -> (its context, handle)
        self.left = {
            (b, j): len(block.rows) * max(block.views, 1) for b, block in enumerate(blocks) for j in block.files
        }  # rows each file still waits for
        self.done = dict.fromkeys(built, 0)  # images written, by backbone (for progress)
        self.total = rows_to_embed(blocks)

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *error) -> bool:
        if error[0] is None and self.open:
            raise AssertionError(f"block files left unfinished: {sorted(self.open)}")
        return self.files.__exit__(*error)

    def write(self, j: int, z: torch.Tensor, parts: list[tuple[int, int]], progress: Progress | None) -> None:
        """z [n, D]: the rows of `parts` ((block, rows) in order) embedded by backbone j."""
        start = 0
        for b, n in parts:
            block = self.blocks[b]
            if (b, j) not in self.open:
                stack = self.files.push(ExitStack())
                self.open[b, j] = stack, stack.enter_context(npy_file(block.files[j], _shape(block, self.built[j].dim)))
            self.writer.put(self.open[b, j][1], z[start : start + n])
            start += n
            views, before = max(block.views, 1), self.left[b, j]
            self.left[b, j] -= n
            self.done[j] += _ceil(before, views) - _ceil(self.left[b, j], views)  # images whose last view is out
            if not self.left[b, j]:
                self.writer.flush()
                self.open.pop((b, j))[0].close()
            if progress:
                progress(self.built[j].key, self.done[j], self.total[j])


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _shape(block: Block, dim: int) -> tuple[int, ...]:
    return (len(block.rows), block.views, dim) if block.views else (len(block.rows), dim)


class _Writer:
    """Writes embedded rows to their block files. On CUDA a batch's device-to-host copy is started at once and
    written `lag` batches later, so the copy and the disk write overlap the next forward passes."""

    def __init__(self, dev: torch.device, lag: int) -> None:
        self.cuda, self.lag, self.pending = dev.type == "cuda", lag, deque()

    def put(self, fh, z: torch.Tensor) -> None:
        if not self.cuda:
            fh.write(np.ascontiguousarray(z.numpy(), "<f4").data)  # the rows' own memory unless strided (a ViT's token)
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
        fh.write(np.ascontiguousarray(host.numpy(), "<f4").data)


def _forward(model, x: torch.Tensor, n: int, dev: torch.device) -> torch.Tensor:
    """x [size, 3, H, W] float32 channels_last on the device, its first n rows the images and the rest zero images
    -> [n, D] float32 on the device: one forward of exactly `size` rows (fp16 autocast on CUDA). The kernels a CPU or
    GPU library picks, and so the last bits of a row, change with the batch size (oneDNN's blocking on a CPU), never
    with the other rows: a forward of one fixed size makes an image's embedding a function of the image alone."""
    with torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
        return model(x).float()[:n]


@contextmanager
def _numerics(dev: torch.device):
    """The flags that choose a forward's kernels, pinned for the pass whatever the calling process set (restored
    after): float32 matmuls in full float32, oneDNN on, and cuDNN's algorithm by its heuristics (not by timing) among
    its deterministic ones."""
    cudnn = torch.backends.cudnn
    before = (torch.get_float32_matmul_precision(), torch.backends.mkldnn.enabled, cudnn.benchmark, cudnn.deterministic)
    torch.set_float32_matmul_precision("highest")
    torch.backends.mkldnn.enabled = True
    if dev.type == "cuda":
        cudnn.benchmark, cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.mkldnn.enabled = before[1]
        cudnn.benchmark, cudnn.deterministic = before[2], before[3]


class Local:
    """Blocks embedded in this process (input workers as child processes). `device` names the device the blocks
    would run on (`devices.device_name`: no torch where no GPU can be)."""

    def device(self, name: str) -> str:
        return device_name(name)

    def embed(self, blocks, data, run, progress, phases) -> dict[int, dict]:
        return embed(blocks, data, run, progress, phases)


class Ray:
    """Blocks as Ray tasks: one per GPU of the cluster, each building the backbones once and embedding its share of
    the blocks into the parts folders (which must be the same paths on every node: a shared filesystem), or one per
    CPU where the cluster has no GPU. This process keeps the locks and writes the stores and caches, exactly as the
    local backend does, so their bytes are the same."""

    def __init__(self) -> None:
        self.ray = ray_module()
        resources = self.ray.cluster_resources()
        self.gpus, self.cpus = int(resources.get("GPU", 0)), max(1, int(resources.get("CPU", 1)))

    def device(self, name: str) -> str:
        if name not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device {name} with --backend ray: use auto, cpu or cuda (Ray assigns the GPUs)")
        if name == "cuda" and not self.gpus:
            raise UserError("--device cuda asked for but the Ray cluster has no GPU: use --device cpu")
        return "cuda" if name != "cpu" and self.gpus else "cpu"

    def embed(self, blocks, data, run, progress, phases) -> dict[int, dict]:
        t = time.perf_counter()
        cuda = run.device == "cuda"
        tasks = min(len(blocks), self.gpus if cuda else self.cpus)
        cpus = max(1, self.cpus // self.gpus) if cuda else 1
        task = self.ray.remote(num_gpus=1 if cuda else 0, num_cpus=cpus)(embed)
        run = replace(run, workers=min(run.workers, cpus if cuda else 0))
        shared = self.ray.put(data)
        pending = {task.remote(blocks[i::tasks], shared, run): blocks[i::tasks] for i in range(tasks)}
        metas, done, total = {}, {}, rows_to_embed(blocks)
        while pending:
            (finished,), _ = self.ray.wait(list(pending), num_returns=1)
            share = pending.pop(finished)
            try:
                metas |= self.ray.get(finished)
            except self.ray.exceptions.RayTaskError as e:  # keep a user error one line, not the task's traceback
                self._stop(list(pending))
                raise (e.cause if isinstance(e.cause, UserError) else e) from None
            for block in share:
                for j in block.files:
                    done[j] = done.get(j, 0) + len(block.rows)
                    if progress:
                        progress(metas[j]["key"], done[j], total[j])
        phases["embedding"] += time.perf_counter() - t
        return metas

    def _stop(self, pending: list) -> None:
        """Cancel the other shares of a failed pass and wait for them to end: the caller removes the parts folders
        (bad input, a damaged image), which no task may still be writing into."""
        for ref in pending:
            self.ray.cancel(ref)
        if pending:
            self.ray.wait(pending, num_returns=len(pending))


BACKENDS = {"local": Local, "ray": Ray}
