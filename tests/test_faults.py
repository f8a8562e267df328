"""Faults injected into real `featcache` processes: kill -9 at every stage of `extract` and during a `grid`, a full
disk, two extractions of one cache at once. After each, the same command must finish with exactly the bytes of an
undisturbed run, without recomputing finished work, and no reader may ever see a partial cache.

The processes run `tests/crashpoint.py`, which starts the real CLI and sends itself SIGKILL at a named point (the
N-th block renamed into place, the N-th forward pass, the N-th HDF5 dataset written, ...): a kill -9 that lands at
the same place every time. One test kills from outside instead, at whatever moment a poll catches.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import BACKBONES, everything_in, folder_extract_args, lines, one_thread, sha256, write_folders

from featcache.extraction.store import Store
from featcache.cache import h5
from featcache.errors import UserError
from featcache.extraction.plan import DiskFullError, extract
from tests.synthetic import write_cache

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("crashpoint.py")
ENV = os.environ | {"OMP_NUM_THREADS": "1"}  # on a busy 2-core machine, two OpenMP threads spin and crawl
STORE_H5, CACHE_H5 = "*.*.*.h5", "*-*.h5"  # imagefolder.<backbone>.<key>.h5 and imagefolder-<key>.h5
SEGMENT_H5 = "0*.h5"  # a store's segment: <store>.h5.rows/000001.h5

# Each case: the kill -9 of each interrupted run, in order (then one clean run). Two domains, one client each; each
# (domain, split) is one block per backbone. A forward holds 64 rows, so each backbone's 48 images are one forward,
# after which its blocks are renamed into place one by one (d1 train, d1 test, d2 train, d2 test): the first
# backbone's, then the second's. Then each store's commit writes its segment (index, crc and rows per (domain, split))
# and renames it, then writes its file naming the segment and renames that; then the cache is written
# (features/concat per client and split), renamed.
KILLS = {
    "after-block-1": ["after:os.replace:1:*.npy"],
    "after-block-2": ["after:os.replace:2:*.npy"],
    "after-block-3": ["after:os.replace:3:*.npy"],
    "after-block-5-second-backbone": ["after:os.replace:5:*.npy"],
    "after-forward-2-before-its-blocks": ["after:featcache.extraction.embed._forward:2:*"],
    "inside-segment": ["after:featcache.cache.h5._new_dataset:3:*"],
    "before-segment-rename": [f"before:os.replace:1:{SEGMENT_H5}"],
    "between-segment-and-store": [f"after:os.replace:1:{SEGMENT_H5}"],
    "before-store-rename": [f"before:os.replace:1:{STORE_H5}"],
    "between-store-renames": [f"after:os.replace:1:{STORE_H5}"],
    "inside-assembly": ["after:featcache.cache.h5._new_dataset:2:concat"],  # client 0's test features, not yet filled
    "before-final-rename": [f"before:os.replace:1:{CACHE_H5}"],
    "after-final-rename": [f"after:os.replace:1:{CACHE_H5}"],
    "killed-twice": ["after:os.replace:2:*.npy", "after:os.replace:3:*.npy"],
}


def driver(
    args: list[str],
    kill: str | None = None,
    pause: str | None = None,
    log: Path | None = None,
    file_limit: int | None = None,
    wait: bool = True,
):
    options = [
        *(["--kill", kill] if kill else []),
        *(["--pause", pause] if pause else []),
        *(["--log", str(log)] if log else []),
    ]
    command = [sys.executable, str(DRIVER), *options, "--", *args]

    def limit_files() -> None:  # writes past the limit fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    kwargs = dict(
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=REPO,
        preexec_fn=limit_files if file_limit else None,
    )
    if not wait:
        return subprocess.Popen(command, **kwargs)
    return subprocess.run(command, **kwargs, timeout=300)


def parts_folders(out: Path) -> list[Path]:
    return sorted((out / "store").glob(".*.parts"))


def finished_blocks(out: Path) -> dict[str, list[int]]:
    """(inode, mtime_ns) of the finished blocks in the stores' parts folders, by 'folder/name'."""
    return {
        f"{w.name}/{p.name}": [p.stat().st_ino, p.stat().st_mtime_ns]
        for w in parts_folders(out)
        for p in w.glob("*.npy")
    }


def held_rows(out: Path) -> int:
    """Images embedded so far, summed over backbones: rows in the store files or in finished blocks (a block that
    a killed commit already merged counts once)."""
    rows = 0
    stores = {*(out / "store").glob("*.h5"), *(w.with_name(w.name[1 : -len(".parts")]) for w in parts_folders(out))}
    for store in stores:
        work = store.with_name(f".{store.name}.parts")
        held = set()
        if store.exists():
            held = {(d, s, int(i)) for (d, s, v), index in Store(store, None).held().items() if not v for i in index}
        plan = json.loads((work / "plan.json").read_text()) if (work / "plan.json").exists() else []
        held |= {(b["domain"], b["split"], i) for b in plan if (work / b["file"]).exists() for i in b["rows"]}
        rows += len(held)
    return rows


def read_log(log: Path) -> tuple[set[str], dict, int]:
    """(every renamed destination, the finished blocks seen at each store's first commit, rows forwarded)."""
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rewritten = {r["replace"] for r in records if "replace" in r}
    snapshot: dict = {}
    for r in records:
        for name, stamp in r.get("parts", {}).items():
            snapshot.setdefault(name, stamp)
    return rewritten, snapshot, sum(r.get("forward", 0) for r in records)


def visible(out: Path) -> dict[str, str]:
    """What a reader sees in --out and its store folder (hidden files aside): relative path -> sha256."""
    stores = (out / "store").glob
    files = [p for p in [*out.glob("*.h5"), *stores("*.h5"), *stores("*.h5.rows/*.h5")] if not p.name.startswith(".")]
    return {str(p.relative_to(out)): sha256(p) for p in files}


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_folders(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict:
    """What an undisturbed run leaves: the cache's name, every file with its sha256, the rows it forwarded."""
    out, log = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("log") / "log.jsonl"
    run = driver(folder_extract_args(data, out), log=log)
    assert run.returncode == 0, run.stderr
    _, _, forwarded = read_log(log)
    return {
        "cache": Path(json.loads(run.stdout)["cache"]).name,
        "files": visible(out),
        "layout": everything_in(out),
        "forwarded": forwarded,
    }


def assert_resumes_to_reference(data: Path, out: Path, reference: dict, before: dict, log: Path) -> dict:
    """Run the command again: the cache and the stores must equal the reference byte for byte, no image embedded
    before may be embedded again, the finished blocks must be neither rewritten nor touched, and nothing but the
    cache and the stores may be left in --out."""
    held = held_rows(out)
    again = driver(folder_extract_args(data, out), log=log)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert Path(result["cache"]).name == reference["cache"] and visible(out) == reference["files"]
    rewritten, snapshot, forwarded = read_log(log)
    assert forwarded == reference["forwarded"] - held, "images were embedded again, or some not at all"
    assert not rewritten & set(before), "finished blocks were computed again"
    assert {k: snapshot[k] for k in before} == before, "finished blocks were touched"
    assert everything_in(out) == reference["layout"]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kills", KILLS.values(), ids=KILLS.keys())
def test_extract_killed_anywhere_resumes_to_the_same_bytes(data, reference, tmp_path, kills):
    out = tmp_path / "out"
    for kill in kills:
        killed = driver(folder_extract_args(data, out), kill=kill)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        for name, digest in visible(out).items():  # only ever the finished cache; a store holds what it committed
            assert reference["files"][name] == digest or name.startswith("store/")
    before = finished_blocks(out)
    result = assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")
    assert result["cache_hit"] == (kills[-1] == f"after:os.replace:1:{CACHE_H5}")  # renamed: a hit that tidies up


@pytest.mark.slow
def test_extract_killed_from_outside_when_a_poll_sees_the_first_block(data, reference, tmp_path):
    out = tmp_path / "out"
    proc = driver(folder_extract_args(data, out), wait=False)
    wait_until(lambda: finished_blocks(out) or proc.poll() is not None, "the first finished block")
    proc.kill()  # SIGKILL
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the extraction ended before the kill: make it longer"
    before = finished_blocks(out)
    assert before and not list(out.glob("*.h5"))
    assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["first-block", "store"])
def test_full_disk_is_one_line_keeps_finished_blocks_and_resumes(data, reference, tmp_path, stage):
    """A real write failure from the kernel (RLIMIT_FSIZE: EFBIG), below the first block's size or below a store's.
    Decision: finished blocks stay (hidden parts folders) so the same command resumes; partial files go."""
    out = tmp_path / "out"
    limit = 2_000 if stage == "first-block" else 60_000  # a block is 7-19 kB, a store ~100 kB
    full = driver(folder_extract_args(data, out), file_limit=limit)
    assert full.returncode == 2 and "Traceback" not in full.stderr
    (line,) = [x for x in lines(full.stderr) if x.startswith("error:")]
    assert "file size limit reached while writing" in line and "File too large, ulimit -f" in line
    assert not list(out.glob("*.h5")) and all(reference["files"][n] == d for n, d in visible(out).items())
    assert not [p for p in everything_in(out) if p.endswith(".partial")]
    before = finished_blocks(out)  # a store small enough to be written is committed, the other keeps its blocks
    assert (len(before) == 0) == (stage == "first-block")
    assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")


@pytest.mark.slow
def test_second_extract_waits_on_the_lock_then_finds_the_cache(data, reference, tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    first = driver(folder_extract_args(data, out), pause=f"after:os.replace:1:*.npy:{go}", wait=False)
    wait_until(lambda: finished_blocks(out), "the first block")
    second = driver(folder_extract_args(data, out), wait=False)

    def second_waits_on_the_lock() -> bool:
        return any(
            "->" in line and str(second.pid) in line.split() for line in Path("/proc/locks").read_text().splitlines()
        )

    wait_until(second_waits_on_the_lock, "the second extraction to block on the lock")
    assert first.poll() is None and visible(out) == {}
    go.touch()
    results = [json.loads(p.communicate(timeout=300)[0]) for p in (first, second)]
    assert [r["cache_hit"] for r in results] == [False, True]
    assert {Path(r["cache"]).name for r in results} == {reference["cache"]} and visible(out) == reference["files"]
    assert everything_in(out) == reference["layout"]


@pytest.mark.slow
def test_two_extracts_at_once_compute_once_and_no_reader_sees_a_partial_cache(data, reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    procs = [driver(folder_extract_args(data, out), wait=False) for _ in range(2)]
    seen: dict[str, str] = {}  # what a poll finds: name -> sha256, each time
    while any(p.poll() is None for p in procs):
        with contextlib.suppress(FileNotFoundError):
            for name, digest in visible(out).items():
                assert reference["files"][name] == digest
                seen[name] = digest
        time.sleep(0.002)
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert sum(sum(r["embedded"].values()) for r in results) == reference["forwarded"]  # each image embedded once
    assert visible(out) == reference["files"] and everything_in(out) == reference["layout"]


GRID = [
    "grid",
    "--algo",
    "fedavg",
    "--grid",
    "lr=0.1,0.01,0.001",
    "--grid",
    "weight_decay=0,0.0001",
    "--seeds",
    "0",
    "--rounds",
    "2",
    "--chunk",
    "1",
    "--set",
    "batch_size=8",
    "--json",
]


@pytest.mark.slow
def test_grid_killed_after_two_chunks_resumes_without_retraining_them(tmp_path):
    cache = write_cache(tmp_path / "synthetic.h5")
    ref = driver([*GRID, "--cache", cache, "--out", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    killed = driver([*GRID, "--cache", cache, "--out", str(out)], kill="after:os.replace:2:chunk-*.json")
    assert killed.returncode == -signal.SIGKILL
    (folder,) = out.glob("grid-*")
    chunks = {p.name: [p.stat().st_ino, p.stat().st_mtime_ns] for p in folder.glob("chunk-*.json")}
    assert len(chunks) == 2 and not (folder / "grid.json").exists()
    log = tmp_path / "log.jsonl"
    again = driver([*GRID, "--cache", cache, "--out", str(out)], log=log)
    assert again.returncode == 0, again.stderr
    result, expected = json.loads(again.stdout), json.loads(ref.stdout)
    assert result["chunks_resumed"] == 2 and expected["chunks_resumed"] == 0
    assert not read_log(log)[0] & set(chunks)
    after = {p.name: [p.stat().st_ino, p.stat().st_mtime_ns] for p in folder.glob("chunk-*.json")}
    assert len(after) == 6 and all(after[name] == stamp for name, stamp in chunks.items())
    assert json.loads((folder / "grid.timing.json").read_text()) == {"chunks_resumed": 2}
    assert "chunks_resumed" not in json.loads((folder / "grid.json").read_text())  # same bytes as undisturbed
    moved = ("run_folder", "chunks_resumed", "retrain", "provenance")  # provenance names each run's own --out
    assert {k: v for k, v in result.items() if k not in moved} == {k: v for k, v in expected.items() if k not in moved}
    ours, theirs = result.pop("retrain"), expected.pop("retrain")
    files = [json.loads(Path(r.pop("result_file")).read_text()) for r in (ours, theirs)]
    assert [{k: v for k, v in f.items() if k != "provenance"} for f in files][0] == {
        k: v for k, v in files[1].items() if k != "provenance"
    }
    assert {k: v for k, v in ours.items() if k != "provenance"} == {
        k: v for k, v in theirs.items() if k != "provenance"
    }


# -- in-process: a full disk simulated at the two places extract writes -----------------------------------------


@pytest.mark.parametrize("where", ["block", "store"])
def test_enospc_is_disk_full_error_and_leaves_no_partial_file(data, tmp_path, monkeypatch, where):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "block":
        monkeypatch.setattr(os, "fsync", no_space)  # delayed allocation: the block's space runs out at sync
    else:
        monkeypatch.setattr(h5, "_new_dataset", no_space)  # every HDF5 dataset featcache writes is made there
    out = tmp_path / "out"
    with one_thread(), pytest.raises(DiskFullError, match="disk full while writing .*No space left on device"):
        extract(dataset="imagefolder", data_root=data, backbone=BACKBONES, image_size=32, batch_size=4, out=out)
    assert visible(out) == {} and not [p for p in everything_in(out) if p.endswith(".partial")]
    assert len(finished_blocks(out)) == (0 if where == "block" else 8)


def test_full_shared_memory_in_the_input_workers_is_one_line_not_a_hang(data, tmp_path, monkeypatch):
    """A worker's prepared images that cannot be placed in shared memory (a container's small /dev/shm) end the pass
    with one line naming /dev/shm and --workers 0; without it DataLoader's queue thread dies and the pass waits
    forever (an alarm fails the test instead of hanging it). The same command then runs with --workers 0."""
    import torch

    def full(self, *args, **kwargs):
        raise RuntimeError("unable to write to file </torch_1_2_0>: No space left on device (28)")

    def hung(*args):
        raise TimeoutError("the extraction hung on its input workers")

    # where every CPU tensor sent from a worker gets its shared memory; the workers are forked: they see it too
    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", full)
    out, kw = tmp_path / "out", dict(dataset="imagefolder", data_root=data, backbone=BACKBONES, image_size=32)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with one_thread(), pytest.raises(UserError) as raised:
            extract(**kw, batch_size=4, workers=2, out=out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    message = str(raised.value)
    assert "\n" not in message and "/dev/shm (No space left on device)" in message and "--workers 0" in message
    assert visible(out) == {} and not [p for p in everything_in(out) if p.endswith(".partial")]
    with one_thread():
        done = extract(**kw, batch_size=4, workers=0, out=out)
    assert Path(done["cache"]).is_file() and sum(done["embedded"].values()) > 0


def test_a_read_only_shared_memory_is_named_as_the_workers_semaphore_not_the_store(data, tmp_path, monkeypatch):
    """multiprocessing makes the input workers' semaphores in /dev/shm: a read-only one failed there with EROFS,
    reported as an unwritable store. One line names /dev/shm, the semaphore and --workers 0; nothing is written."""
    import errno
    import multiprocessing

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(multiprocessing, "Lock", read_only)
    out = tmp_path / "out"
    with one_thread(), pytest.raises(UserError) as raised:
        extract(
            dataset="imagefolder", data_root=data, backbone=BACKBONES, image_size=32, batch_size=4, workers=2, out=out
        )
    message = str(raised.value)
    assert message == (
        "cannot start 2 image worker(s): multiprocessing cannot make a semaphore in /dev/shm (Read-only file system): "
        "make /dev/shm writable or pass --workers 0"
    )
    assert visible(out) == {}
