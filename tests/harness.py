"""Helpers of the fault, integrity and hostile-input tests: small image-folder datasets, the featcache CLI run in
this process, and assertions on what a failed command leaves behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import hashlib
import io
import sys
import shutil
import zlib

import h5py
import numpy as np
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from fixtures_disk import write_image

# Two tiny random-weight timm test models: two backbones x two clients x two splits = 8 blocks to kill between.
BACKBONES = ["test_resnet=random", "test_efficientnet=random"]


def write_folders(
    root: Path,
    domains=("d1", "d2"),
    classes=("a", "b", "c"),
    per_class: int = 8,
    mode: str = "RGB",
    suffix: str = ".png",
) -> Path:
    """`root/{domain}/{class}/img_NNN.png`, every image different (seeded by its path)."""
    for d in domains:
        for c in classes:
            for i in range(per_class):
                write_image(
                    root / d / c / f"img_{i:03d}{suffix}", mode, size=(10, 10), seed=zlib.crc32(f"{d}/{c}/{i}".encode())
                )
    return root


@contextlib.contextmanager
def ctrl_c_after_first_block(monkeypatch):
    """Inside, an extraction in this process stops as at a Ctrl-C right after its first finished block is in place
    (its parts folder, the resume point, kept)."""
    real = os.replace

    def then_stop(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if str(dst).endswith(".npy"):
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(os, "replace", then_stop)
        yield


def folder_extract_args(root: Path, out: Path, *extra: str, backbones: list[str] = BACKBONES) -> list[str]:
    """`featcache extract` of the image folder `root` into `out` with `backbones`, small and fast, --json."""
    backbones = [arg for spec in backbones for arg in ("--backbone", spec)]
    return [
        "extract",
        "--dataset",
        "imagefolder",
        "--data-root",
        str(root),
        *backbones,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--out",
        str(out),
        "--json",
        *extra,
    ]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> Result:
    """`featcache ARGS` through the console entry point, in this process (no interpreter start-up per call)."""
    from featcache import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["featcache", *map(str, args)]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return Result(code, stdout.getvalue(), stderr.getvalue())


def lines(text: str) -> list[str]:
    """The non-blank lines of stderr, less plain progress lines (`progress: ...`, printed when stderr is not a terminal,
    as in these tests): progress of work done before an error is not part of the error's one line."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith("progress: ")]


def after_notes(result: Result) -> Result:
    """`result` less its `warning:` lines: notes on a run that had begun (a client taking one local step) before a
    failure at run time; bad input is refused before any note, so its tests do not use this."""
    kept = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
    return dataclasses.replace(result, stderr="\n".join(kept) + "\n" if kept else "")


def one_line_error(result: Result, needle: str) -> str:
    """Assert exit code 2 and exactly one stderr line (with `needle`), no traceback; return that line."""
    assert result.code == 2, (result.code, result.stderr)
    assert "Traceback" not in result.stderr
    (line,) = lines(result.stderr)
    assert line.startswith("error:") and needle in line, line
    return line


def everything_in(folder: Path) -> list[str]:
    """Every file and folder below `folder`, hidden ones included (relative paths, sorted)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def store_files(out: Path) -> dict[str, str]:
    """Every store file, segment and segment-folder marker below out/store, by path, with its sha256."""
    files = [*(out / "store").glob("*.h5"), *(out / "store").glob("*.h5.rows/*")]
    return {str(p.relative_to(out)): sha256(p) for p in sorted(files)}


@contextlib.contextmanager
def one_thread():
    """torch on one thread, as the subprocesses run (features are bit-identical only for one thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def edit_cache(path: Path, edit, reseal: bool = True) -> Path:
    """Edit the cache file at `path` in place with `edit(h5py.File)`; `reseal` rewrites its checksums, so only the
    content checks can tell."""
    import h5py

    from featcache.cache import h5

    with h5py.File(path, "r+") as f:
        edit(f)
        if reseal:
            h5.seal(f)
    return path


CRASHPOINT = Path(__file__).with_name("crashpoint.py")


def driver(cwd: Path, args: list, fault: list[str] = ()) -> subprocess.CompletedProcess:
    """`featcache ARGS` in a fresh process in `cwd` (created), with a fault of tests/crashpoint.py; the command line
    (recorded in the result) is the same in every folder."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(CRASHPOINT), *fault, "--", *map(str, args)],
        capture_output=True,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        cwd=cwd,
        timeout=600,
    )


def damage_store(store: Path) -> None:
    """Flip bits of the first row of a store's first segment on disk; the metadata checksums stay as they are (they
    do not cover the rows), so only the row's own crc32 can tell."""
    from featcache.extraction.store import rows_folder

    segment = rows_folder(store) / "000001.h5"
    with h5py.File(segment, "r") as f:
        at = next(ds for ds in _datasets(f) if ds.name.endswith("/rows")).id.get_offset()
    with open(segment, "r+b") as fh:
        fh.seek(at)
        row = np.frombuffer(fh.read(8), np.uint32) ^ 0x00FF0000
        fh.seek(at)
        fh.write(row.tobytes())


def _datasets(f) -> list:
    found: list = []
    f.visititems(lambda name, obj: found.append(obj) if isinstance(obj, h5py.Dataset) else None)
    return found


def copy_store(src: Path, dst: Path) -> Path:
    """Copy a file, and its rows folder where it is a store that has one."""
    from featcache.extraction.store import rows_folder

    shutil.copy(src, dst)
    if rows_folder(src).is_dir():
        shutil.copytree(rows_folder(src), rows_folder(dst))
    return Path(dst)


def release_batches(train, B: int, drop_last: bool):
    """featcache's minibatches as a release's client is handed them: `batches(round, client, epoch)` -> [(x, y)] in
    the engine's batch order (seed 0), B rows each; `drop_last` leaves out the short last one, as the releases'
    DataLoader(drop_last=True) does, else it is kept."""
    from featcache.training.schedule import batch_order

    seeds = torch.tensor([0])

    def batches(r: int, c: int, epoch: int) -> list:
        order = batch_order(seeds, r, epoch, train.counts, train.features.shape[1])[0, c]
        n = int(train.counts[c])
        stop = n // B * B if drop_last else n
        picks = [order[s : min(s + B, n)] for s in range(0, stop, B)]
        return [(train.features[c, i], train.labels[c, i]) for i in picks]

    return batches
