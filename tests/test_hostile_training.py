"""Hostile and careless input to train / grid / report / info / verify. Each bad input is one line
on stderr starting with `error:`, exit code 2, no traceback, and no file created or changed anywhere in the test's
folder (no result, no run folder, no temporary). The table `CASES` is grouped as the issue is: output locations, grid
values after the first, setting ranges, devices, report inputs, malformed caches, memory. A bug that is not a user
error is one `internal error:` line with exit code 1 (FEATCACHE_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import torch
from harness import edit_cache, everything_in, lines, one_line_error, run_cli

from featcache import cache as C
from tests.synthetic import write_cache

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory) -> Path:
    return Path(write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5"))


@pytest.fixture(scope="module")
def good_result(good_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("result")
    res = run_cli("train", "--cache", good_cache, "--algo", "fedavg", "--rounds", "2", "--seeds", "0",
                  "--set", "batch_size=8", "--out", out, "--json")
    assert res.code == 0, res.stderr
    return Path(json.loads(res.stdout)["result_file"])


class Ctx:
    """What a case builds its arguments from: the test's own folder, a good cache, a good result file."""

    def __init__(self, tmp: Path, cache: Path, result: Path, monkeypatch) -> None:
        self.tmp, self.good_cache, self.result, self.monkeypatch = tmp, cache, result, monkeypatch
        self.out = tmp / "out"

    def cache(self) -> Path:
        return Path(shutil.copy(self.good_cache, self.tmp / "c.h5"))

    def file(self, name: str, content: str | bytes) -> Path:
        p = self.tmp / name
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return p


def train(*extra: str, algo: str = "fedavg") -> Callable[[Ctx], list]:
    return lambda x: ["train", "--cache", x.cache(), "--algo", algo, "--rounds", "1", "--seeds", "0", "--set",
                      "batch_size=8", "--out", x.out, *extra]


def grid(*extra: str, algo: str = "fedavg", axis: str = "lr=0.1,0.01") -> Callable[[Ctx], list]:
    return lambda x: ["grid", "--cache", x.cache(), "--algo", algo, "--grid", axis, "--seeds", "0", "--rounds", "1",
                      "--set", "batch_size=8", "--out", x.out, *extra]


def with_out(make: Callable[[Ctx], list], out: Callable[[Ctx], Path]) -> Callable[[Ctx], list]:
    """A command whose --out is replaced by out(ctx)."""

    def build(x: Ctx) -> list:
        args = make(x)
        args[args.index("--out") + 1] = out(x)
        return args

    return build


def a_file(x: Ctx) -> Path:
    return x.file("taken", "I am a file")


def below_a_file(x: Ctx) -> Path:
    return a_file(x) / "sub" / "runs"


def read_only(x: Ctx) -> Path:
    folder = x.tmp / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real = os.access
        x.monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if Path(p) == folder else real(p, m, *a, **k))
    return folder / "runs"


def fail_rename(code: int) -> Callable[[Ctx], list]:
    """Any command; the atomic writer's final rename fails with `code` (what a full disk or a size limit does)."""

    def arm(x: Ctx) -> None:
        def refuse(src, dst):
            raise OSError(code, os.strerror(code), str(dst))

        x.monkeypatch.setattr("featcache.atomic.os.replace", refuse)

    return arm


def armed(arm: Callable[[Ctx], None], make: Callable[[Ctx], list]) -> Callable[[Ctx], list]:
    def build(x: Ctx) -> list:
        args = make(x)
        arm(x)
        return args

    return build


def report(*files: Callable[[Ctx], Path], out: bool = False) -> Callable[[Ctx], list]:
    return lambda x: ["report", *[f(x) for f in files], *(["--out", x.out] if out else [])]


def result_edited(edit: Callable[[dict], None]) -> Callable[[Ctx], Path]:
    def make(x: Ctx) -> Path:
        r = json.loads(x.result.read_text())
        edit(r)
        return x.file("edited.json", json.dumps(r))

    return make


def drop(key: str) -> Callable[[dict], None]:
    return lambda r: r.pop(key)


def shorter_curve(r: dict) -> None:
    r["curve"]["mean_acc"] = r["curve"]["mean_acc"][:-1]


def wrong_type(r: dict) -> None:
    r["mean_acc"] = "high"


def tampered(edit: Callable[[h5py.File], None], reseal: bool = True) -> Callable[[Ctx], Path]:
    """A copy of the good cache edited in place (checksums rewritten, so only the content checks can tell)."""

    return lambda x: edit_cache(x.cache(), edit, reseal)


def cmd(command: str, make_cache: Callable[[Ctx], Path], *extra: str) -> Callable[[Ctx], list]:
    def build(x: Ctx) -> list:
        path = make_cache(x)
        if command == "train":
            return ["train", "--cache", path, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out", x.out]
        return [command, path, *extra]

    return build


def no_backbones(f: h5py.File) -> None:
    del f["backbones"]


def array_attr(f: h5py.File) -> None:
    f.attrs["classes"] = np.arange(3)


def not_json_attr(f: h5py.File) -> None:
    f.attrs["counts"] = "{not json"


def no_clients(f: h5py.File) -> None:
    del f["clients"]
    f.attrs["counts"] = json.dumps({"clients": []})
    f.attrs["images"] = 0


def zero_row_client(f: h5py.File) -> None:
    """Client 1 keeps no training rows; the counts are rewritten to agree, so only the zero-row check can tell."""
    meta = C.read_attrs(f)
    g = f["clients/001/train"]
    for name in list(g):
        if isinstance(g[name], h5py.Group):
            for b in list(g[name]):
                ds = g[name][b]
                del g[name][b]
                g[name][b] = np.zeros((0, *ds.shape[1:]), ds.dtype)
        else:
            ds = g[name]
            del g[name]
            g[name] = np.zeros((0,), ds.dtype)
    rows = meta["counts"]["clients"]
    meta_images = meta["images"] - rows[1]["train"]
    rows[1]["train"], rows[1]["val"] = 0, 0
    f.attrs["counts"] = json.dumps({"clients": rows}, sort_keys=True)
    f.attrs["images"] = meta_images


def concat_differs(f: h5py.File) -> None:
    f["backbones/synth"].attrs["columns"] = "[1, 17]"


def label_out_of_range(f: h5py.File) -> None:
    f["clients/000/train/labels"][0] = 99


HUGE = str(2**63)

# name -> (arguments built in the test's folder, text the one stderr line contains)
CASES: dict[str, tuple[Callable[[Ctx], list], str]] = {
    # 1. output locations (train, grid, report)
    "train-out-is-a-file": (with_out(train(), a_file), "is a file, not a folder"),
    "grid-out-is-a-file": (with_out(grid(), a_file), "is a file, not a folder"),
    "report-out-is-a-file": (lambda x: ["report", x.result, "--out", a_file(x)], "is a file, not a folder"),
    "train-out-below-a-file": (with_out(train(), below_a_file), "is below the file"),
    "grid-out-below-a-file": (with_out(grid(), below_a_file), "is below the file"),
    "report-out-below-a-file": (lambda x: ["report", x.result, "--out", below_a_file(x)], "is below the file"),
    "train-out-read-only": (with_out(train(), read_only), "not writable"),
    "grid-out-read-only": (with_out(grid(), read_only), "not writable"),
    "report-out-read-only": (lambda x: ["report", x.result, "--out", read_only(x)], "not writable"),
    "train-disk-full": (armed(fail_rename(errno.ENOSPC), train()), "disk full"),
    "train-file-size-limit": (armed(fail_rename(errno.EFBIG), train()), "file size limit"),
    "grid-permission-at-write": (armed(fail_rename(errno.EACCES), grid()), "permission denied"),
    "report-eperm-at-write": (armed(fail_rename(errno.EPERM), lambda x: ["report", x.result, "--out", x.out]),
                              "permission denied"),
    # 2. grid values after the first, and the grid's own options
    "grid-batch-size-0": (grid(axis="batch_size=32,0"), "batch_size=0 out of range"),
    "grid-rounds-0": (grid(axis="rounds=2,0"), "rounds=0 out of range"),
    "grid-proj-dim-0": (grid(algo="fedpcl", axis="proj_dim=16,0"), "proj_dim=0 out of range"),
    "grid-optimizer-bogus": (grid(axis="optimizer=adam,bogus"), "optimizer must be one of adam, sgd (got 'bogus')"),
    "grid-participation-2": (grid(axis="participation=0.5,2"), "participation=2.0 out of range"),
    "grid-chunk-0": (grid("--chunk", "0"), "--chunk 0"),
    "grid-chunk-negative": (grid("--chunk", "-1"), "--chunk -1"),
    "grid-axis-twice": (grid("--grid", "lr=0.5"), "--grid lr is given twice"),
    "grid-value-twice": (grid(axis="lr=0.1,0.1"), "lists 0.1 twice"),
    "grid-axis-and-set": (grid("--set", "lr=0.5"), "lr is both a --grid axis and --set lr"),
    "grid-axis-and-rounds": (grid(axis="rounds=1,2"), "rounds is both a --grid axis and --rounds"),
    "grid-empty-value": (grid(axis="lr=0.1,"), "empty value"),
    "grid-fedpft-heads": (grid(algo="fedpft", axis="heads=1,3"), "must be a multiple of heads=3"),
    # 3. settings out of their declared ranges, conflicts, seeds
    "lr-negative": (train("--set", "lr=-1"), "lr=-1.0 out of range"),
    "lr-nan": (train("--set", "lr=nan"), "lr=nan is not a finite number"),
    "fedprox-mu-negative": (train("--set", "mu=-100", algo="fedprox"), "mu=-100.0 out of range"),
    "fedpcl-tau-negative": (train("--set", "tau=-1", algo="fedpcl"), "tau=-1.0 out of range"),
    "fedcac-tau-above-one": (train("--set", "tau=2", algo="fedcac"), "tau=2.0 out of range: tau must satisfy 0 <= tau"),
    "momentum-negative": (train("--set", "momentum=-5"), "momentum=-5.0 out of range"),
    "momentum-one": (train("--set", "momentum=1"), "momentum=1.0 out of range"),
    "participation-selects-nobody": (train("--set", "participation=1e-9"), "selects no client"),
    "rounds-twice": (train("--set", "rounds=3"), "--rounds 1 and --set rounds=3 both given"),
    "set-key-twice": (train("--set", "lr=0.1", "--set", "lr=0.2"), "--set lr is given twice"),
    "seeds-duplicate": (lambda x: train()(x) + ["--seeds", "0,0"], "lists seed 0 twice"),
    "seeds-huge": (lambda x: train()(x) + ["--seeds", HUGE], f"seed {HUGE} is out of range"),
    "seeds-negative": (lambda x: train()(x) + ["--seeds", "-1"], "seed -1 is out of range"),
    "grid-seeds-huge": (lambda x: grid()(x) + ["--seeds", "1" + HUGE], "is out of range"),
    "algo-twice": (lambda x: train()(x) + ["--algo", "fedavg"], "--algo fedavg is given twice"),
    "second-algo-bad-setting": (lambda x: train("--set", "mu=-1")(x) + ["--algo", "fedprox"], "unknown setting 'mu'"),
    "int-setting-huge": (train("--set", "eval_every=" + HUGE), "too large"),
    # 4. devices
    "train-device-foo": (train("--device", "foo"), "is not a device"),
    "grid-device-foo": (grid("--device", "foo"), "is not a device"),
    "train-device-cuda": (train("--device", "cuda"), "CUDA is not available"),
    "grid-device-cuda-9": (grid("--device", "cuda:9"), "CUDA"),
    # 5. report inputs (a single bad file is refused; see the multi-file test for skipping)
    "report-timing-sidecar": (report(lambda x: x.result.with_suffix(".timing.json")), ".timing.json sidecar"),
    "report-grid-json": (report(lambda x: x.file("grid.json", json.dumps({"axes": {}, "selection": []}))),
                         "a grid summary"),
    "report-empty-object": (report(lambda x: x.file("e.json", "{}")), "no algorithm name"),
    "report-list": (report(lambda x: x.file("l.json", "[1, 2]")), "a JSON list"),
    "report-null": (report(lambda x: x.file("n.json", "null")), "a JSON null"),
    "report-wrong-type": (report(result_edited(wrong_type)), "'mean_acc' is missing or not a finite number"),
    "report-no-curve": (report(result_edited(drop("curve")), out=True), "no accuracy 'curve'"),
    "report-curve-lengths": (report(result_edited(shorter_curve), out=True), "of the same length"),
    "report-binary": (report(lambda x: x.file("b.json", bytes(range(256)))), "not JSON"),
    "report-the-cache": (report(lambda x: x.cache()), "not JSON"),
    "report-missing": (report(lambda x: x.tmp / "none.json"), "does not exist"),
    "report-only-non-results": (lambda x: ["report", x.result.with_suffix(".timing.json"), x.file("e.json", "{}")],
                                "none of the 2 inputs is a featcache result file"),
    # 6. malformed caches reaching info / verify / train
    "info-no-backbones": (cmd("info", tampered(no_backbones)), "no backbones group"),
    "info-array-attribute": (cmd("info", tampered(array_attr)), "attribute 'classes' is an array"),
    "info-not-json-attribute": (cmd("info", tampered(not_json_attr)), "an attribute is not valid JSON"),
    "verify-no-clients": (cmd("verify", tampered(no_clients)), "no clients"),
    "train-no-clients": (cmd("train", tampered(no_clients)), "no clients"),
    "verify-zero-row-client": (cmd("verify", tampered(zero_row_client)), "client 001 has no training rows"),
    "train-zero-row-client": (cmd("train", tampered(zero_row_client)), "client 001 has no training rows"),
    "verify-concat-differs": (cmd("verify", tampered(concat_differs)),
                              "backbones/synth: columns [1, 17] do not follow the backbones before it"),
    "verify-label-out-of-range": (cmd("verify", tampered(label_out_of_range)), "labels: values outside 0..4"),
    # 7. memory
    "train-memory-proj-dim": (train("--set", "proj_dim=10000000", algo="fedpcl"), "lower proj_dim"),
    "grid-memory-proj-dim": (grid(algo="fedpcl", axis="proj_dim=16,10000000"), "lower proj_dim"),
}


def snapshot(folder: Path) -> dict[str, str]:
    """Every path below `folder` with its content hash (folders: 'dir'), hidden files included."""
    return {p: ("dir" if (folder / p).is_dir() else hashlib.sha256((folder / p).read_bytes()).hexdigest())
            for p in everything_in(folder)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_exit_2_and_changes_nothing(good_cache, good_result, tmp_path, monkeypatch, case):
    make, needle = case
    x = Ctx(tmp_path, good_cache, good_result, monkeypatch)
    args = make(x)
    if "cuda" in map(str, args) and torch.cuda.is_available():  # cuda:9 stays refused where a GPU exists
        pytest.skip("CUDA is available on this machine")
    before, result_before = snapshot(tmp_path), snapshot(good_result.parent)
    one_line_error(run_cli(*args), needle)
    after = snapshot(tmp_path)
    created = sorted(set(after) - set(before))
    assert created in ([], ["out"]) and everything_in(x.out) == [], created  # an empty --out folder at most
    assert {k: v for k, v in after.items() if k in before} == before
    assert snapshot(good_result.parent) == result_before


def test_report_skips_non_result_files_with_a_note_and_writes_both_files(good_result, tmp_path):
    folder = good_result.parent
    (tmp_path / "grid.json").write_text(json.dumps({"axes": {}, "selection": []}))
    visible = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]  # as `runs/*` expands
    res = run_cli("report", *visible, tmp_path / "grid.json", "--out", tmp_path / "rep")
    assert res.code == 0, res.stderr
    notes = lines(res.stderr)
    assert len(notes) == 2 and all(n.startswith("note: skipped") for n in notes), notes
    assert any(".timing.json" in n for n in notes) and any("grid.json" in n for n in notes)
    assert "| fedavg |" in res.stdout
    assert everything_in(tmp_path / "rep") == ["clients.png", "curves.png", "report.md"]


def test_legitimate_edges_still_run(good_cache, tmp_path):
    """Values at the edge of their range are accepted: participation=1/C rounds to one client, momentum 0, mu 0."""
    res = run_cli("train", "--cache", good_cache, "--algo", "fedprox", "--rounds", "1", "--seeds", "0,4294967295",
                  "--set", "participation=0.25", "--set", "momentum=0", "--set", "mu=0", "--set", "batch_size=8",
                  "--out", tmp_path, "--json")
    assert res.code == 0, res.stderr


def test_unexpected_exception_is_one_internal_error_line_exit_1(good_cache, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated bug\nsecond line")

    monkeypatch.setattr("featcache.training.train.run_configs", boom)
    args = ["train", "--cache", good_cache, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out", tmp_path]
    monkeypatch.delenv("FEATCACHE_DEBUG", raising=False)
    res = run_cli(*args)
    assert res.code == 1 and "Traceback" not in res.stderr
    (line,) = lines(res.stderr)
    assert line.startswith("internal error: RuntimeError: simulated bug;") and "FEATCACHE_DEBUG=1" in line
    assert "please report it" in line
    monkeypatch.setenv("FEATCACHE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="simulated bug"):
        run_cli(*args)


def test_real_file_size_limit_in_a_subprocess(good_cache, tmp_path):
    """RLIMIT_FSIZE (ulimit -f) reached while writing the result: EFBIG from the kernel, one line, no temporary."""
    out = tmp_path / "runs"
    code = (f"ulimit -f 1; exec {sys.executable} -m featcache.cli train --cache {good_cache} --algo fedavg "
            f"--rounds 2 --seeds 0 --set batch_size=8 --out {out}")
    proc = subprocess.run(["bash", "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 2, proc.stderr
    (line,) = lines(proc.stderr)
    assert line.startswith("error:") and "file size limit" in line, line
    assert everything_in(out) == []


def test_out_of_memory_at_run_time_is_one_line_exit_2(good_cache, tmp_path, monkeypatch):
    """Should the up-front estimate be too low, the allocator's failure is still one line naming what to lower."""
    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 43000000000 bytes")

    monkeypatch.setattr("featcache.training.train.run_configs", oom)
    res = run_cli("train", "--cache", good_cache, "--algo", "fedavg", "--rounds", "1", "--seeds", "0", "--out",
                  tmp_path)
    one_line_error(res, "out of memory")
    assert everything_in(tmp_path) == []
