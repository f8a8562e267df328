"""Exact resume of what is made of several runs: a `grid` killed between its chunks or in its retrain, and a
reproduction's jobs killed anywhere, run again write the bytes of an undisturbed run (every file a user gets, the
timing sidecars aside, compared byte for byte).

In process, a kill is an exception raised at a chosen point (the N-th local training of the process, or a progress
tick), which leaves what a kill -9 leaves; the grid's retrain and the jobs' `train` checkpoint by time (every 60 s
by default), so the tests set that interval to 0 s: a checkpoint at every round, and a kill resumes from the last.
The slow test kills `featcache grid` with a real SIGKILL (tests/crashpoint.py).
"""

from __future__ import annotations

import difflib
import json
import signal
from pathlib import Path

import pytest
from harness import driver

from featcache.reproduce import Job, run_job
from featcache.runs import checkpoint
from featcache.training.engine import Engine
from featcache.runs.select import grid
from tests.synthetic import write_cache


class Killed(BaseException):
    """What a kill -9 does to the command in process: it ends where it is, no handler of it sees it."""


@pytest.fixture
def checkpoint_every_round(monkeypatch):
    monkeypatch.setattr(checkpoint, "EVERY_SECONDS", 0.0)


def kill_at_local_train(monkeypatch, n: int) -> None:
    """Engine.local_train raises Killed when its n-th call of the process returns."""
    real, calls = Engine.local_train, []

    def local_train(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise Killed
        return out

    monkeypatch.setattr(Engine, "local_train", local_train)


def same_files(a: Path, b: Path) -> None:
    """The files `files` lists under a and b are the same, byte for byte (a's own path written as b's)."""
    ours, theirs = files(a), files(b)
    assert ours and ours.keys() == theirs.keys()
    differ = [k for k in ours if ours[k].replace(bytes(a), bytes(b)) != theirs[k]]
    assert not differ, [
        (
            k,
            *difflib.unified_diff(
                ours[k].decode(errors="replace").splitlines(), theirs[k].decode(errors="replace").splitlines(), n=0
            ),
        )[:8]
        for k in differ
    ]


def files(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` a user gets, by relative path: hidden files (checkpoints, done records) and
    timing sidecars (wall-clock times, how a run went) aside."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and ".timing." not in p.name
        and p.name != "grid.timing.json"
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "c.h5", C=4, D=256, K=6, n=(40, 90), spread=4.0)


GRID = dict(grid=["lr=0.1,0.01,0.001"], seeds=[0, 1], rounds=4, set=["batch_size=16", "proj_dim=32"], chunk=2)


def test_a_grid_killed_between_chunks_and_in_its_retrain_resumes_to_the_same_bytes(
    cache, tmp_path, monkeypatch, checkpoint_every_round
):
    ref = grid(cache, "fedprox", out=tmp_path / "ref", **GRID)
    assert ref["chunks"] == 3
    out = tmp_path / "stopped"

    def kill_on(label: str, at: int):
        def tick(what, done, total):
            if what == label and done == at:
                raise Killed

        return tick

    with pytest.raises(Killed):  # after two of the three chunks are written
        grid(cache, "fedprox", out=out, progress=kill_on("grid chunks", 2), **GRID)
    with pytest.raises(Killed):  # the last chunk trained, then the retrain killed after its round 3
        grid(cache, "fedprox", out=out, progress=kill_on("grid retrain", 3), **GRID)
    again = grid(cache, "fedprox", out=out, **GRID)
    folder = Path(again["run_folder"])
    assert again["chunks_resumed"] == 3
    (timing,) = folder.glob("fedprox-*.timing.json")
    assert json.loads(timing.read_text())["resumed_after_round"] == 2  # the retrain went on from its checkpoint
    same_files(out, tmp_path / "ref")


def test_a_grid_resumed_where_memory_plans_other_chunks_keeps_its_chunking(cache, tmp_path, monkeypatch):
    """Chunks sized from memory: the killed run planned 2 models a chunk, the resumed one would plan 6 (more memory
    free now); it keeps the 2 its finished chunks were trained in, which its result records."""
    from featcache.runs import select as grid_module

    args = GRID | {"chunk": None}
    monkeypatch.setattr(grid_module, "plan_chunk", lambda n, per_model, budget: 2)
    ref = grid(cache, "fedprox", out=tmp_path / "ref", **args)
    out = tmp_path / "stopped"
    tick = lambda what, done, total: (_ for _ in ()).throw(Killed) if what == "grid chunks" and done == 1 else None
    with pytest.raises(Killed):
        grid(cache, "fedprox", out=out, progress=tick, **args)
    monkeypatch.setattr(grid_module, "plan_chunk", lambda n, per_model, budget: n)
    again = grid(cache, "fedprox", out=out, **args)
    assert ref["chunk_size"] == again["chunk_size"] == 2 and again["chunks_resumed"] == 1
    same_files(out, tmp_path / "ref")


def test_a_sweep_killed_between_its_caches_and_in_the_next_resumes_to_the_same_bytes(
    tmp_path, monkeypatch, checkpoint_every_round
):
    """`train` over two caches, killed once the first cache's run is written and before the next starts, then in the
    second cache's round 2: the same call skips the finished run, resumes the other and writes the bytes of an
    undisturbed sweep."""
    from featcache.runs import train as train_module

    caches = [write_cache(tmp_path / f"{a}.h5", spread=a, partition={"alpha": a}) for a in (1.0, 2.0)]
    args = dict(cache=caches, algo="fedavg", seeds=[0], rounds=2)
    ref = train_module.train(out=tmp_path / "ref", **args)
    out = tmp_path / "stopped"
    real, runs = train_module.run, []

    def killed_at_the_second(*a, **k):
        runs.append(1)
        if len(runs) == 2:
            raise Killed  # the first cache's run written, the second's not begun
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(train_module, "run", killed_at_the_second)
        with pytest.raises(Killed):
            train_module.train(out=out, **args)
    with monkeypatch.context() as m:
        kill_at_local_train(m, 2)
        with pytest.raises(Killed):
            train_module.train(out=out, **args)
    again = train_module.train(out=out, **args)["runs"]
    assert again[0]["finished_earlier"] and again[1]["resumed_after_round"] == 1 and len(ref["runs"]) == 2
    same_files(out, tmp_path / "ref")


def job(**change) -> Job:
    spec = dict(
        extract=json.dumps({"backbone": ["synth"]}),
        algo="fedavg",
        settings=json.dumps({"batch_size": 16}),
        rounds=3,
        seeds=(0, 1),
        backbones=None,
        grid="{}",
        needs=(),
    )
    return Job(**spec | change)


JOBS = [job(), job(algo="fedproto", needs=("probe",)), job(algo="fedprox", grid=json.dumps({"mu": [0.01, 0.1]}))]


def run_jobs(cache, out: Path) -> list[dict]:
    info = {
        "cache": cache,
        "key": "synthetic",
        "client_domains": ["synth"] * 4,
        "backbones": ["synth"],
        "dims": [256],
        "classes": 6,
    }
    return [run_job(j, info, out) for j in JOBS]


@pytest.mark.parametrize("kills", [[2], [5, 4, 5]], ids=["in-the-first-job", "in-the-second-the-grid-the-retrain"])
def test_a_reproductions_jobs_killed_anywhere_resume_to_the_same_bytes(
    cache, tmp_path, monkeypatch, kills, checkpoint_every_round
):
    """Kills at the N-th local training of each process in turn (the jobs: fedavg, fedproto, a grid over fedprox's
    mu and its retrain, 3 rounds each; [5, 4, 5]: fedproto's round 2, then the grid's round 2, then the retrain's
    round 2): the same jobs run again give the same results, memos and run files."""
    ref = run_jobs(cache, tmp_path / "ref")
    out = tmp_path / "stopped"
    for n in kills:
        with monkeypatch.context() as m:
            kill_at_local_train(m, n)
            with pytest.raises(Killed):
                run_jobs(cache, out)
    again = run_jobs(cache, out)
    strip = lambda runs: json.loads(json.dumps(runs).replace(str(out), "OUT").replace(str(tmp_path / "ref"), "OUT"))
    assert strip(again) == strip(ref)
    same_files(out, tmp_path / "ref")


@pytest.mark.slow
def test_a_grid_killed_with_sigkill_resumes_to_the_same_bytes(cache, tmp_path):
    """`featcache grid` in real processes: kill -9 after its second chunk file, then in its retrain's round 3 (the
    7th local training of that process: its last chunk's 4 rounds come first), then run to the end."""
    args = [
        "grid",
        "--cache",
        cache,
        "--algo",
        "fedprox",
        "--grid",
        "lr=0.1,0.01,0.001",
        "--seeds",
        "0,1",
        "--rounds",
        "4",
        "--set",
        "batch_size=16",
        "--set",
        "proj_dim=32",
        "--chunk",
        "2",
        "--out",
        "runs",
    ]

    def run(cwd: Path, fault=()):
        return driver(cwd, args, fault)

    ref = run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "stopped"
    for fault in (
        ["--kill", "after:os.replace:2:chunk-*.json"],
        ["--kill", "after:featcache.training.engine.Engine.local_train:7:*"],
    ):
        killed = run(out, fault)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = run(out)
    assert again.returncode == 0, again.stderr
    same_files(out / "runs", tmp_path / "ref" / "runs")
