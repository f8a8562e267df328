"""The one-decode embedding pass: every image a plan needs is decoded once and embedded by every backbone that
needs it, its rows streamed to block files (`files.npy_file`: complete or absent, the unit of resume).

`Local` runs the pass in this process (input workers as child processes); `Ray` runs shares of the blocks as Ray
tasks, one per GPU (or CPU) of the cluster, into the same folders (a shared filesystem). Both return each built
backbone's metadata, which the store records beside its rows.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..cluster import ray_module
from ..devices import resolve_device
from ..errors import UserError
from . import pipeline as P
from .backbones import create_backbone
from .files import npy_file, synced

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
    return {"key": bb.key, "name": bb.name, "weights": bb.weights, "weights_sha256": bb.weights_sha256,
            "dim": bb.dim, "preprocessing": bb.preprocessing | {"pipeline": P.DESCRIPTION}}


def rows_to_embed(blocks: list[Block]) -> dict[int, int]:
    """Backbone index -> the images `blocks` embed with it (the progress total)."""
    total: dict[int, int] = {}
    for block in blocks:
        for j in block.files:
            total[j] = total.get(j, 0) + len(block.rows)
    return total


def embed(blocks: list[Block], data, run: Settings, progress: Progress | None = None,
          phases: dict | None = None) -> dict[int, dict]:
    """One pass over the images of `blocks`: each chunk of `run.batch_size` images is decoded once and embedded by
    every backbone of its block; each block file is renamed into place when complete. Builds each backbone once,
    writes its metadata file; returns the metadata by backbone index."""
    t = time.perf_counter()
    dev = torch.device(run.device)
    built = {j: build(run, j) for j in sorted({j for b in blocks for j in b.files})}
    for j, bb in built.items():
        if not run.meta_files[j].is_file():
            with synced(run.meta_files[j]) as fh:
                fh.write(json.dumps(metadata(bb)).encode())
    models = {j: bb.model.to(dev, memory_format=torch.channels_last) for j, bb in built.items()}
    inputs = {j: (P.Geometry.of(bb.preprocessing), tuple(bb.preprocessing["mean"]), tuple(bb.preprocessing["std"]))
              for j, bb in built.items()}  # backbones with the same (geometry, mean, std) share one float input
    chunks = [P.Chunk(b, block.domain, block.split, block.rows[r : r + run.batch_size], block.views)
              for b, block in enumerate(blocks) for r in range(0, len(block.rows), run.batch_size)]
    source = P.Chunks(data, chunks, list(dict.fromkeys(g for g, _, _ in inputs.values())), run.noise, run.seed)
    total, done = rows_to_embed(blocks), dict.fromkeys(built, 0)
    if phases is not None:
        phases["models"] += (t1 := time.perf_counter()) - t
    writer = _Writer(dev, lag=len(built))
    with torch.inference_mode(), P.forward_threads(dev):
        for b, prepared in itertools.groupby(P.loader(source, run.workers, dev), key=lambda item: item[0]):
            block = blocks[b]
            with ExitStack() as files:
                fh = {j: files.enter_context(npy_file(path, _shape(block, built[j].dim)))
                      for j, path in block.files.items()}
                for _, images in prepared:
                    x = P.to_device(images, source.geometries, dev)  # {geometry: [B*V, 3, H, W] uint8}
                    floats = {}  # (geometry, mean, std) -> [B*V, 3, H, W] float32
                    for j in block.files:
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
    return {j: metadata(bb) for j, bb in built.items()}


def _shape(block: Block, dim: int) -> tuple[int, ...]:
    return (len(block.rows), block.views, dim) if block.views else (len(block.rows), dim)


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


class Local:
    """Blocks embedded in this process (input workers as child processes)."""

    def device(self, name: str) -> torch.device:
        return resolve_device(name)

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

    def device(self, name: str) -> torch.device:
        if name not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device {name} with --backend ray: use auto, cpu or cuda (Ray assigns the GPUs)")
        if name == "cuda" and not self.gpus:
            raise UserError("--device cuda asked for but the Ray cluster has no GPU: use --device cpu")
        return torch.device("cuda" if name != "cpu" and self.gpus else "cpu")

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
                raise (e.cause if isinstance(e.cause, UserError) else e) from None
            for block in share:
                for j in block.files:
                    done[j] = done.get(j, 0) + len(block.rows)
                    if progress:
                        progress(metas[j]["key"], done[j], total[j])
        phases["embedding"] += time.perf_counter() - t
        return metas


BACKENDS = {"local": Local, "ray": Ray}
