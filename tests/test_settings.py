"""Settings are declared by their owner (`Setting`: the engine's in training/config.py, an algorithm's in its file):
every registered algorithm's settings come from declarations whose defaults lie in their own ranges, a subclass
inherits and changes them, values are checked against the declaration (FedCAC's tau is a fraction, FedPCL's a
temperature), plug-ins declare theirs the same way, and `featcache algos NAME` prints them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import configure
from hypothesis import given, settings
from hypothesis import strategies as st
from harness import one_line_error, run_cli
from synthetic import write_cache

from featcache.algorithms import create, list_algorithms
from featcache.algorithms.base import FedAvg
from featcache.errors import UserError, as_list
from featcache.training.config import (
    ENGINE_SETTINGS,
    Setting,
    defaults,
    merge_rounds,
    resolve,
    scoped,
    settings_of,
    structural_keys,
)
from featcache.runs.select import grid
from featcache.runs.train import train

ALGOS = sorted(list_algorithms())


@pytest.mark.parametrize("name", ALGOS)
def test_every_setting_is_declared_with_a_default_in_its_own_range(name):
    table = settings_of(create(name))
    assert list(table)[: len(ENGINE_SETTINGS)] == list(ENGINE_SETTINGS)  # the engine's first, in their order
    for k, s in table.items():
        assert isinstance(s, Setting) and s.help, f"{name}: {k} has no declaration with a help line"
        assert isinstance(s.default, (bool, int, float, str)), f"{name}: {k}"
        assert k == "seed" or s.holds(s.default), f"{name}: default {k}={s.default!r} outside {s.range_text(k)}"
        assert not s.batched or isinstance(s.default, float), f"{name}: {k} batches but is not a float"
        assert not s.choices or isinstance(s.default, str), f"{name}: {k} has choices but is not a string"
    assert resolve(create(name)) == defaults(create(name))


def _other(s: Setting):
    """A value of setting `s` inside its range and other than its default."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if isinstance(s.default, bool):
        return not s.default
    tries = [s.default * 0.5, s.default * 2, s.default + 0.5, 0.5, 0.25] if isinstance(s.default, float) else []
    tries += [s.default + 1, s.default - 1] if isinstance(s.default, int) else []
    return next(v for v in tries if v != s.default and s.holds(v))


OWN = {n: [k for k in settings_of(create(n)) if k not in ENGINE_SETTINGS] for n in ALGOS}  # an algorithm's own


@pytest.mark.parametrize("name", [n for n in ALGOS if OWN[n]])
def test_a_search_space_takes_every_own_setting(name):
    """Each setting an algorithm declares makes a search dimension: a list of two values of its range, and a range
    where it batches."""
    from featcache.runs.space import parse_space

    table = settings_of(create(name))
    for k in OWN[name]:
        s = table[k]
        dims = parse_space(create(name), {k: [s.default, _other(s)]})
        assert dims[k].values == (s.default, _other(s)), f"{name}.{k}"
        if s.batched:
            lo, hi = sorted((s.default, _other(s)))
            assert parse_space(create(name), {k: f"uniform:{lo},{hi}"})[k].kind == "uniform", f"{name}.{k}"


SLOW = {"fedpft-con"}  # two phases over augmented views: a minute on two cores


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
        for n in ALGOS
        if any(settings_of(create(n))[k].batched for k in OWN[n])
    ],
)
def test_a_batched_grid_over_its_own_settings_trains_each_configuration_as_alone(name, data):
    """One batched run of the defaults beside a configuration with another value of every batched setting the
    algorithm declares: each trains as it would alone (a setting read from the first configuration only would not),
    what `grid` and `search` rely on to batch configurations."""
    from featcache.training.engine import Engine

    algo, table = create(name), settings_of(create(name))
    base = configure(name, fast=True, proj_dim=8, rounds=2, batch_size=16, drop_last=False, participation=0.75)
    cfgs = [base, base | {k: _other(table[k]) for k in OWN[name] if table[k].batched}]
    batched = Engine(algo, cfgs, *data).run()
    for h, cfg in enumerate(cfgs):
        alone = Engine(create(name), [cfg], *data).run()
        torch.testing.assert_close(batched["acc"][:, h], alone["acc"][:, 0], rtol=0, atol=1e-6, msg=f"{name} {h}")
        loss = batched["train_loss"][:, h]
        torch.testing.assert_close(loss, alone["train_loss"][:, 0], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_structural_settings_follow_the_declarations():
    """Floats batch unless declared otherwise; ints, bools and strings never do."""
    cfg = resolve(create("fedcac"))
    shared = structural_keys(cfg, create("fedcac"))
    assert "tau" in shared and "participation" in shared and "proj_dim" in shared and "optimizer" in shared
    assert "beta" not in shared and "lr" not in shared and "seed" not in shared
    assert "sparsity" in structural_keys(resolve(create("pfedgate")), create("pfedgate"))
    pcl = structural_keys(resolve(create("fedpcl")), create("fedpcl"))
    assert {"proto_noise_scale", "proto_noise_p"} <= set(pcl) and "tau" not in pcl


@pytest.mark.parametrize(
    "algo,bad,needle",
    [
        ("fedcac", "tau=2", "tau=2.0 out of range: tau must satisfy 0 <= tau <= 1"),
        ("fedcac", "tau=-0.5", "tau=-0.5 out of range"),
        ("fedpcl", "tau=0", "tau=0.0 out of range: tau must satisfy tau > 0"),
        ("pfedgate", "sparsity=0", "sparsity=0.0 out of range: sparsity must satisfy 0 < sparsity <= 1"),
        ("pfedsd", "temperature=0", "temperature=0.0 out of range"),
        (
            "fedamp",
            "attention=cosin",
            "attention must be one of cosine, distance (got 'cosin') (did you mean: cosine?)",
        ),
        ("perfedavg", "order=third", "order must be one of first, second"),
        ("fedavg", "optimizer=rmsprop", "optimizer must be one of adam, sgd"),
    ],
)
def test_values_are_checked_against_their_algorithms_declaration(algo, bad, needle):
    with pytest.raises(UserError, match="^" + algo + ": .*fix --set") as e:
        resolve(create(algo), [bad])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fedcac_tau_two_is_one_line_exit_2(tmp_path):
    from tests.synthetic import write_cache

    cache = write_cache(tmp_path / "c.h5")
    res = run_cli(
        "train", "--cache", cache, "--algo", "fedcac", "--set", "tau=2", "--rounds", "1", "--out", tmp_path / "runs"
    )
    one_line_error(res, "fedcac: tau=2.0 out of range")
    assert res.code == 2 and not (tmp_path / "runs").exists()


def test_subclasses_inherit_change_and_remove_settings():
    class Child(FedAvg):
        settings = {"bn": True, "gamma": Setting(0.5, "a weight", lo=0, hi=1)}

    class Grandchild(Child):
        settings = {"gamma": 0.25, "lr": 0.01, "bn": None}

    child, grand = defaults(Child), defaults(Grandchild)
    assert child["bn"] is True and child["gamma"] == 0.5 and list(child)[-2:] == ["bn", "gamma"]
    assert grand["gamma"] == 0.25 and grand["lr"] == 0.01 and "bn" not in grand
    assert settings_of(Grandchild)["gamma"].hi == 1  # the inherited declaration, another default
    assert defaults(FedAvg)["bn"] is False  # the parent is unchanged


@pytest.mark.parametrize(
    "settings,needle",
    [
        ({"gamma": 0.5}, "a new setting needs a declaration"),
        ({"lr": 1}, "lr is a float: give a default like 0.001"),
        ({"gamma": Setting(2.0, "a weight", lo=0, hi=1)}, "the default gamma=2.0 is outside its own range"),
        ({"mode": Setting("a", "a mode", choices=("b", "c"))}, "the default mode='a' is outside its own range"),
    ],
)
def test_bad_declarations_are_refused(settings, needle):
    bad = type("Bad", (FedAvg,), {"settings": settings, "name": "bad"})
    with pytest.raises(UserError, match=needle):
        settings_of(bad)


PLUGIN = """
from featcache.algorithms.fedprox import FedProx
from featcache.training.config import Setting


class Damped(FedProx):
    name = "damped-plugin"
    paper = "a test plug-in"
    settings = {"mu": 0.5, "damping": Setting(0.9, "a fraction", lo=0, hi=1, hi_open=True)}


class Broken(FedProx):
    name = "broken-plugin"
    paper = "a test plug-in"
    settings = {"damping": 0.9}
"""


def test_plugins_declare_settings_the_same_way(tmp_path, monkeypatch):
    # the plug-in is forgotten after the test
    monkeypatch.setattr("featcache.algorithms.registry._ALGOS", dict(list_algorithms()))
    path = tmp_path / "plug.py"
    path.write_text(PLUGIN)
    algo = create(f"{path}:Damped")
    cfg = configure(algo, damping=0.5)
    assert cfg["mu"] == 0.5 and cfg["damping"] == 0.5
    with pytest.raises(UserError, match="damping=1.0 out of range: damping must satisfy 0 <= damping < 1"):
        resolve(algo, ["damping=1"])
    with pytest.raises(UserError, match="Broken.settings.'damping'. = 0.9: a new setting needs a declaration"):
        create(f"{path}:Broken")
    shown = run_cli("algos", f"{path}:Damped")
    assert shown.code == 0, shown.stderr
    assert "damping" in shown.stdout and "0 <= damping < 1" in shown.stdout


def test_algos_name_prints_the_declarations():
    res = run_cli("algos", "fedcac")
    assert res.code == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if " tau " in line)
    assert "0.5" in row and "float" in row and "0 <= tau <= 1" in row and " no " in row


def test_scoped_settings_apply_to_their_algorithm_only():
    """`fedprox.mu=1` sets fedprox's mu; a plain setting goes to every chosen algorithm and a scoped one wins over it
    there; a plain setting only some of them have, or a scope naming none of them, is refused."""
    algos = [create("fedavg"), create("fedprox")]
    assert scoped(["fedprox.mu=1", "lr=0.1", "fedprox.lr=0.01"], algos) == {
        "fedavg": {"lr": "0.1"},
        "fedprox": {"lr": "0.01", "mu": "1"},
    }
    with pytest.raises(UserError, match=r"^mu is a setting of fedprox only: write fedprox.mu=1$"):
        scoped(["mu=1"], algos)
    with pytest.raises(UserError, match="moon is not among the chosen algorithms"):
        scoped({"moon.mu": 1}, algos)
    assert resolve(create("fedprox"), {"fedprox.mu": 1}) == resolve(create("fedprox"), {"mu": 1})
    with pytest.raises(UserError, match=r"fedprox is not the algorithm of this run \(fedavg\)"):
        resolve(create("fedavg"), {"fedprox.mu": 1})


def test_one_train_command_compares_algorithms_with_their_own_settings(tmp_path):
    cache = write_cache(tmp_path / "c.h5")
    res = run_cli(
        "train",
        "--cache",
        cache,
        "--algo",
        "fedavg",
        "--algo",
        "fedprox",
        "--rounds",
        "1",
        "--seeds",
        "0",
        "--set",
        "fedprox.mu=0.5",
        "--set",
        "batch_size=8",
        "--out",
        tmp_path / "runs",
        "--json",
    )
    assert res.code == 0, res.stderr
    fedavg, fedprox = json.loads(res.stdout)["runs"]
    assert fedprox["config"]["mu"] == 0.5 and "mu" not in fedavg["config"]
    assert fedavg["config"]["batch_size"] == fedprox["config"]["batch_size"] == 8
    plain = train(cache, "fedprox", rounds=1, seeds=[0], set={"mu": 0.5, "batch_size": 8}, out=tmp_path / "api")
    assert Path(plain["result_file"]).name == Path(fedprox["result_file"]).name  # the same run, however spelled


def test_a_grid_axis_may_be_scoped(tmp_path):
    cache = write_cache(tmp_path / "c.h5")
    res = grid(
        cache,
        "fedprox",
        grid=["fedprox.mu=0.1,1"],
        seeds=[0],
        rounds=1,
        set=["fedprox.batch_size=8"],
        out=tmp_path / "g",
        retrain=False,
    )
    assert res["axes"] == {"mu": [0.1, 1.0]}


def _outcome(call):
    """The value `call()` returns, or its UserError's line: any other exception fails the test."""
    try:
        return call()
    except UserError as e:
        assert "\n" not in str(e)
        return f"UserError: {e}"


FEDPROX = sorted(settings_of(create("fedprox")))
KEY = st.one_of(st.sampled_from(FEDPROX), st.text("abmux._ ", max_size=8))  # real keys and near misses
OVERRIDE = st.builds(
    lambda scope, key, value: f"{scope}{key}={value}",
    st.sampled_from(["", "fedprox.", "fedavg."]),
    KEY,
    st.one_of(st.sampled_from(["0.5", "1", "true", "sgd", ""]), st.text("0.1e-", max_size=4)),
)


@settings(max_examples=60)
@given(override=OVERRIDE)
def test_a_lone_override_is_a_list_of_one(override):
    """The Python API's set="mu=1" is the override mu=1, never the characters m, u, =, 1; as a list or a tuple it is
    the same: the same configuration, or the same one-line refusal."""
    algo = create("fedprox")
    lone = _outcome(lambda: resolve(algo, override))
    assert lone == _outcome(lambda: resolve(algo, [override])) == _outcome(lambda: resolve(algo, (override,)))
    assert lone == _outcome(lambda: resolve(algo, merge_rounds(override, None)))


@settings(max_examples=80)
@given(key=st.text("abfdeopmurx._", max_size=14), value=st.sampled_from(["1", "0.5"]))
def test_any_set_key_is_scoped_or_refused_in_one_line(key, value):
    """Whatever a --set key holds (empty scopes, several dots, unknown names), it resolves to a known setting of
    the chosen algorithms or is refused in one line; nothing else escapes."""
    algos = [create("fedavg"), create("fedprox")]
    got = _outcome(lambda: scoped([f"{key}={value}"], algos))
    if isinstance(got, dict):  # plain setting names, each algorithm's own: a known one, or resolve's one line
        for algo in algos:
            assert all(k.strip() and "." not in k for k in got[algo.name]), got
            _outcome(lambda: resolve(algo, got[algo.name]))


@settings(max_examples=40)
@given(item=st.text(max_size=10), wrap=st.sampled_from([lambda v: v, lambda v: [v], lambda v: (v,)]))
def test_as_list_takes_a_lone_string_as_one_item(item, wrap):
    assert as_list(wrap(item), "domains") == [item]
    assert as_list(None, "domains") is None
    with pytest.raises(UserError, match=r"^domains must be a str or a list of them, not "):
        as_list([item, 3], "domains")


@pytest.mark.parametrize("spelled", ["synth", ["synth"], ("synth",)], ids=["str", "list", "tuple"])
def test_list_arguments_of_the_api_take_a_lone_string(tmp_path, spelled):
    """backbones="synth" (load_cache, train, grid) and one result path (report) are lists of one."""
    import featcache

    cache = write_cache(tmp_path / "c.h5")
    data = featcache.load_cache(cache, backbones=spelled)
    assert data.meta["backbones"] == ["synth"] or data.features.shape[-1] > 0
    run = featcache.train(
        cache, "fedavg", rounds=1, seeds=0, set="batch_size=8", backbones=spelled, out=tmp_path / "runs"
    )
    assert run["backbones"] == ["synth"] and run["config"]["batch_size"] == 8
    res = featcache.grid(
        cache,
        "fedavg",
        grid="lr=0.1,0.01",
        seeds=0,
        rounds=1,
        set="batch_size=8",
        backbones=spelled,
        out=tmp_path / "g",
        retrain=False,
    )
    assert res["axes"] == {"lr": [0.1, 0.01]} and res["backbones"] == ["synth"]
    assert (
        "| fedavg |"
        in featcache.report(run["result_file"] if isinstance(spelled, str) else [run["result_file"]])["table"]
    )
