"""The public Python API (`featcache.extract/train/grid/load_cache/list_algorithms/register/create`), plug-in
algorithms (`--algo file.py:Class`, `--algo package.module:Class`), `algos --json` / `datasets --json`, and the
README's Python example."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import after_notes, one_line_error, run_cli

import featcache
from featcache.algorithms.registry import _ALGOS
from featcache.errors import UserError
from tests.synthetic import write_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5")


@pytest.fixture
def registry():
    """Plug-ins registered by a test are forgotten after it (other tests list the built-in algorithms). The built-ins
    are imported first: a snapshot without them would drop them for good (their modules stay imported)."""
    featcache.list_algorithms()
    before = dict(_ALGOS)
    yield
    _ALGOS.clear()
    _ALGOS.update(before)


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# --- the package's API ---------------------------------------------------------------------------------------------


def test_import_featcache_is_cheap():
    code = "import sys, featcache; print('torch' in sys.modules, 'h5py' in sys.modules, featcache.__version__)"
    assert python(code).split() == ["False", "False", featcache.__version__]


@pytest.mark.parametrize("first", ["function", "module"])
def test_api_names_are_plain_functions_whichever_is_imported_first(first):
    function = "from featcache import extract, train, grid, report, plot; fns = (extract, train, grid, report, plot)"
    module = "import featcache.runs.train, featcache.runs.select, featcache.results, featcache.extraction.plan"
    code = "\n".join([function, module] if first == "function" else [module, function]) + textwrap.dedent("""
        import inspect, featcache
        from featcache.runs.train import load_split, train as train_fn
        from featcache.runs.select import grid as grid_fn, run_grid
        from featcache.extraction.plan import Noise, extract as extract_fn
        assert all(inspect.isfunction(f) for f in fns) and Noise and load_split and run_grid
        assert fns[:3] == (extract_fn, train_fn, grid_fn) == (featcache.extract, featcache.train, featcache.grid)
        assert list(inspect.signature(featcache.train).parameters)[:2] == ["cache", "algo"]
        assert list(inspect.signature(featcache.extract).parameters)[:2] == ["dataset", "backbone"]
        assert featcache.report is fns[3] is featcache.results.report and featcache.plot is fns[4]
        assert featcache.load_state
        print("ok")
    """)
    assert python(code) == "ok"


def test_api_names(cache, tmp_path):
    from featcache import algorithms
    from featcache.cache import load_clients

    assert featcache.load_cache is load_clients
    assert featcache.list_algorithms is algorithms.list_algorithms and "fedavg" in featcache.list_algorithms()
    assert featcache.register is algorithms.register and featcache.create("fedavg").name == "fedavg"
    assert {"extract", "train", "grid", "load_cache", "list_algorithms", "register", "create"} <= set(dir(featcache))
    with pytest.raises(AttributeError):
        featcache.no_such_thing  # noqa: B018
    data = featcache.load_cache(cache, "train")
    assert data.features.shape[0] == 4
    result = featcache.train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path)
    assert result["algo"] == "fedavg" and Path(result["result_file"]).is_file()
    from featcache import train

    assert train(cache, "fedavg", rounds=1, seeds=[0], out=tmp_path)["mean_acc"] == result["mean_acc"]
    res = featcache.grid(cache, "fedavg", ["lr=0.1,0.01"], seeds=[0], rounds=1, out=tmp_path / "g", retrain=False)
    assert res["configs"] == 2


def test_train_takes_a_list_of_algorithms_as_repeated_algo_does(cache, tmp_path):
    """A list trains each algorithm in turn, each one's numbers and file name those of its own call; every one is
    checked before the first trains, participation against the cache's clients included."""
    both = featcache.train(cache, ["fedavg", "fedprox"], set=["fedprox.mu=0.5"], rounds=2, seeds=[0], out=tmp_path)
    alone = [
        featcache.train(cache, "fedavg", rounds=2, seeds=[0], out=tmp_path / "a"),
        featcache.train(cache, "fedprox", set={"mu": 0.5}, rounds=2, seeds=[0], out=tmp_path / "b"),
    ]
    assert [r["algo"] for r in both["runs"]] == ["fedavg", "fedprox"]
    for r, a in zip(both["runs"], alone):
        assert Path(r["result_file"]).name == Path(a["result_file"]).name
        assert (r["mean_acc"], r["curve"]) == (a["mean_acc"], a["curve"])
    with pytest.raises(UserError, match="participation") as e:  # the second one's participation picks nobody
        featcache.train(cache, ["fedavg", "fedprox"], set=["fedprox.participation=1e-9"], out=tmp_path / "c")
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()


# --- plug-in algorithms ----------------------------------------------------------------------------------------------

PLUGIN = '''
from featcache.algorithms.fedprox import FedProx


class MyProx(FedProx):
    """FedProx under another name: must train exactly as the built-in one."""

    name = "myprox-plugin"
    paper = "a test plug-in"


class NotAnAlgorithm:
    name = "nope"


class NoName(FedProx):
    pass
'''


def write_plugin(folder: Path, text: str = PLUGIN, name: str = "my_algo.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_plugin_file_trains_from_the_cli_like_the_builtin(cache, tmp_path, registry):
    plugin = write_plugin(tmp_path / "plugins")
    args = ["--cache", cache, "--rounds", "2", "--seeds", "0", "--set", "mu=0.5", "--json"]
    mine = run_cli("train", *args, "--algo", f"{plugin}:MyProx", "--out", tmp_path / "a")
    assert mine.code == 0, mine.stderr
    builtin = run_cli("train", *args, "--algo", "fedprox", "--out", tmp_path / "b")
    a, b = json.loads(mine.stdout), json.loads(builtin.stdout)
    assert a["algo"] == "myprox-plugin" and Path(a["result_file"]).name.startswith("myprox-plugin-")
    assert a["per_client"] == b["per_client"] and a["mean_acc"] == b["mean_acc"]
    # loaded once per file: naming it again (here with a plain name too) reuses the registered class
    again = run_cli("train", *args, "--algo", f"{plugin}:MyProx", "--algo", "fedprox", "--out", tmp_path / "c")
    assert again.code == 0, again.stderr
    shown = run_cli("algos", "--json")
    assert "myprox-plugin" in json.loads(shown.stdout)["algorithms"]


def test_plugin_module_trains_and_grids(cache, tmp_path, registry, monkeypatch):
    pkg = tmp_path / "site" / "mypkg"
    write_plugin(pkg, "", "__init__.py")
    write_plugin(pkg, PLUGIN.replace("myprox-plugin", "myprox-module"), "algo.py")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "mypkg.algo:MyProx",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "runs",
        "--json",
    )
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["algo"] == "myprox-module"
    g = run_cli(
        "grid",
        "--cache",
        cache,
        "--algo",
        "mypkg.algo:MyProx",
        "--grid",
        "mu=0.1,1",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--out",
        tmp_path / "grid",
        "--json",
    )
    assert g.code == 0, g.stderr
    out = json.loads(g.stdout)
    assert out["algo"] == "myprox-module" and "grid-myprox-module-" in out["run_folder"]
    assert json.loads(Path(out["retrain"]["result_file"]).read_text())["algo"] == "myprox-module"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("{dir}/missing.py:MyProx", "no file"),
        ("{dir}/my_algo.py:Missing", "has no class 'Missing'"),
        ("{dir}/my_algo.py:NotAnAlgorithm", "is not an algorithm"),
        ("{dir}/my_algo.py:NoName", "needs a `name` of its own"),
        ("{dir}/broken.py:X", "importing"),
        ("no_such_package_xyz.algo:X", "no module 'no_such_package_xyz.algo'"),
        ("{dir}/my_algo.py:", "write path/to/file.py:ClassName"),
    ],
)
def test_plugin_errors_are_one_line(cache, tmp_path, registry, spec, needle):
    folder = tmp_path / "plugins"
    write_plugin(folder)
    write_plugin(folder, "import nonexistent_dependency_xyz\n", "broken.py")
    spec = spec.format(dir=folder)
    for command in (
        ["train", "--cache", cache, "--algo", spec],
        ["grid", "--cache", cache, "--algo", spec, "--grid", "lr=0.1,0.01"],
    ):
        line = one_line_error(run_cli(*command, "--rounds", "1", "--seeds", "0", "--out", tmp_path / "runs"), needle)
        assert spec in line
    assert not (tmp_path / "runs").exists()


def test_plugin_cannot_take_a_builtin_name(tmp_path, registry):
    plugin = write_plugin(tmp_path, PLUGIN.replace('"myprox-plugin"', '"fedprox"'))
    with pytest.raises(UserError, match="already registered"):
        featcache.create(f"{plugin}:MyProx")


def test_create_and_train_accept_a_plugin_spec(cache, tmp_path, registry):
    plugin = write_plugin(tmp_path / "p")
    assert featcache.create(f"{plugin}:MyProx").name == "myprox-plugin"
    res = featcache.train(cache, f"{plugin}:MyProx", rounds=1, seeds=[0], out=tmp_path / "runs")
    assert res["algo"] == "myprox-plugin"


# --- --json on algos and datasets ------------------------------------------------------------------------------------


def test_algos_and_datasets_json():
    algos = run_cli("algos", "--json")
    assert algos.code == 0, algos.stderr
    listed = json.loads(algos.stdout)
    assert {"fedavg", "fedprox", "fedpcl"} <= set(listed["algorithms"]) and "pfedpt" in listed["unavailable"]
    assert set(listed["algorithms"]["fedavg"]) == {"paper", "uploads", "limitation", "objective", "settings"}
    assert listed["algorithms"]["fedcac"]["settings"]["tau"]["range"] == "0 <= tau <= 1"
    one = json.loads(run_cli("algos", "fedprox", "--json").stdout)
    mu = one["settings"]["mu"]
    assert (
        one["algo"] == "fedprox"
        and (mu["default"], mu["type"], mu["range"], mu["batched"]) == (0.01, "float", "mu >= 0", True)
        and mu["help"]
    )
    data = run_cli("datasets", "--json")
    assert data.code == 0, data.stderr
    assert "offline-digits" in json.loads(data.stdout)["datasets"]
    one_line_error(run_cli("algos", "fedprx", "--json"), "unknown algorithm")


# --- the README ------------------------------------------------------------------------------------------------------


def test_readme_python_api_example_runs(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[1].startswith("runs/fedavg-") and "fedavg" in printed[1]
    assert printed[2] == "round,seed,client,split,loss,accuracy,global_accuracy"
    assert list(tmp_path.joinpath("cache").glob("offline-digits-*.h5"))
    assert "--algo my_prox.py:MyProx" in (ROOT / "docs/guides/training.md").read_text()


def test_readme_plugin_example_passes_the_plain_loop_check(tmp_path, registry, monkeypatch):
    """The training guide's "Write your own algorithm": its class saved as my_prox.py passes the check it shows."""
    guide = (ROOT / "docs/guides/training.md").read_text()
    section = guide.split("## Write your own algorithm", 1)[1]
    cls_code, check_code = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    (tmp_path / "my_prox.py").write_text(cls_code)
    monkeypatch.chdir(tmp_path)
    assert 'assert_matches_plain_loop("my_prox.py:MyProx"' in check_code
    exec(compile(check_code, "docs/guides/training.md", "exec"), {})


def test_installed_entry_point_algorithms_are_registered(tmp_path, registry, monkeypatch):
    from featcache.algorithms import plugins

    site = tmp_path / "site"
    write_plugin(site / "epkg", "", "__init__.py")
    write_plugin(site / "epkg", PLUGIN.replace("myprox-plugin", "myprox-installed"), "algo.py")
    info = site / "epkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: epkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[featcache.algorithms]\nmyprox = epkg.algo:MyProx\nbroken = epkg.algo:NotAnAlgorithm\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    with pytest.warns(UserWarning, match="installed algorithm 'broken' skipped: .*is not an algorithm"):
        assert "myprox-installed" in featcache.list_algorithms()
    assert featcache.create("myprox-installed").paper == "a test plug-in"


# --- checking and debugging a plug-in ---------------------------------------------------------------------------------

FAILING = """
from featcache.algorithms.base import FedAvg


class Failing(FedAvg):
    name = "failing-plugin"

    def local_loss(self, params, buffers, x, y, mask, ctx):
        loss, new = super().local_loss(params, buffers, x, y, mask, ctx)
        return loss / helper(), new


def helper():
    return 1 // 0
"""

MIXING = '''
from featcache.algorithms.base import FedAvg


class Mixing(FedAvg):
    """Moves every client's weights towards the clients' mean after each step: a model that is not its own, which
    a batched engine and a plain per-client loop disagree on."""

    name = "mixing-plugin"

    def after_step(self, params, ctx, active, rnd):
        for v in params.values():
            v.lerp_(v.mean(1, keepdim=True).expand_as(v), 0.5)
'''


def test_an_exception_inside_a_plugin_is_one_line_naming_file_line_and_hook(cache, tmp_path, registry):
    plugin = write_plugin(tmp_path / "plugins", FAILING, "failing.py")
    for command in (["train"], ["grid", "--grid", "lr=0.1,0.01"]):
        res = run_cli(
            *command,
            "--cache",
            cache,
            "--algo",
            f"{plugin}:Failing",
            "--rounds",
            "1",
            "--seeds",
            "0",
            "--out",
            tmp_path / "runs",
        )
        line = one_line_error(after_notes(res), "ZeroDivisionError")
        lineno = FAILING.splitlines().index("    return 1 // 0") + 1
        assert f"{plugin}:{lineno}, in helper" in line  # the innermost frame of the plug-in's own code
    # featcache's own failures stay internal errors: the same exception raised from a built-in is not a plug-in's
    from featcache.algorithms import plugin_failure

    try:
        featcache.create("fedavg").local_loss(None, None, None, None, None, None)
    except Exception as e:  # noqa: BLE001
        assert plugin_failure(e) is None


def test_assert_matches_plain_loop_checks_a_plugin(tmp_path, registry):
    from featcache.testing import assert_matches_plain_loop

    good = write_plugin(tmp_path, PLUGIN, "good.py")
    diffs = assert_matches_plain_loop(f"{good}:MyProx", mu=0.5)
    assert set(diffs) == {"proj0.weight", "proj0.bias", "cls0.weight", "cls0.bias"} and max(diffs.values()) < 1e-5
    bad = write_plugin(tmp_path, MIXING, "mixing.py")
    with pytest.raises(AssertionError, match="mixing-plugin: (per-round test accuracy|parameter .*) differs"):
        assert_matches_plain_loop(f"{bad}:Mixing")


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"cache": 123}, "cache must be a path (a str or os.PathLike), not int 123"),
        ({"out": 123}, "out must be a path (a str or os.PathLike), not int 123"),
        ({"device": None}, "--device must be one of auto | cpu | cuda[:N], not NoneType None"),
        ({"algo": ["fedavg", 3]}, "algo must be a str or a list of them, not list ['fedavg', 3]"),
        ({"algo": ["fedavg", "fedavg"]}, "--algo fedavg is given twice: list each algorithm once"),
        ({"algo": []}, "algo lists no algorithm: give at least one (featcache algos lists them)"),
        ({"algo": ["fedavg", "fedprox"], "set": ["mu=1"]}, "mu is a setting of fedprox only: write fedprox.mu=1"),
        ({"seeds": None}, "--seeds must be a list of integers such as [0, 1, 2] (got None)"),
    ],
)
def test_api_arguments_of_the_wrong_kind_raise_the_one_line_error(cache, tmp_path, bad, message):
    args = {"cache": cache, "algo": "fedavg", "rounds": 1, "out": tmp_path / "runs"} | bad
    with pytest.raises(UserError) as e:
        featcache.train(**args)
    assert str(e.value) == message
    assert not (tmp_path / "runs").exists()
    with pytest.raises(UserError, match="cache must be a path"):
        featcache.load_cache(123)
