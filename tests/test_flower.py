"""featcache.flower: a run split into a server and its clients gives `featcache train`'s numbers (per-client
accuracies every evaluation round, the global metric, the uploaded values per round) within 1e-5, in process
(`loopback`: every message packed and unpacked) and as a Flower simulation (ServerApp + ClientApp on Flower's
simulation runtime, Ray); what cannot run client-side is refused in one line; `featcache split` writes verified
per-client files from which a client reads only its own rows."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
from conftest import fast_settings
from harness import everything_in, one_line_error, run_cli
from synthetic import write_cache

import featcache
from featcache.algorithms import create, list_algorithms
from featcache.cache import verify
from featcache.cache.split import client_of, node_rows, split
from featcache.errors import UserError
from featcache.flower.federation import ClientSide, loopback, run_server
from featcache.runs.spec import RunSpec

SIX = ("fedavg", "fedprox", "scaffold", "fedproto", "fedpcl", "fedrep")
SETTINGS = {"batch_size": 16, "drop_last": False, "participation": 0.75, "proj_dim": 8}
ROUNDS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("flower") / "c.h5")


def simulated(cache, algo, out, settings: dict = SETTINGS) -> dict:
    """`featcache train`'s result and per-client test accuracies {(round, client): %}."""
    result = featcache.train(cache, algo, rounds=ROUNDS, seeds=[0], set=settings, out=out)
    return result | {"per_client": per_client(result["metrics_csv"])}


def per_client(path) -> dict:
    with open(path) as f:
        return {(r["round"], r["client"]): float(r["accuracy"]) for r in csv.DictReader(f) if r["split"] == "test"}


def assert_same(flower: dict, sim: dict) -> None:
    assert flower["per_client"].keys() == sim["per_client"].keys()
    for k, v in sim["per_client"].items():
        assert abs(flower["per_client"][k] - v) <= 1e-5 * 100, (k, flower["per_client"][k], v)  # CSV holds percent
    for key in ("mean_acc", "global_acc"):
        a, b = flower.get(key), sim.get(key)
        assert (a is None) == (b is None), key
        if a is not None:
            assert abs(a - b) <= 1e-5 * 100, (key, a, b)
    assert flower["params_uploaded_per_round"] == sim["params_uploaded_per_round"]


def written(path) -> dict:
    with open(path) as f:
        result = json.load(f)
    return result | {"per_client": per_client(path.replace(".json", ".metrics.csv"))}


def split_run(cache, algo: str, settings: dict, out) -> dict:
    """`algo` run as a server and four clients passing packed messages (`loopback`), its result file read back."""
    from featcache.flower.results import write_result

    spec = RunSpec.resolve(algo, ROUNDS, [0], settings)
    cfg = spec.config | {"seed": 0}
    clients = []
    for c in range(4):
        _, train, test = node_rows(cache, c)
        clients.append(ClientSide(spec.algo, cfg, train, test, c))
    raw = run_server(spec.algo, cfg, loopback(clients))
    return written(write_result(out, spec.algo, cfg, raw["meta"], raw, {}))


@pytest.mark.parametrize("algo", SIX)
def test_a_run_split_into_server_and_clients_gives_train_s_numbers(algo, cache, tmp_path):
    assert_same(split_run(cache, algo, SETTINGS, tmp_path / "flower"), simulated(cache, algo, tmp_path / "sim"))


def _runs_client_side(name: str) -> bool:
    algo = create(name)
    return not (algo.across_clients or algo.keeps_optimizer_state or getattr(algo, "uses_views", False))


@pytest.mark.slow
@pytest.mark.parametrize("algo", [n for n in sorted(list_algorithms()) if n not in SIX and _runs_client_side(n)])
def test_every_other_algorithm_split_into_server_and_clients_gives_train_s_numbers(algo, cache, tmp_path):
    """The flower guide's promise: every registered algorithm it does not refuse (the cache holds no views), at
    the tests' fast settings (FedETF's adaptation in one pass)."""
    settings = SETTINGS | fast_settings(algo)
    assert_same(
        split_run(cache, algo, settings, tmp_path / "flower"), simulated(cache, algo, tmp_path / "sim", settings)
    )


def test_a_client_smaller_than_a_batch_trains_its_one_batch_as_in_train(cache, tmp_path):
    counts = [int(node_rows(cache, c)[1].counts[0]) for c in range(4)]
    settings = SETTINGS | {"drop_last": True, "batch_size": min(counts) + 1}  # the smallest client: no full batch
    settings |= {"lr": 0.5, "local_epochs": 3, "participation": 1.0}  # its steps move every client's accuracy
    assert max(counts) >= settings["batch_size"]  # the others drop a partial batch
    sim = featcache.train(cache, "fedavg", rounds=ROUNDS, seeds=[0], set=settings, out=tmp_path / "sim")
    sim |= {"per_client": per_client(sim["metrics_csv"])}
    assert_same(split_run(cache, "fedavg", settings, tmp_path / "flower"), sim)


def test_a_flower_simulation_gives_train_s_numbers(cache, tmp_path):
    run_flower_simulation("fedpcl", cache, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [a for a in SIX if a != "fedpcl"])
def test_every_one_of_the_six_as_a_flower_simulation(algo, cache, tmp_path):
    run_flower_simulation(algo, cache, tmp_path)


def run_flower_simulation(algo, cache, tmp_path):
    """The ServerApp and ClientApp on Flower's simulation runtime (one Ray actor per core), compared with train."""
    pytest.importorskip("flwr")
    from flwr.simulation import run_simulation

    from featcache.flower import client_app, server_app

    got = {}
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    run_simulation(
        server_app(
            algo,
            SETTINGS,
            0,
            ROUNDS,
            out=str(tmp_path / "flower"),
            timeout=600,  # a deadline for a lost node, not a speed limit: a loaded machine answers late
            on_result=lambda raw, wire: got.update(raw=raw, wire=wire),
        ),
        client_app(algo, SETTINGS, 0, ROUNDS, cache=cache),
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
    )
    assert "raw" in got, "the ServerApp did not finish"
    assert got["wire"]["train up"] and got["wire"]["evaluate down"]
    assert_same(written(got["raw"]["result"]), simulated(cache, algo, tmp_path / "sim"))


@pytest.mark.parametrize(
    ("algo", "settings", "named"),
    [
        ("pfedgate", {}, "keeps_optimizer_state"),
        ("fedpcl", {"proto_noise": "laplace"}, "proto_noise"),
        ("fedamp", {}, "aggregate returns one model per client"),
        ("fedala", {}, "hashed from its index among all C clients"),
        ("ccvr", {}, "download pools the feature statistics of every client's training rows"),
    ],
)
def test_what_a_client_cannot_run_alone_is_refused_in_one_line(algo, settings, named, cache):
    spec = RunSpec.resolve(algo, ROUNDS, [0], SETTINGS | settings)
    _, train, test = node_rows(cache, 0)
    with pytest.raises(UserError, match=named) as e:
        ClientSide(spec.algo, spec.config | {"seed": 0}, train, test, 0)
    assert "\n" not in str(e.value) and "featcache train" in str(e.value)


def test_split_writes_one_verified_file_per_client_that_holds_only_its_rows(cache, tmp_path):
    out = split(cache, tmp_path / "split")
    assert len(out["files"]) == 4
    whole = featcache.load_cache(cache, "train")
    for c, path in enumerate(out["files"]):
        assert verify(path)["ok"]
        index, train, test = node_rows(path, None)
        assert index == c and train.features.shape[0] == 1 and train.meta["key"] == whole.meta["key"]
        torch.testing.assert_close(train.features[0], client_of(whole, c).features[0], rtol=0, atol=0)
    with pytest.raises(UserError, match="holds client 0, not client 2"):
        node_rows(out["files"][0], 2)
    with pytest.raises(UserError, match="holds one client already"):
        split(out["files"][0], tmp_path / "again")


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/abs-escape", "a/b", ".hidden", "x\ny"])
def test_split_keeps_every_file_inside_out_whatever_the_cache_calls_its_dataset(cache, tmp_path, name):
    """The dataset name in a cache (resealed, so it verifies) becomes a file name only as file-name characters."""
    import shutil

    from harness import edit_cache

    mine = edit_cache(shutil.copy(cache, tmp_path / "c.h5"), lambda f: f.attrs.__setitem__("dataset", name))
    out = tmp_path / "split"
    files = split(mine, out)["files"]
    assert len(files) == 4 and all(os.path.dirname(p) == str(out) for p in files)
    assert sorted(os.listdir(tmp_path)) == ["c.h5", "split"] and sorted(os.listdir(out)) == sorted(
        map(os.path.basename, files)
    )


def test_split_refuses_a_damaged_cache_and_leaves_nothing_half_written(cache, tmp_path):
    """A cache `verify` refuses is not split (no client file passes as verified), and a refusal part-way removes
    the files of this call while a user's file of a client's name is kept."""
    import shutil

    import h5py

    flipped = shutil.copy(cache, tmp_path / "flipped.h5")
    with h5py.File(flipped, "r+") as f:  # one value changed after sealing
        ds = f["train/features/concat"] if "train/features/concat" in f else None
        assert ds is not None
        ds[0, 0] = ds[0, 0] + 1
    with pytest.raises(UserError, match="failed verification, nothing split"):
        split(flipped, tmp_path / "a")
    assert not (tmp_path / "a").exists() or not os.listdir(tmp_path / "a")
    out = tmp_path / "b"
    out.mkdir()
    theirs = out / os.path.basename(split(cache, tmp_path / "probe")["files"][2])
    theirs.write_text("a file of the user's")
    with pytest.raises(UserError):
        split(cache, out)
    assert os.listdir(out) == [theirs.name] and theirs.read_text() == "a file of the user's"


def test_split_stopped_part_way_goes_on_with_the_same_command(cache, tmp_path, monkeypatch):
    """A split killed after some client files keeps them; the same command keeps those and writes the rest."""
    import featcache.cache.split as S

    whole = split(cache, tmp_path / "ref")["files"]
    real, calls = S.write, []

    def dies_on_third(path, *a, **k):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(S, "write", dies_on_third)
    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        S._split(cache, out, [])  # the files written so far stay, as after a kill -9
    assert len(os.listdir(out)) == 2
    monkeypatch.setattr(S, "write", real)
    again = split(cache, out)["files"]
    assert [os.path.basename(p) for p in again] == [os.path.basename(p) for p in whole]
    for mine, ref in zip(again, whole):
        assert verify(mine)["ok"]
        torch.testing.assert_close(node_rows(mine, None)[1].features, node_rows(ref, None)[1].features, rtol=0, atol=0)


@pytest.mark.parametrize("results", ['runs"\nalgo = "fedavg', "a\tb", 'x"y', "\\server\\share", "ünï"])
def test_flower_new_writes_every_value_through_toml(cache, tmp_path, results):
    """--out and the cache path reach pyproject.toml through a TOML writer: no key injected, the value back as
    given, the file parses."""
    import shutil
    import tomllib

    from featcache.flower.project import new_project

    odd = tmp_path / 'ca"ch\te.h5'
    shutil.copy(cache, odd)
    made = new_project("p", "fedavg", odd, 2, 0, ["proj_dim=8"], tmp_path, results)
    config = tomllib.loads(open(made["pyproject"]).read())["tool"]["flwr"]["app"]["config"]
    assert config["out"] == results and config["cache"] == str(odd.resolve()) and config["algo"] == "fedavg"


@pytest.mark.parametrize(
    "case, why",
    [
        (lambda tmp: {"algo": "fedamp"}, "fedamp cannot run as a Flower app"),
        (lambda tmp: {"name": "p" * 300}, "1 to 64 letters"),
        (lambda tmp: {"folder": (tmp / "f").write_text("") or tmp / "f"}, "pick a --dir you can write"),
        (lambda tmp: {"out": str((tmp / "o").write_text("") or tmp / "o")}, "is not a folder here"),
        (lambda tmp: {"out": os.symlink(tmp / "gone", tmp / "l") or str(tmp / "l")}, "is not a folder here"),
    ],
)
def test_flower_new_refuses_in_one_line_and_writes_nothing(cache, tmp_path, case, why):
    from featcache.flower.project import new_project

    args = {"name": "p", "algo": "fedavg", "cache": cache, "folder": tmp_path / "d"} | case(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UserError, match=why) as e:
        new_project(**args)
    assert "\n" not in str(e.value) and sorted(p.name for p in tmp_path.iterdir()) == before


def test_featcache_flower_new_writes_a_flwr_run_project(cache, tmp_path):
    from harness import one_line_error, run_cli

    done = run_cli(
        "flower",
        "new",
        "fl-proj",
        "--algo",
        "fedpcl",
        "--cache",
        str(cache),
        "--rounds",
        "2",
        "--set",
        "proj_dim=8",
        "--dir",
        str(tmp_path),
        "--json",
    )
    assert done.code == 0, done.stderr
    project = json.loads(done.stdout)
    import tomllib

    app = tomllib.loads(open(project["pyproject"]).read())["tool"]["flwr"]["app"]
    assert app["components"]["serverapp"] == "fl_proj_app.server_app:app"
    config = app["config"]
    assert config["algo"] == "fedpcl" and config["clients"] == 4 and json.loads(config["settings"])["proj_dim"] == 8
    assert project["run"].endswith("--stream --federation-config num-supernodes=4")  # Flower simulates 2 unless told
    assert os.path.isfile(os.path.join(project["project"], "fl_proj_app", "client_app.py"))
    one_line_error(
        run_cli("flower", "new", "fl-proj", "--algo", "fedpcl", "--cache", str(cache), "--dir", str(tmp_path)), "exists"
    )
    one_line_error(
        run_cli(
            "flower", "new", "x", "--algo", "fedpcl", "--cache", str(cache), "--set", "bogus=1", "--dir", str(tmp_path)
        ),
        "bogus",
    )
    one_line_error(run_cli("split", str(tmp_path / "none.h5"), "--out", str(tmp_path / "s")), "none.h5")


def test_without_flower_the_apps_are_one_line_naming_the_extra(monkeypatch):
    import sys

    from featcache import flower

    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(UserError, match=r"pip install 'featcache\[flower\]'"):
        flower.server_app("fedavg")


@pytest.mark.parametrize(
    "where, says",
    [
        ("afile", "is a file, not a folder"),
        ("afile/sub", "is below the file"),
        ("dangling", "is a broken symbolic link"),
        ("readonly/sub", "is not writable"),
    ],
)
def test_split_and_flower_new_refuse_an_output_they_cannot_write_in_one_line(cache, tmp_path, where, says):
    """`split --out` and `flower new --dir` a file, a path below a file, a broken link or a read-only folder: one line
    naming it, exit code 2, nothing written (split raised FileExistsError, NotADirectoryError)."""
    if where.startswith("readonly") and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (tmp_path / "afile").write_text("the user's")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "readonly").mkdir(mode=0o555)
    before = everything_in(tmp_path)
    one_line_error(run_cli("split", str(cache), "--out", str(tmp_path / where)), says)
    with pytest.raises(UserError, match=says):
        split(cache, tmp_path / where)
    line = one_line_error(
        run_cli("flower", "new", "proj", "--algo", "fedavg", "--cache", str(cache), "--dir", str(tmp_path / where)),
        "",
    )
    assert "proj" in line or where in line
    assert everything_in(tmp_path) == before and (tmp_path / "afile").read_text() == "the user's"


def test_split_into_a_new_folder_refused_part_way_leaves_no_folder(cache, tmp_path, monkeypatch):
    import featcache.cache.split as S

    monkeypatch.setattr(S, "write", lambda *a, **k: (_ for _ in ()).throw(UserError("refused")))
    with pytest.raises(UserError, match="refused"):
        split(cache, tmp_path / "new" / "deep")
    assert not (tmp_path / "new").exists()


def test_flower_new_refuses_a_300_character_name_in_one_line(cache, tmp_path):
    one_line_error(
        run_cli("flower", "new", "p" * 300, "--algo", "fedavg", "--cache", str(cache), "--dir", str(tmp_path)),
        "use 1 to 64 letters",
    )
    assert not any(tmp_path.iterdir())
