"""A run is resolved once (featcache/runs/spec.py): one `RunSpec` per run, its content key over the cache's content
key (never its path) naming the checkpoint, the grid folder and reproduce's memo; a moved or copied cache resumes
its grid and its train; grid reads each split once; the CLI resolves each algorithm once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import run_cli

import featcache.cache as C
from featcache.errors import UserError
from featcache.reproduce import run_job
from featcache.runs import spec as spec_module
from featcache.runs import select as grid_module
from featcache.runs.select import grid
from featcache.runs.spec import RunSpec
from featcache.runs.train import train
from tests.synthetic import write_cache
from tests.test_resume_runs import Killed, files, job, same_files

GRID = dict(grid=["lr=0.1,0.01,0.001"], seeds=[0, 1], rounds=2, set=["batch_size=16"], chunk=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "c.h5", C=3, D=16, K=4, n=(60, 100))


def meta(cache) -> dict:
    return C.load_clients(cache, "test").meta


def test_the_key_follows_what_is_trained_never_where_the_cache_is(cache, tmp_path):
    spec = RunSpec.resolve("fedprox", rounds=2, seeds=[0, 1], set={"mu": 0.1})
    on = meta(cache)
    copy = tmp_path / "elsewhere" / "renamed.h5"
    copy.parent.mkdir()
    shutil.copy(cache, copy)
    assert spec.key(meta(copy)) == spec.key(on) and spec.label(on) == f"fedprox-{spec.key(on)[:16]}"
    others = [
        RunSpec.resolve("fedprox", rounds=3, seeds=[0, 1], set={"mu": 0.1}),
        RunSpec.resolve("fedprox", rounds=2, seeds=[0], set={"mu": 0.1}),
        RunSpec.resolve("fedprox", rounds=2, seeds=[0, 1], set={"mu": 0.1}, grid=["lr=0.1,0.01"]),
    ]
    assert len({spec.key(on), *(o.key(on) for o in others), spec.key(on | {"key": "another cache"})}) == 5
    # the settings as strings, as a dict or spelled with the algorithm's scope: one run
    same = RunSpec.resolve("fedprox", seeds=[0, 1], set=["fedprox.mu=0.1", "rounds=2"])
    assert same.key(on) == spec.key(on) and same.config == spec.config
    # every backbone named in the cache's order trains what no choice trains: the same key
    assert RunSpec.resolve("fedprox", 2, [0, 1], {"mu": 0.1}, list(on["backbones"])).key(on) == spec.key(on)


def test_grid_axes_are_typed_once_from_strings_or_values(cache, tmp_path):
    text = RunSpec.resolve("fedavg", grid=["lr=1e-1,1e-2", "drop_last=true,false"])
    values = RunSpec.resolve("fedavg", grid={"lr": [0.1, 0.01], "drop_last": [True, False]})
    assert text.axes == values.axes == {"lr": [0.1, 0.01], "drop_last": [True, False]}
    assert [c["lr"] for c in text.configs()] == [0.1, 0.1, 0.01, 0.01] and text.pick(text.points()[3]).axes == {}
    for bad, says in [
        ({"lr": 0.1}, "--grid lr: give a list of values"),
        ({"lr": []}, "--grid lr: give a list of values"),
        ({"lr": [0.1, "fast"]}, "expected a float"),
        ({"lr": [0.1, 0.1]}, "lists 0.1 twice"),
        ({}, "no --grid axis given"),
    ]:
        with pytest.raises(UserError, match=says):
            RunSpec.resolve("fedavg", grid=bad)
    a = grid(cache, "fedavg", ["lr=0.1,0.01"], seeds=[0], rounds=1, out=tmp_path, retrain=False)
    b = grid(cache, "fedavg", {"lr": [0.1, 0.01]}, seeds=[0], rounds=1, out=tmp_path, retrain=False)
    assert (
        a["run_folder"] == b["run_folder"] and b["chunks_resumed"] == b["chunks"] and a["selection"] == b["selection"]
    )


def test_grid_reads_each_split_once(cache, tmp_path, monkeypatch):
    reads = []

    def counted(real):
        def load(path, split="train", backbones=None, views=False, holdout="none"):
            reads.append((split, holdout))
            return real(path, split, backbones=backbones, views=views, holdout=holdout)

        return load

    monkeypatch.setattr(grid_module, "load_clients", counted(grid_module.load_clients))
    monkeypatch.setattr(C, "load_clients", counted(C.load_clients))
    grid(cache, "fedavg", out=tmp_path, **GRID | {"chunk": 1})  # three chunks and the retrain
    assert sorted(reads) == [("test", "none"), ("train", "fit"), ("train", "none"), ("train", "val")]


def test_the_cli_resolves_each_run_once(cache, tmp_path, monkeypatch):
    resolved = []
    real = RunSpec.resolve.__func__

    def counted(cls, algo, *args, **kwargs):
        resolved.append(algo)
        return real(cls, algo, *args, **kwargs)

    monkeypatch.setattr(spec_module.RunSpec, "resolve", classmethod(counted))
    out = tmp_path / "runs"
    common = ["--cache", str(cache), "--rounds", "1", "--seeds", "0", "--out", str(out), "--json"]
    assert run_cli("train", "--algo", "fedavg", "--algo", "fedprox", *common).code == 0
    assert resolved == ["fedavg", "fedprox"]
    resolved.clear()
    assert run_cli("grid", "--algo", "fedavg", "--grid", "lr=0.1,0.01", *common).code == 0
    assert resolved == ["fedavg"]  # the retrain is the spec's best point, not resolved again


def test_a_moved_cache_resumes_its_grid_to_the_same_bytes(cache, tmp_path):
    """A grid killed after its first chunk, its cache then moved (another folder and name): the same grid on the
    moved cache finds its run folder, trains only the chunks left and writes the bytes of an undisturbed run."""
    moved = tmp_path / "moved" / "renamed.h5"
    moved.parent.mkdir()
    shutil.copy(cache, moved)
    ref = grid(moved, "fedprox", out=tmp_path / "ref", **GRID)
    assert ref["chunks"] == 3
    first = tmp_path / "first.h5"
    shutil.move(moved, first)

    def kill_after_one(what, done, total):
        if what == "grid chunks" and done == 1:
            raise Killed

    with pytest.raises(Killed):
        grid(first, "fedprox", out=tmp_path / "stopped", progress=kill_after_one, **GRID)
    (folder,) = (tmp_path / "stopped").glob("grid-*")
    assert folder.name == Path(ref["run_folder"]).name and len(list(folder.glob("chunk-*.json"))) == 1
    shutil.move(first, moved)
    again = grid(moved, "fedprox", out=tmp_path / "stopped", **GRID)
    assert again["chunks_resumed"] == 1
    same_files(tmp_path / "stopped", tmp_path / "ref")


def test_a_copied_cache_finds_its_finished_train_and_grid(cache, tmp_path):
    out = tmp_path / "runs"
    done = train(cache, "fedavg", rounds=1, seeds=[0], out=out)
    finished = grid(cache, "fedavg", ["lr=0.1,0.01"], seeds=[0], rounds=1, out=out, retrain=False)
    copy = tmp_path / "copy.h5"
    shutil.copy(cache, copy)
    again = train(copy, "fedavg", rounds=1, seeds=[0], out=out)
    assert again.get("finished_earlier") and again["result_file"] == done["result_file"]
    regrid = grid(copy, "fedavg", ["lr=0.1,0.01"], seeds=[0], rounds=1, out=out, retrain=False)
    assert regrid["run_folder"] == finished["run_folder"] and regrid["chunks_resumed"] == regrid["chunks"]


def test_one_label_names_the_checkpoint_the_grid_folder_and_the_memo(cache, tmp_path):
    on = meta(cache)
    info = {"cache": cache, "key": on["key"], "backbones": on["backbones"], "client_domains": ["synth"] * 3}
    info |= {"dims": [16], "classes": 4}
    plain, gridded = job(settings=json.dumps({"batch_size": 16}), rounds=1), job(grid=json.dumps({"lr": [0.1, 0.01]}))
    run_job(plain, info, tmp_path)
    run_job(gridded, info, tmp_path)
    trains = RunSpec.resolve("fedavg", rounds=1, seeds=[0, 1], set={"batch_size": 16})
    grids = RunSpec.resolve("fedavg", rounds=3, seeds=[0, 1], set={"batch_size": 16}, grid={"lr": [0.1, 0.01]})
    made = files(tmp_path) | {p.name: b"" for p in (tmp_path / "runs").glob(".*.done")}
    assert f".{trains.label(on)}.done" in made and f"jobs/{trains.label(on)}.json" in made
    assert f"runs/grid-{grids.label(on)}/grid.json" in made and f"jobs/{grids.label(on)}.json" in made
