"""Faults injected into real `featcache` processes: kill -9 at every stage of `extract` and during a `grid`, a full
disk, two extractions of one cache at once. After each, the same command must finish with exactly the bytes of an
undisturbed run, without recomputing finished work, and no reader may ever see a partial cache.

The processes run `tests/crashpoint.py`, which starts the real CLI and sends itself SIGKILL at a named point (the
N-th block renamed into place, the N-th forward pass, the N-th HDF5 dataset written, ...): a kill -9 that lands at
the same place every time. One test kills from outside instead, at whatever moment a poll catches.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from harness import BACKBONES, everything_in, folder_extract_args, lines, one_thread, sha256, write_folders

from featcache.extraction.plan import DiskFullError, extract
from tests.synthetic import write_cache

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("crashpoint.py")
ENV = os.environ | {"OMP_NUM_THREADS": "1"}  # on a busy 2-core machine, two OpenMP threads spin and crawl
BLOCKS = {f"b{j}.{c:03d}.{s}.features.npy" for j in range(2) for c in range(2) for s in ("train", "test")}
FINISHED = BLOCKS | {"b0.json", "b1.json"}  # what a backbone leaves in the parts folder once done

# Each case: the kill -9 of each interrupted run, in order (then one clean run). One pass embeds each (client, split)
# block for both backbones, so the blocks are renamed into place in the order b0.000.train, b1.000.train, b0.000.test,
# b1.000.test, b0.001.train, ...; batch size 4 gives 5 + 2 batches per client, each a forward pass per backbone.
# The assembly (`cache.write`) creates 9 datasets per client: labels, source_index, domain and features/concat for
# train, then for test, then val_index.
KILLS = {
    "after-block-1": ["after:os.replace:1:b*.npy"],
    "after-block-2": ["after:os.replace:2:b*.npy"],
    "after-block-3": ["after:os.replace:3:b*.npy"],
    "after-block-5-second-client": ["after:os.replace:5:b*.npy"],
    "inside-block-3": ["after:featcache.extraction.plan._forward:8:*"],
    "inside-assembly": ["after:h5py.Group.create_dataset:13:*"],  # client 001's train features, not yet filled
    "before-final-rename": ["before:os.replace:1:*.h5"],
    "after-final-rename": ["after:os.replace:1:*.h5"],
    "killed-twice": ["after:os.replace:2:b*.npy", "after:os.replace:3:b*.npy"],
}


def driver(args: list[str], kill: str | None = None, pause: str | None = None, log: Path | None = None,
           file_limit: int | None = None, wait: bool = True):
    options = [*(["--kill", kill] if kill else []), *(["--pause", pause] if pause else []),
               *(["--log", str(log)] if log else [])]
    command = [sys.executable, str(DRIVER), *options, "--", *args]

    def limit_files() -> None:  # writes past the limit fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO,
                  preexec_fn=limit_files if file_limit else None)
    if not wait:
        return subprocess.Popen(command, **kwargs)
    return subprocess.run(command, **kwargs, timeout=300)


def parts_folder(out: Path) -> Path | None:
    found = list(out.glob(".*.parts"))
    return found[0] if found else None


def finished_blocks(out: Path) -> dict[str, list[int]]:
    """(inode, mtime_ns) of the finished blocks in the parts folder."""
    parts = parts_folder(out)
    return {p.name: [p.stat().st_ino, p.stat().st_mtime_ns] for p in parts.iterdir() if p.name in FINISHED} \
        if parts else {}


def read_log(log: Path) -> tuple[set[str], dict | None]:
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rewritten = {r["replace"] for r in records if "replace" in r}
    snapshot = next((r["parts"] for r in records if "parts" in r), None)
    return rewritten, snapshot


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_folders(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> tuple[str, str]:
    """(file name, sha256) of the cache an undisturbed run writes."""
    run = driver(folder_extract_args(data, tmp_path_factory.mktemp("reference")))
    assert run.returncode == 0, run.stderr
    path = Path(json.loads(run.stdout)["cache"])
    return path.name, sha256(path)


def assert_resumes_to_reference(data: Path, out: Path, reference, before: dict, log: Path) -> dict:
    """Run the command again: the cache must equal the reference byte for byte, the blocks finished before must be
    neither rewritten nor touched, and nothing but the cache may be left in --out."""
    name, digest = reference
    again = driver(folder_extract_args(data, out), log=log)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert Path(result["cache"]).name == name and sha256(result["cache"]) == digest
    rewritten, snapshot = read_log(log)
    assert not rewritten & set(before), "finished blocks were computed again"
    if not result["cache_hit"]:
        assert rewritten & FINISHED == FINISHED - set(before), "the resumed run must compute exactly what was missing"
        assert {k: snapshot[k] for k in before} == before, "finished blocks were touched"
    assert everything_in(out) == [name]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kills", KILLS.values(), ids=KILLS.keys())
def test_extract_killed_anywhere_resumes_to_the_same_bytes(data, reference, tmp_path, kills):
    out = tmp_path / "out"
    for kill in kills:
        killed = driver(folder_extract_args(data, out), kill=kill)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        for visible in (p for p in out.iterdir() if not p.name.startswith(".")):  # only ever the finished cache
            assert (visible.name, sha256(visible)) == reference
    before = finished_blocks(out)
    result = assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")
    assert result["cache_hit"] == (kills[-1] == "after:os.replace:1:*.h5")  # renamed: a hit that tidies up


@pytest.mark.slow
def test_extract_killed_from_outside_when_a_poll_sees_the_first_block(data, reference, tmp_path):
    out = tmp_path / "out"
    proc = driver(folder_extract_args(data, out), wait=False)
    wait_until(lambda: (p := parts_folder(out)) is not None and any(p.glob("b*.npy")) or proc.poll() is not None,
               "the first finished block")
    proc.kill()  # SIGKILL
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the extraction ended before the kill: make it longer"
    before = finished_blocks(out)
    assert before and not list(out.glob("*.h5"))
    assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["first-block", "assembly"])
def test_full_disk_is_one_line_keeps_finished_blocks_and_resumes(data, reference, tmp_path, stage):
    """A real write failure from the kernel (RLIMIT_FSIZE: EFBIG), below the first block's size or below the
    cache's. Decision: finished blocks stay (hidden parts folder) so the same command resumes; partial files go."""
    out = tmp_path / "out"
    limit = 2_000 if stage == "first-block" else 60_000  # a block is 7-19 kB, the cache ~100 kB
    full = driver(folder_extract_args(data, out), file_limit=limit)
    assert full.returncode == 2 and "Traceback" not in full.stderr
    (line,) = [x for x in lines(full.stderr) if x.startswith("error:")]
    assert "disk full while writing" in line and "File too large" in line
    assert [p for p in everything_in(out) if not p.startswith(".")] == []
    assert not [p for p in everything_in(out) if p.endswith(".partial")]
    before = finished_blocks(out)
    assert set(before) == (set() if stage == "first-block" else FINISHED)
    assert_resumes_to_reference(data, out, reference, before, tmp_path / "log.jsonl")


@pytest.mark.slow
def test_second_extract_waits_on_the_lock_then_finds_the_cache(data, reference, tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    first = driver(folder_extract_args(data, out), pause=f"after:os.replace:1:b*.npy:{go}", wait=False)
    wait_until(lambda: (p := parts_folder(out)) is not None and any(p.glob("b*.npy")), "the first block")
    second = driver(folder_extract_args(data, out), wait=False)

    def second_waits_on_the_lock() -> bool:
        return any("->" in line and str(second.pid) in line.split() for line in Path("/proc/locks").read_text()
                   .splitlines())

    wait_until(second_waits_on_the_lock, "the second extraction to block on the lock")
    assert first.poll() is None and not list(out.glob("*.h5"))
    go.touch()
    results = [json.loads(p.communicate(timeout=300)[0]) for p in (first, second)]
    assert [r["cache_hit"] for r in results] == [False, True]
    assert {Path(r["cache"]).name for r in results} == {reference[0]} and sha256(results[1]["cache"]) == reference[1]
    assert everything_in(out) == [reference[0]]


@pytest.mark.slow
def test_two_extracts_at_once_compute_once_and_no_reader_sees_a_partial_cache(data, reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    procs = [driver(folder_extract_args(data, out), wait=False) for _ in range(2)]
    seen: set[str] = set()  # the visible names, and the sha256 of the cache each time a poll finds it
    while any(p.poll() is None for p in procs):
        for p in out.iterdir():
            if not p.name.startswith("."):
                seen.add(p.name)
                seen.add(sha256(p))
        time.sleep(0.002)
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert seen <= set(reference) and everything_in(out) == [reference[0]]
    assert sha256(out / reference[0]) == reference[1]


GRID = ["grid", "--algo", "fedavg", "--grid", "lr=0.1,0.01,0.001", "--grid", "weight_decay=0,0.0001", "--seeds", "0",
        "--rounds", "2", "--chunk", "1", "--set", "batch_size=8", "--json"]


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
    moved = ("run_folder", "chunks_resumed", "retrain", "provenance")  # provenance names each run's own --out
    assert {k: v for k, v in result.items() if k not in moved} == {k: v for k, v in expected.items() if k not in moved}
    ours, theirs = result.pop("retrain"), expected.pop("retrain")
    files = [json.loads(Path(r.pop("result_file")).read_text()) for r in (ours, theirs)]
    assert [{k: v for k, v in f.items() if k != "provenance"} for f in files][0] == \
        {k: v for k, v in files[1].items() if k != "provenance"}
    assert {k: v for k, v in ours.items() if k != "provenance"} == {k: v for k, v in theirs.items() if k != "provenance"}


# -- in-process: a full disk simulated at the two places extract writes -----------------------------------------


@pytest.mark.parametrize("where", ["block", "assembly"])
def test_enospc_is_disk_full_error_and_leaves_no_partial_file(data, tmp_path, monkeypatch, where):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "block":
        monkeypatch.setattr(os, "fsync", no_space)  # delayed allocation: the block's space runs out at sync
    else:
        monkeypatch.setattr(h5py.Group, "create_dataset", no_space)
    out = tmp_path / "out"
    with one_thread(), pytest.raises(DiskFullError, match="disk full while writing .*No space left on device"):
        extract(dataset="imagefolder", data_root=data, backbone=BACKBONES, image_size=32, batch_size=4, out=out)
    left = everything_in(out)
    assert not [p for p in left if p.endswith(".partial") or not p.startswith(".")]
    kept = {Path(p).name for p in left} & FINISHED
    assert kept == (set() if where == "block" else FINISHED)
