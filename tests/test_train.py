"""`featcache train` and `featcache grid` as a library and as a command: results, determinism, errors, resumption,
batched-grid equivalence and the Ray backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import one_line_error, run_cli

import featcache.runs.train as train_mod
from featcache.runs import select as grid_mod
from featcache.devices import resolve_device
from featcache.errors import UserError
from featcache.runs.select import grid
from featcache.runs.train import train
from tests.synthetic import write_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5")


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "featcache.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_train_result_and_determinism(cache, tmp_path):
    a = train(cache, "fedavg", rounds=3, seeds=[0, 1], set=["lr=0.01"], out=tmp_path / "a")
    b = train(cache, "fedavg", rounds=3, seeds=[0, 1], set=["lr=0.01"], out=tmp_path / "b")
    assert Path(a["result_file"]).read_bytes() == Path(b["result_file"]).read_bytes()
    assert a["config"]["lr"] == 0.01 and a["config"]["rounds"] == 3 and a["seeds"] == [0, 1]
    assert len(a["per_seed"]) == 2 and len(a["per_client"]) == 4
    assert abs(a["mean_acc"] - sum(a["per_seed"]) / 2) < 1e-3
    assert a["params_uploaded_per_round"] == 16 * 256 + 256 + 256 * 5 + 5  # FC(16,256) + FC(256,5)
    assert set(a["fairness"]) == {"average", "worst_10", "worst_20", "worst_40", "best_10", "variance", "std"}


@pytest.mark.parametrize(
    "bad,msg",
    [
        (["nope=1"], "unknown setting 'nope'"),
        (["lr=fast"], "expected a float"),
        (["lr"], "write key=value"),
        (["optimizer=rmsprop"], "optimizer must be"),
    ],
)
def test_train_rejects_bad_settings(cache, tmp_path, bad, msg):
    with pytest.raises(UserError, match=msg):
        train(cache, "fedavg", rounds=1, seeds=[0], set=bad, out=tmp_path)


def test_nan_loss_is_one_line(cache, tmp_path):
    with pytest.raises(UserError, match="NaN"):
        train(cache, "fedavg", rounds=2, seeds=[0], set=["lr=1e38", "optimizer=sgd"], out=tmp_path)


def test_cli_train_json_and_errors(cache, tmp_path):
    ok = cli(
        "train", "--cache", cache, "--algo", "fedpcl", "--rounds", "2", "--seeds", "0", "--out", str(tmp_path), "--json"
    )
    assert ok.returncode == 0, ok.stderr
    res = json.loads(ok.stdout)
    for key in (
        "algo",
        "mean_acc",
        "std_acc",
        "per_seed",
        "per_client",
        "seconds_per_round",
        "params_uploaded_per_round",
    ):
        assert key in res
    assert res["params_uploaded_per_round"] == 5 * 256 + 5  # prototypes + class counts
    bad = cli("train", "--cache", cache, "--algo", "fedpcll", "--out", str(tmp_path))
    assert bad.returncode == 2 and "fedpcl" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = cli("train", "--cache", str(tmp_path / "none.h5"), "--algo", "fedavg")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_grid_selects_retrains_and_matches_single_runs(cache, tmp_path):
    res = grid(
        cache, "fedavg", ["lr=1e-1,1e-3", "weight_decay=1e-4,1e-2"], seeds=[0, 1], rounds=3, out=tmp_path, chunk=3
    )
    assert res["configs"] == 4 and res["chunks"] == 3 and len(res["selection"]) == 4
    vals = [r["val_mean"] for r in res["selection"]]
    assert vals == sorted(vals, reverse=True) and res["best"] == res["selection"][0]["config"]
    assert "mean_acc" in res["retrain"]
    # the batched chunk gives each configuration exactly what it gets alone
    alone = grid(
        cache,
        "fedavg",
        ["lr=1e-1,1e-3", "weight_decay=1e-4,1e-2"],
        seeds=[0, 1],
        rounds=3,
        out=tmp_path / "alone",
        chunk=1,
        retrain=False,
    )
    for a, b in zip(res["selection"], alone["selection"]):
        assert a["config"] == b["config"] and a["val_mean"] == pytest.approx(b["val_mean"], abs=1e-4)
    assert Path(res["run_folder"], "grid.csv").read_text().startswith("lr,weight_decay,val_mean,val_std")


def test_a_grid_configuration_that_diverges_fails_alone_and_the_others_score_as_without_it(cache, tmp_path):
    given = dict(seeds=[0, 1], rounds=2, set=["optimizer=sgd"], chunk=6)
    with pytest.warns(UserWarning, match=r"grid: \{'lr': 1e\+38\} failed and the others went on: fedavg: .*NaN/Inf"):
        res = grid(cache, "fedavg", ["lr=0.05,1e38,0.01"], out=tmp_path / "a", **given)
    failed = res["selection"][-1]
    assert failed["config"] == {"lr": 1e38} and failed["state"] == "failed" and "NaN/Inf" in failed["reason"]
    alone = grid(cache, "fedavg", ["lr=0.05,0.01"], out=tmp_path / "b", retrain=False, **given)
    assert res["selection"][:2] == alone["selection"] and res["best"] == alone["best"]  # as if it never ran
    assert "mean_acc" in res["retrain"]
    assert Path(res["run_folder"], "grid.csv").read_text().splitlines()[-1] == "1e+38,,"
    again = grid(cache, "fedavg", ["lr=0.05,1e38,0.01"], out=tmp_path / "a", **given)  # resumed from its chunks
    assert again["selection"] == res["selection"] and again["chunks_resumed"] == 1
    with pytest.raises(UserError, match="^fedavg: the .* became NaN/Inf in round 1"):  # every one: the first one's line
        grid(cache, "fedavg", ["lr=1e37,1e38"], out=tmp_path / "c", **given)
    assert not (tmp_path / "c").exists()


def test_grid_resumes_at_first_unfinished_chunk(cache, tmp_path, monkeypatch):
    args = dict(
        cache=cache,
        algo="fedavg",
        grid=["lr=1e-1,1e-2,1e-3"],
        seeds=[0],
        rounds=2,
        out=tmp_path,
        chunk=1,
        retrain=False,
    )
    first = grid(**args)
    chunks = sorted(Path(first["run_folder"]).glob("chunk-*.json"))
    before = {p: p.read_bytes() for p in chunks}
    chunks[1].unlink()  # as if killed while training chunk 1
    calls = []
    real = grid_mod._run_chunk
    monkeypatch.setattr(grid_mod, "_run_chunk", lambda *a: calls.append(a[2]) or real(*a))
    again = grid(**args)
    assert len(calls) == 1 and calls[0][0][1]["lr"] == 1e-2
    assert {p: p.read_bytes() for p in chunks} == before and again["selection"] == first["selection"]


def test_grid_resumes_safely_with_other_chunking(cache, tmp_path):
    args = dict(cache=cache, algo="fedavg", grid=["lr=1e-1,1e-2"], seeds=[0, 1], rounds=2, out=tmp_path, retrain=False)
    two = grid(**args, chunk=2)
    for p in Path(two["run_folder"]).glob("chunk-*.json"):
        p.unlink()
        break
    one = grid(**args, chunk=1)  # resumed with another chunk size: nothing counted twice
    assert [r["val_mean"] for r in one["selection"]] == pytest.approx([r["val_mean"] for r in two["selection"]])


def test_participation_is_not_batched_across_rates(cache, tmp_path):
    res = grid(cache, "fedavg", ["participation=0.5,1.0"], seeds=[0], rounds=2, out=tmp_path, retrain=False)
    assert res["chunks"] == 2  # two buckets: a rate is per run, never taken from the first configuration


def test_grid_rejects_bad_axes(cache, tmp_path):
    with pytest.raises(UserError, match="unknown setting"):
        grid(cache, "fedavg", ["learning_rate=1,2"], seeds=[0], out=tmp_path)
    with pytest.raises(UserError, match="key=v1,v2"):
        grid(cache, "fedavg", ["lr"], seeds=[0], out=tmp_path)


@pytest.mark.slow
def test_grid_on_local_ray_cluster(cache, tmp_path):
    import ray  # a dev dependency: this test must run, not skip

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        res = grid(
            cache, "fedavg", ["lr=1e-1,1e-2"], seeds=[0], rounds=2, out=tmp_path, chunk=1, backend="ray", retrain=False
        )
        local = grid(
            cache, "fedavg", ["lr=1e-1,1e-2"], seeds=[0], rounds=2, out=tmp_path / "local", chunk=1, retrain=False
        )
        assert res["selection"] == local["selection"]
    finally:
        ray.shutdown()


def test_unavailable_method_says_why(cache, tmp_path):
    with pytest.raises(UserError, match="input pixels"):
        train(cache, "pfedpt", rounds=1, seeds=[0], out=tmp_path)


def test_atomic_write_removes_its_own_and_dead_writers_temporaries(tmp_path):
    """A failed write leaves no temporary; a writer killed outright leaves one that the next write removes."""
    from featcache.atomic import write_atomic

    target = tmp_path / "r.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".r.json.{int(dead.stdout)}.tmp"  # a writer that no longer exists
    live = tmp_path / f".r.json.{os.getppid()}.tmp"  # a writer still running: not ours to touch
    orphan.write_text("half")
    live.write_text("half")
    with pytest.raises(TypeError):
        write_atomic(target, None)  # fails mid-write
    assert not target.exists() and not orphan.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
    write_atomic(target, "{}")
    assert target.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == [live.name, "r.json"]


def _fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_device_auto_is_cuda_only_where_cuda_is(monkeypatch):
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _fake_cuda(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu") == resolve_device(" CPU ")
    _fake_cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device(torch.device("cuda:0")).index == 0


@pytest.mark.parametrize(
    "name, cuda_devices, needle",
    [
        ("cuda", 0, "--device cuda asked for but CUDA is not available: use --device cpu or auto"),
        ("cuda:0", 0, "CUDA is not available"),
        ("cuda:2", 2, "this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
        ("foo", 0, "--device 'foo' is not a device: use auto | cpu | cuda[:N]"),
        ("cuda:x", 2, "is not a device: use auto | cpu | cuda[:N]"),
        ("gpu", 2, "is not a device"),
    ],
)
def test_device_refusals_are_one_line(monkeypatch, name, cuda_devices, needle):
    _fake_cuda(monkeypatch, cuda_devices)
    with pytest.raises(UserError) as refused:
        resolve_device(name)
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_train_and_grid_default_to_auto_and_record_the_device(cache, tmp_path):
    result = train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path)
    assert result["device"] == str(resolve_device("auto"))
    assert json.loads(Path(result["result_file"]).with_suffix(".timing.json").read_text())["device"] == result["device"]
    assert "device" not in json.loads(Path(result["result_file"]).read_text())  # the result is device-free
    found = grid(cache, "fedavg", ["lr=1e-1,1e-2"], seeds=[0], rounds=1, out=tmp_path, retrain=False)
    assert found["device"] == str(resolve_device("auto"))


@pytest.mark.parametrize("command", ["train", "grid"])
@pytest.mark.parametrize(
    "device, needle",
    [("foo", "is not a device: use auto | cpu | cuda[:N]"), ("cuda", "CUDA is not available"), ("cuda:99", "cuda:99")],
)
def test_cli_bad_device_is_one_line_exit_2_before_any_work(cache, tmp_path, command, device, needle):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available on this machine")
    axes = ["--grid", "lr=1e-1,1e-2"] if command == "grid" else []
    result = run_cli(
        command,
        "--cache",
        cache,
        "--algo",
        "fedavg",
        *axes,
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "runs",
        "--device",
        device,
    )
    one_line_error(result, needle)
    assert not (tmp_path / "runs").exists()


def test_std_over_seeds_is_the_sample_std_and_zero_for_one_seed():
    from featcache.runs.metrics import mean_std

    assert mean_std([1.0, 3.0]) == (2.0, 2**0.5)  # ddof=1, as pandas: not the population std 1.0
    assert mean_std([5.0]) == (5.0, 0.0)


def test_result_file_records_provenance_and_its_name_ignores_it(cache, tmp_path):
    from featcache import provenance as P

    a = train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path / "a")
    prov = json.loads(Path(a["result_file"]).read_text())["provenance"]
    assert prov["cpu"] == P.cpu_model() and prov["torch_threads"] == torch.get_num_threads()
    assert prov["gpu"] is None and prov["command"] is None and prov["call"].startswith("featcache.train(")
    assert prov["commit"] == P.git_commit()  # this checkout's commit (None outside a checkout), never an error
    old = P.COMMAND
    try:
        P.set_command(["/usr/bin/featcache", "train", "--algo", "fedavg"])
        b = train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path / "b")
    finally:
        P.COMMAND = old
    assert json.loads(Path(b["result_file"]).read_text())["provenance"]["command"] == "featcache train --algo fedavg"
    assert Path(a["result_file"]).name == Path(b["result_file"]).name  # named by what it trains


def test_progress_off_a_terminal_is_plain_periodic_lines():
    from featcache.cli.app import plain_progress

    lines, now = [], [0.0]
    tick = plain_progress(lines.append, clock=lambda: now[0])
    for done in range(1, 101):
        tick("fedavg", done, 100)
    assert len(lines) == 11 and lines[0] == "progress: fedavg 1/100 (1 %) 0 s"  # the first update, then every 10 %
    assert lines[1] == "progress: fedavg 10/100 (10 %) 0 s" and lines[-1].startswith("progress: fedavg 100/100 (100 %)")
    lines.clear()
    tick = plain_progress(lines.append, clock=lambda: now[0])
    for done in range(1, 6):  # slow: 5 of 1000 steps, 40 s apart -> a line every 30 s anyway
        now[0] += 40
        tick("grid rounds", done, 1000)
    assert len(lines) == 5 and all("rounds" in line for line in lines)


def test_cli_train_under_a_pipe_prints_plain_progress_lines(cache, tmp_path):
    res = cli(
        "train", "--cache", str(cache), "--algo", "fedavg", "--rounds", "10", "--seeds", "0", "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    progress = [line for line in res.stderr.splitlines() if line.startswith("progress: fedavg")]
    assert progress and progress[-1].startswith("progress: fedavg 10/10 (100 %)")
    (result_file,) = [p for p in tmp_path.glob("*.json") if not p.name.endswith(".timing.json")]
    result = json.loads(result_file.read_text())
    assert result["provenance"]["command"].startswith("featcache train --cache")


def test_scaffold_defaults_to_plain_sgd():
    from featcache.algorithms import create
    from featcache.training.config import resolve

    cfg = resolve(create("scaffold"))
    assert cfg["optimizer"] == "sgd" and cfg["momentum"] == 0.0 and cfg["lr"] == 0.01


def test_keep_freed_memory_keeps_the_pages_and_importing_featcache_does_not():
    """64 MB tensors allocated and freed ten times: each one faults its pages in afresh after `import featcache`
    and after importing the CLI (glibc returns them to the kernel), none after `keep_freed_memory()`, which the
    training commands call (featcache/memory.py; tests/test_memory.py: which commands)."""
    code = (
        "import resource, sys, torch, featcache.cli\n"
        "from featcache.memory import keep_freed_memory\n"
        "{setup}\n"
        "def faults():\n"
        "    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(10):\n"
        "        torch.ones(16 * 2**20)\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0\n"
        "faults(); print(faults())"
    )

    def faults(setup: str) -> int:
        done = subprocess.run([sys.executable, "-c", code.format(setup=setup)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    plain, kept = faults("pass"), faults("assert keep_freed_memory()")
    assert plain > 10 * 16_384 // 2 and kept < plain // 20, (plain, kept)  # 16,384 pages of 4 KB per tensor
    start = "import sys, featcache.cli; print('torch' in sys.modules)"  # the command still starts without torch
    assert subprocess.run([sys.executable, "-c", start], capture_output=True, text=True).stdout.strip() == "False"


def test_a_run_too_big_for_the_memory_trains_in_slices_with_the_same_result(cache, tmp_path, monkeypatch):
    """Where every participant at once would not fit, train asks footprint.fit_at_once for the most that do and
    the engine trains them in slices: the same result file, metrics included."""
    from featcache.training import footprint

    a = train(cache, "fedpcl", rounds=2, seeds=[0], out=tmp_path / "a")
    seen = []
    original = footprint.fit_at_once
    monkeypatch.setattr(
        train_mod, "fit_at_once", lambda *a, **k: seen.append(original(*a, **k, avail=one(a))) or seen[-1]
    )
    one = lambda args: footprint.estimate(args[0], args[1], args[3], at_once=2).per_config  # room for 2 of 4
    b = train(cache, "fedpcl", rounds=2, seeds=[0], out=tmp_path / "b")
    assert seen == [2]
    assert Path(a["result_file"]).read_bytes() == Path(b["result_file"]).read_bytes()
    assert Path(a["metrics_csv"]).read_bytes() == Path(b["metrics_csv"]).read_bytes()


def test_available_memory_is_mem_available_and_a_grid_chunk_plans_for_a_share_of_it(monkeypatch):
    """One measure of available memory (featcache/memory.py): the kernel's MemAvailable, not its free pages; train's
    check uses it as is, grid's chunk budget takes 1/2 of it on CUDA and 1/4 on the CPU."""
    import io

    from featcache import memory
    from featcache.training.footprint import available_bytes as train_available

    meminfo = "MemTotal: 900 kB\nMemFree: 10 kB\nMemAvailable: 300 kB\n"
    monkeypatch.setattr(memory, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert memory.available_bytes(torch.device("cpu")) == 300 * 1024
    assert train_available is memory.available_bytes is grid_mod.available_bytes
    assert grid_mod.memory_budget(torch.device("cpu")) == 300 * 1024 // 4
    monkeypatch.setattr(grid_mod, "available_bytes", lambda device: 4096)
    assert grid_mod.memory_budget(torch.device("cuda")) == 2048


@pytest.mark.slow
def test_algo_all_trains_every_registered_algorithm_in_one_command_as_a_leaderboard(cache, tmp_path):
    from featcache.algorithms import list_algorithms

    shipped = {n: c for n, c in list_algorithms().items() if c.__module__.startswith("featcache.")}  # no plug-ins
    args = ["train", "--cache", str(cache), "--algo", "all", "--rounds", "1", "--seeds", "0", "--out", str(tmp_path)]
    diverges = ["--set", "fedprox.lr=1e38", "--set", "fedprox.optimizer=sgd"]  # one algorithm fails alone
    done = cli(*args, *diverges)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    views = sorted(name for name, cls in shipped.items() if getattr(cls, "uses_views", False))
    assert views and f"--algo all leaves out {', '.join(views)}" in said  # no views cached
    assert "--algo all leaves out fedprox, which failed: fedprox: the scores became NaN/Inf in round 1" in said
    trained = {
        json.loads(p.read_text())["algo"]: json.loads(p.read_text()) for p in tmp_path.glob("*-seed0-*[0-9a-f].json")
    }
    assert set(trained) == set(shipped) - set(views) - {"fedprox"}
    rows = [line.split("│") for line in done.stdout.splitlines() if line.count("│") > 5]  # the table's rows
    assert [r[1].strip() for r in rows[-1:]] == ["fedprox"] and rows[-1][2].strip() == "failed"  # listed last
    accs = [float(r[2].strip().split("(")[0]) for r in rows[:-1]]
    assert len(rows) - 1 == len(trained) and accs == sorted(accs, reverse=True)  # a leaderboard: best first
    assert sorted(accs) == sorted(round(r["mean_acc"], 2) for r in trained.values())
    refused = cli("train", "--cache", str(cache), "--algo", "all", "--algo", "fedavg", "--out", str(tmp_path / "no"))
    assert refused.returncode == 2 and "--algo all already lists every algorithm: give it alone" in refused.stderr


# -- a sweep: several caches in one call ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_caches(tmp_path_factory):
    """Two caches of one sweep: label partitions at α 0.1 and 1 (other features: a mixed-up cache would show)."""
    folder = tmp_path_factory.mktemp("sweep")
    return [
        write_cache(folder / f"alpha{a}.h5", spread=spread, partition={"scheme": "label", "alpha": a, "clients": 4})
        for a, spread in ((0.1, 1.0), (1.0, 2.0))
    ]


def without_call(path: Path) -> dict:
    """A result file's content, the call or command line its provenance records aside (it names the whole call)."""
    result = json.loads(path.read_text())
    return result | {"provenance": {k: v for k, v in result["provenance"].items() if k not in ("call", "command")}}


def test_several_caches_train_in_one_call_as_one_call_per_cache_writes(sweep_caches, tmp_path, monkeypatch):
    """Every algorithm on every cache, cache by cache, each cache read once: the same files, byte for byte but the
    call the provenance records (the sweep's own, which run again gives them back)."""
    from featcache import cache as C

    reads = []
    real = C.load_clients
    monkeypatch.setattr(
        C, "load_clients", lambda path, split="train", **k: reads.append(split) or real(path, split, **k)
    )
    args = dict(algo=["fedavg", "fedprox"], rounds=2, seeds=[0], set=["fedprox.mu=0.5"])
    both = train(sweep_caches, out=tmp_path / "both", **args)["runs"]
    assert reads == ["train", "test"] * 2  # once per cache, for both algorithms
    assert [(Path(r["cache_path"]).name, r["algo"]) for r in both] == [
        ("alpha0.1.h5", "fedavg"),
        ("alpha0.1.h5", "fedprox"),
        ("alpha1.0.h5", "fedavg"),
        ("alpha1.0.h5", "fedprox"),
    ]
    alone = [r for c in sweep_caches for r in train(c, out=tmp_path / "alone", **args)["runs"]]
    for r, a in zip(both, alone):
        ours, theirs = Path(r["result_file"]), Path(a["result_file"])
        assert ours.name == theirs.name and without_call(ours) == without_call(theirs)
        assert Path(r["metrics_csv"]).read_bytes() == Path(a["metrics_csv"]).read_bytes()
    assert both[0]["mean_acc"] != both[2]["mean_acc"]  # each cache's own data
    call = json.loads(Path(both[0]["result_file"]).read_text())["provenance"]["call"]
    assert call.startswith(f"featcache.train(cache={[str(c) for c in sweep_caches]!r}, algo=['fedavg', 'fedprox']")
    again = train(sweep_caches, out=tmp_path / "both", **args)["runs"]  # the recorded call gives them back
    assert all(r["finished_earlier"] for r in again) and [r["result_file"] for r in again] == [
        r["result_file"] for r in both
    ]


def test_every_cache_of_a_sweep_is_checked_before_the_first_trains(sweep_caches, tmp_path):
    out = tmp_path / "runs"
    few = write_cache(tmp_path / "few.h5", C=2, partition={"scheme": "label", "alpha": 10.0, "clients": 2})
    cases = [
        ([*sweep_caches, sweep_caches[0]], [], f"--cache {sweep_caches[0]} holds what --cache {sweep_caches[0]}"),
        ([*sweep_caches, few], ["participation=0.2"], "participation=0.2 selects no client of 2 per round"),
        ([*sweep_caches, tmp_path / "none.h5"], [], "none.h5"),
        ([sweep_caches[0], 3], [], "cache must be a path (a str or os.PathLike), not int 3"),
        ([], [], "cache lists no cache: give at least one"),
    ]
    for caches, settings, needle in cases:
        with pytest.raises(UserError, match=re.escape(needle)) as e:
            train(caches, "fedavg", rounds=1, seeds=[0], set=settings, out=out)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="has no backbone 'other'; it holds synth"):
        train(sweep_caches, "fedavg", rounds=1, seeds=[0], backbones=["other"], out=out)
    with pytest.raises(UserError, match="has no augmented views"):  # fedpft-con named, not --algo all: refused up front
        train(sweep_caches, ["fedavg", "fedpft-con"], rounds=1, seeds=[0], out=out)
    assert not out.exists()


def test_cli_trains_a_sweep_in_one_command_with_a_cache_column(sweep_caches, tmp_path):
    """`--cache A --cache B`: the table names each row's cache, and the files are those of one command per cache."""
    common = ["--algo", "fedavg", "--rounds", "1", "--seeds", "0"]
    done = run_cli("train", "--cache", sweep_caches[0], "--cache", sweep_caches[1], *common, "--out", tmp_path / "a")
    assert done.code == 0, done.stderr
    rows = [[c.strip() for c in line.split("│")[1:3]] for line in done.stdout.splitlines() if line.count("│") > 5]
    assert rows == [["alpha0.1.h5", "fedavg"], ["alpha1.0.h5", "fedavg"]] and "2 caches" in done.stdout
    assert "progress: fedavg on alpha1.0.h5 (2 of 2)" in done.stderr
    for c in sweep_caches:
        assert run_cli("train", "--cache", c, *common, "--out", tmp_path / "b").code == 0
    ours, theirs = sorted((tmp_path / "a").glob("*.json")), sorted((tmp_path / "b").glob("*.json"))
    results = [p for p in ours if not p.name.endswith(".timing.json")]
    assert len(results) == 2 and [p.name for p in ours] == [p.name for p in theirs]
    assert all(without_call(p) == without_call(q) for p, q in zip(ours, theirs) if p in results)
    command = json.loads(results[0].read_text())["provenance"]["command"]
    assert command.startswith(f"featcache train --cache {sweep_caches[0]} --cache {sweep_caches[1]} --algo fedavg")


def test_algo_all_on_several_caches_is_a_leaderboard_per_cache(sweep_caches, tmp_path, monkeypatch):
    """`--algo all` over a cache without views and one with: the views algorithm is left out where there are none,
    one that diverges fails alone on each cache, and the table ranks each cache's runs."""
    import featcache.algorithms as algorithms

    views = write_cache(tmp_path / "views.h5", views=2, partition={"scheme": "label", "alpha": 10.0, "clients": 4})
    every = algorithms.list_algorithms()
    monkeypatch.setattr(
        algorithms, "list_algorithms", lambda: {k: every[k] for k in ("fedavg", "fedpft-con", "fedprox")}
    )
    args = ["--algo", "all", "--rounds", "1", "--seeds", "0", "--out", tmp_path / "runs"]
    diverges = ["--set", "fedprox.lr=1e38", "--set", "fedprox.optimizer=sgd"]
    one_epoch = ["--set", "fedpft-con.r_f=0", "--set", "fedpft-con.local_epochs=1"]
    done = run_cli("train", "--cache", sweep_caches[0], "--cache", views, *args, *diverges, *one_epoch)
    assert done.code == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert f"--algo all leaves out fedpft-con on {sweep_caches[0]}: they train on augmented views" in said
    assert f"--algo all leaves out fedprox on {views}, which failed" in said
    rows = [[c.strip() for c in line.split("│")[1:4]] for line in done.stdout.splitlines() if line.count("│") > 5]
    trained, failed = rows[:3], rows[3:]
    acc = lambda row: float(row[2].split("(")[0])
    assert [r[0] for r in trained] == ["alpha0.1.h5", "views.h5", "views.h5"] and acc(trained[1]) >= acc(trained[2])
    assert {r[1] for r in trained[1:]} == {"fedavg", "fedpft-con"}  # each cache's own leaderboard
    assert failed == [["alpha0.1.h5", "fedprox", "failed"], ["views.h5", "fedprox", "failed"]]
