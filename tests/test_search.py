"""`featcache search`: spaces parsed strictly, pruned trials leaving the batch without changing the survivors, the
same bytes from the same seed, resumed or not, and one-line refusals of bad input."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

import featcache
from harness import after_notes, driver, everything_in, one_line_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.algorithms import create
from featcache.cache import load_clients
from featcache.errors import UserError
from featcache.results.figures import REPORT_MARK, png_mark
from featcache.runs import checkpoint
from featcache.runs.select import search
from featcache.runs.space import PRUNERS, Rungs, parse_space, rung_rounds, survivors
from featcache.runs.train import load_split
from featcache.training.config import resolve
from featcache.training.engine import Engine, take_models
from tests.synthetic import write_cache
from tests.test_resume_runs import Killed, kill_at_local_train, same_files

pytest.importorskip("optuna")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "c.h5", C=4, D=64, K=6, n=(40, 90), spread=4.0)


SEARCH = dict(
    space=["lr=loguniform:1e-3,0.3", "mu=uniform:0,1"],
    trials=8,
    seeds=[0, 1],
    rounds=10,
    set=["batch_size=16", "proj_dim=32"],
    rungs=2,
    reduction=3,
)


# -- spaces -------------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(low=st.floats(1e-6, 0.5), span=st.floats(1e-6, 0.5), kind=st.sampled_from(["uniform", "loguniform"]))
def test_a_range_parses_to_its_ends(low, span, kind):
    high = low + span
    if not low < high:
        return
    (dim,) = parse_space(create("fedprox"), [f"lr={kind}:{low!r},{high!r}"]).values()
    assert (dim.kind, dim.low, dim.high) == (kind, low, high)


@settings(max_examples=40, deadline=None)
@given(low=st.floats(-1.0, 1.0), high=st.floats(-1.0, 1.0), kind=st.sampled_from(["uniform", "loguniform"]))
def test_an_empty_inverted_or_log_zero_range_is_one_line(low, high, kind):
    text = f"mu={kind}:{low!r},{high!r}"
    bad = not low < high or (kind == "loguniform" and low <= 0) or low < 0
    if not bad:
        parse_space(create("fedprox"), [text])
        return
    with pytest.raises(UserError) as e:
        parse_space(create("fedprox"), [text])
    assert "\n" not in str(e.value)


def test_lists_int_ranges_and_dict_spaces():
    algo = create("fedprox")
    dims = parse_space(algo, {"lr": [0.1, 0.01], "mu": "uniform:0,1", "proj_dim": ["16", "32"]})
    assert dims["lr"].values == (0.1, 0.01) and dims["proj_dim"].values == (16, 32) and dims["mu"].kind == "uniform"
    assert parse_space(algo, ["local_epochs=1,2"])["local_epochs"].values == (1, 2)


@pytest.mark.parametrize(
    "space, says",
    [
        ("proj_dim=int:16,64", "proj_dim is structural"),
        ("lr=loguniform:0,0.1", "above 0"),
        ("lr=uniform:0.1,0.01", "empty or inverted"),
        ("lr=uniform:0.1,0.1", "empty or inverted"),
        ("lr=gauss:0,1", "unknown range"),
        ("rounds=5,10", "--rounds"),
        ("lr=0.1,,0.2", "empty value"),
        ("lr=uniform:1", "two numbers"),
    ],
)
def test_bad_spaces_are_one_line(space, says):
    with pytest.raises(UserError, match=says) as e:
        parse_space(create("fedprox"), [space])
    assert "\n" not in str(e.value)


def test_bad_options_are_one_line(cache, tmp_path):
    for options, says in [
        ({"trials": 0}, "--trials 0"),
        ({"rungs": 4}, "needs more than 27 rounds"),
        ({"sampler": "grid"}, "lists only"),
        ({"pruner": "median"}, "unknown pruner"),
        ({"trials": 10**12, "batch": 1}, "at most 100,000 trials"),  # hung building 10^12 waves
        ({"sampler_seed": -1}, r"--sampler-seed -1: give a whole number from 0 to 2\^32 - 1"),
        ({"sampler_seed": 2**70}, "--sampler-seed 1180591620717411303424"),
    ]:
        with pytest.raises(UserError, match=says):
            search(cache, "fedprox", out=tmp_path, **(SEARCH | options))
    assert not any(tmp_path.iterdir())  # refused before a run folder is made


def test_rungs_lie_before_the_last_round():
    assert rung_rounds(50, "halving", 3, 3) == [2, 6, 18]
    assert rung_rounds(50, "halving", 2, 4) == [4, 16]
    assert rung_rounds(50, "none", 3, 3) == []
    with pytest.raises(UserError, match="fewer --rungs"):
        rung_rounds(4, "hyperband", 3, 2)


def test_without_optuna_one_line_names_the_extra(cache, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(UserError, match=r"pip install 'featcache\[search\]'"):
        search(cache, "fedprox", out=tmp_path, **SEARCH)


# -- the rung decision: synchronous, independent of trial order ----------------------------------------------------
def test_a_rung_keeps_the_top_ceil_n_over_eta_ties_at_the_bar_included():
    population = {t: v for t, v in enumerate([50.0, 40.0, 70.0, 60.0, 10.0, 20.0, 30.0])}  # n = 7, η = 3: 3 go on
    assert sorted(survivors(population, list(population), 3)) == [0, 2, 3]
    population[1] = 50.0  # tied with the third best: both go on
    assert sorted(survivors(population, list(population), 3)) == [0, 1, 2, 3]
    assert survivors(population, [4, 2], 3) == [2]  # only the live trials asked about answer


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.sampled_from([0.0, 1.25, 2.5, 3.75, 5.0]), min_size=2, max_size=12),
    order=st.randoms(use_true_random=False),
    pruner=st.sampled_from(["halving", "hyperband"]),
)
def test_a_wave_is_decided_the_same_in_any_trial_order(values, order, pruner):
    """Every trial of a wave reaches a rung together: who goes on depends on the values, never on the order in which
    the trials report (Optuna's asynchronous pruners decide by arrival order); earlier waves' values count too."""
    rule = Rungs(PRUNERS[pruner], [2, 6], 3)
    history = [{"trial": 100 + k, "curve": [[2, 4.0], [6, 4.0]]} for k in range(3)]
    wave = {t: [[1, 0.0], [2, v]] for t, v in enumerate(values)}
    stops = []
    for _ in range(2):
        trials = list(wave)
        order.shuffle(trials)
        pending = {t: list(rule.plan(t)[1]) for t in trials}
        stops.append(sorted(rule.decide({t: wave[t] for t in trials}, history, pending)))
        assert all(2 not in rounds for rounds in pending.values())  # every trial decided at the first rung
    assert stops[0] == stops[1]
    if pruner == "halving":  # the bar: the ceil(n / 3)-th best of this wave's and the history's rung values
        bar = sorted([*values, 4.0, 4.0, 4.0], reverse=True)[-(-(len(values) + 3) // 3) - 1]
        assert stops[0] == [t for t, v in enumerate(values) if v < bar]


# -- the batch shrinks, the survivors train as alone --------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedpcl", "fedproto"])
def test_survivors_of_a_pruned_batch_train_exactly_as_alone(cache, name):
    algo = create(name)
    base = resolve(algo, {"batch_size": 16, "rounds": 5})
    cfgs = [base | {"lr": lr, "seed": s} for lr in (0.1, 0.01, 0.001) for s in (0, 1)]
    fit, val = load_split(cache, algo, holdout="fit"), load_clients(cache, "train", holdout="val")
    batch = Engine(algo, cfgs, fit, val)
    batch.run(logs=False, until=2)
    keep = [2, 3, 5]
    survivors = Engine(algo, [cfgs[i] for i in keep], fit, val)
    survivors.load_state_dict(take_models(batch.state_dict(), keep))
    assert survivors.H == 3
    went_on = survivors.run(logs=False)["acc"]  # [R, 3, C]
    alone = Engine(algo, [cfgs[i] for i in keep], fit, val).run(logs=False)["acc"]
    assert torch.equal(went_on, alone)


BUCKETS = {"space": ["lr=loguniform:1e-3,0.3", "proj_dim=16,32"], "set": ["batch_size=16", "eval_every=2"]}


@pytest.mark.parametrize("given", [{}, BUCKETS], ids=["one-bucket", "buckets-every-2nd-round"])
def test_a_pruned_search_keeps_every_curve_and_its_survivors_match_the_unpruned_search(cache, tmp_path, given):
    pruned = search(cache, "fedprox", out=tmp_path / "a", retrain=False, **(SEARCH | given))
    full = search(cache, "fedprox", out=tmp_path / "b", retrain=False, pruner="none", **(SEARCH | given))
    assert pruned["model_rounds"] < full["model_rounds"] == full["model_rounds_unpruned"] == 8 * 2 * 10
    assert pruned["rungs"] == [2, 6]
    by_trial = {r["trial"]: r for r in full["selection"]}
    states = {r["state"] for r in pruned["selection"]}
    assert states == {"complete", "pruned"}
    for r in pruned["selection"]:
        assert r["curve"][-1][0] == r["rounds_trained"]  # a pruned trial's curve up to the round it stopped at
        assert r["config"] == by_trial[r["trial"]]["config"]  # the seeded sampler asks the same trials
        assert r["curve"] == by_trial[r["trial"]]["curve"][: len(r["curve"])]  # as trained in the unpruned batch
        assert r["rounds_trained"] == (10 if r["state"] == "complete" else r["curve"][-1][0])


def test_a_trial_that_turns_nan_fails_alone_and_the_others_train_as_without_it(cache, tmp_path):
    """A trial whose loss becomes NaN/Inf (lr 1e38 with SGD) fails, its curve kept, and the search goes on: the other
    trials score what they score in a search without it; the failed trial replays from its wave file."""
    given = dict(sampler="grid", pruner="none", seeds=[0, 1], rounds=6, set=["batch_size=16", "optimizer=sgd"], batch=2)
    bad = search(
        cache, "fedavg", out=tmp_path / "a", retrain=False, space={"lr": [0.05, 1e38, 0.01]}, trials=3, **given
    )
    good = search(cache, "fedavg", out=tmp_path / "b", retrain=False, space={"lr": [0.05, 0.01]}, trials=2, **given)
    failed = [r for r in bad["selection"] if r["state"] == "failed"]
    assert [r["config"] for r in failed] == [{"lr": 1e38}] and failed[0]["rounds_trained"] == 1
    assert failed[0]["curve"] == [] and failed[0]["val_mean"] is None and bad["selection"][-1] == failed[0]
    scores = lambda r: {row["config"]["lr"]: row["curve"] for row in r["selection"] if row["state"] != "failed"}
    assert scores(bad) == scores(good)
    again = search(cache, "fedavg", out=tmp_path / "a", space={"lr": [0.05, 1e38, 0.01]}, trials=3, **given)
    assert again["waves_resumed"] == 2 and again["selection"] == bad["selection"]  # replayed, failure included
    assert "| failed |" in featcache.report([bad["run_folder"]])["table"]


def test_a_trial_diverging_first_at_an_evaluation_fails_alone_with_the_grids_line(cache, tmp_path):
    """lr 1e20 and 1e35 with Adam: the loss a step reads stays finite, the scores of the first evaluation do not. The
    command fails those trials alone, each with the one line `grid` exits with for the same configuration, trains
    the rest and retrains the best; the report lists each failure and its reason."""
    args = ["search", "--cache", cache, "--algo", "fedavg", "--space", "lr=0.05,1e20,1e35,0.01", "--sampler", "grid"]
    args += ["--trials", "4", "--pruner", "none", "--seeds", "0", "--rounds", "4", "--out", tmp_path / "runs"]
    done = run_cli(*args, "--json")
    assert done.code == 0 and "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    failed = {r["config"]["lr"]: r["reason"] for r in result["selection"] if r["state"] == "failed"}
    assert set(failed) == {1e20, 1e35} and result["best"]["lr"] in (0.05, 0.01) and "retrain" in result
    grid = ["grid", "--cache", cache, "--algo", "fedavg", "--grid", "lr=1e20", "--seeds", "0", "--rounds", "4"]
    line = one_line_error(after_notes(run_cli(*grid, "--out", tmp_path / "grid")), "became NaN/Inf in round 1")
    assert line == f"error: {failed[1e20]}" and "\n" not in failed[1e20]  # the same line in both
    assert not (tmp_path / "grid").exists()
    shown = run_cli(*args)
    assert shown.code == 0 and f"failed: {failed[1e35]}" in " ".join(shown.stdout.split())
    assert f"failed: {failed[1e20]}" in featcache.report([result["run_folder"]])["table"]


def test_a_search_whose_every_trial_diverges_is_one_line(cache, tmp_path):
    args = ["search", "--cache", cache, "--algo", "fedavg", "--space", "lr=1e20,1e35", "--sampler", "grid"]
    args += ["--trials", "2", "--pruner", "none", "--seeds", "0", "--rounds", "2", "--out", tmp_path / "runs"]
    one_line_error(after_notes(run_cli(*args)), "failed (trial")


@pytest.mark.parametrize("given", [["--set", "lr=0.1"], ["--set", "fedavg.lr=0.1"]])
def test_a_setting_both_searched_and_set_is_one_line(cache, tmp_path, given):
    args = ["search", "--cache", cache, "--algo", "fedavg", "--space", "lr=0.05,0.01", *given, "--out", tmp_path]
    one_line_error(run_cli(*args), "lr is both a --space setting and --set lr: give it in one place")
    with pytest.raises(UserError, match="lr is both a --space setting"):
        search(cache, "fedavg", {"lr": [0.05, 0.01]}, set=[given[1]], out=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["search.json", "wave-001.json"])
def test_a_damaged_search_file_is_one_line_naming_it_and_removing_it_resumes(cache, tmp_path, name):
    args = ["search", "--cache", cache, "--algo", "fedavg", "--space", "lr=0.05,0.01,0.03", "--sampler", "grid"]
    args += ["--trials", "3", "--batch", "1", "--pruner", "none", "--seeds", "0", "--rounds", "2", "--no-retrain"]
    args += ["--out", tmp_path, "--json"]
    first = run_cli(*args)
    assert first.code == 0, first.stderr
    folder = Path(json.loads(first.stdout)["run_folder"])
    path = folder / name
    if name != "search.json":
        (folder / "search.json").unlink()  # a finished search reads no wave
    for text in ["{", "[]", "\x00\xff", '{"trials": 5, "selection": 5}', '{"trials": [{"config": 1}], "space": {}}']:
        path.write_text(text)
        before = everything_in(tmp_path)
        one_line_error(run_cli(*args), f"{path} is damaged (not what `featcache search` writes there): remove it and")
        assert everything_in(tmp_path) == before and path.read_text() == text
    with pytest.raises(UserError, match="is damaged"):
        search(
            cache, "fedavg", {"lr": [0.05, 0.01, 0.03]}, 3, "grid", "none", [0], 2, batch=1, out=tmp_path, retrain=False
        )
    path.unlink()
    again = run_cli(*args)
    assert again.code == 0 and json.loads(again.stdout)["selection"] == json.loads(first.stdout)["selection"]


@pytest.mark.parametrize("sampler, pruner", [("tpe", "hyperband"), ("grid", "halving")])
def test_other_samplers_and_pruners_run(cache, tmp_path, sampler, pruner):
    space = ["lr=0.1,0.03,0.01,0.003", "mu=0,1"] if sampler == "grid" else SEARCH["space"]
    r = search(
        cache, "fedprox", out=tmp_path, retrain=False, sampler=sampler, pruner=pruner, **(SEARCH | {"space": space})
    )
    assert len(r["selection"]) == 8 and r["best"] == r["selection"][0]["config"]
    if sampler == "grid":
        assert len({json.dumps(row["config"], sort_keys=True) for row in r["selection"]}) == 8  # each point once


# -- determinism and resume ----------------------------------------------------------------------------------------
def test_the_same_search_writes_the_same_bytes_and_a_finished_one_is_skipped(cache, tmp_path, monkeypatch):
    search(cache, "fedprox", out=tmp_path / "a", batch=3, **SEARCH)
    search(cache, "fedprox", out=tmp_path / "b", batch=3, **SEARCH)
    same_files(tmp_path / "a", tmp_path / "b")
    monkeypatch.setattr(Engine, "run", lambda *a, **k: pytest.fail("a finished search trains nothing"))
    again = search(cache, "fedprox", out=tmp_path / "a", batch=3, **SEARCH)
    assert again["waves_resumed"] == "all"


def test_a_search_finished_without_a_retrain_retrains_when_asked(cache, tmp_path):
    first = search(cache, "fedprox", out=tmp_path, retrain=False, **SEARCH)
    assert "retrain" not in first
    again = search(cache, "fedprox", out=tmp_path, **SEARCH)
    assert again["waves_resumed"] == 1 and again["selection"] == first["selection"]
    assert again["retrain"]["result_file"].startswith(first["run_folder"])


def test_a_search_killed_mid_wave_and_in_its_retrain_resumes_to_the_same_bytes(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "EVERY_SECONDS", 0.0)  # the retrain checkpoints every round
    ref = search(cache, "fedprox", out=tmp_path / "ref", batch=3, sampler="tpe", **SEARCH)
    out = tmp_path / "stopped"
    with monkeypatch.context() as m:
        kill_at_local_train(m, 11)  # the second wave's round 1 (the first wave trains all 10: its first trial goes on)
        with pytest.raises(Killed):
            search(cache, "fedprox", out=out, batch=3, sampler="tpe", **SEARCH)
    assert [p.name for p in sorted(Path(out).rglob("wave-*.json"))] == ["wave-000.json"]

    def kill_in_retrain(what, done, total):
        if what == "search retrain" and done == 3:
            raise Killed

    with pytest.raises(Killed):
        search(cache, "fedprox", out=out, batch=3, sampler="tpe", progress=kill_in_retrain, **SEARCH)
    again = search(cache, "fedprox", out=out, batch=3, sampler="tpe", **SEARCH)
    assert again["waves_resumed"] == 3
    assert again["selection"] == ref["selection"]
    same_files(out, tmp_path / "ref")


@pytest.mark.slow
def test_featcache_search_killed_with_sigkill_resumes_to_the_same_bytes(cache, tmp_path):
    """`featcache search` in real processes: kill -9 after its first wave file, then in its second wave, then run to
    the end: the bytes of a run never killed."""
    args = ["search", "--cache", cache, "--algo", "fedprox", "--trials", "8", "--batch", "3", "--sampler", "tpe"]
    args += ["--space", "lr=loguniform:1e-3,0.3", "--space", "mu=uniform:0,1", "--seeds", "0,1", "--rounds", "10"]
    args += ["--set", "batch_size=16", "--set", "proj_dim=32", "--rungs", "2", "--out", "runs"]

    def run(cwd: Path, fault=()):
        return driver(cwd, args, fault)

    ref = run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "stopped"
    for fault in (
        ["--kill", "after:os.replace:1:wave-*.json"],
        ["--kill", "after:featcache.training.engine.Engine.local_train:5:*"],
    ):
        killed = run(out, fault)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run(out)
    assert done.returncode == 0, done.stderr
    same_files(out / "runs", tmp_path / "ref" / "runs")


# -- the command and its report ------------------------------------------------------------------------------------
def test_the_command_searches_and_report_reads_its_folder(cache, tmp_path):
    args = ["search", "--cache", cache, "--algo", "fedprox", "--space", "lr=loguniform:1e-3,0.3", "--trials", "6"]
    args += ["--seeds", "0", "--rounds", "10", "--set", "batch_size=16", "--rungs", "2", "--out", tmp_path / "runs"]
    done = run_cli(*args, "--json")
    assert done.code == 0, done.stderr
    result = json.loads(done.stdout)
    shown = run_cli("report", result["run_folder"], "--out", tmp_path / "report")
    assert shown.code == 0, shown.stderr
    assert "| rank | trial | lr |" in shown.stdout and "stopped at round" in shown.stdout
    rows = [line.split(" | ") for line in shown.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    head, rows = rows[0], {int(r[1]): r for r in rows[1:]}
    last, stopped = head.index("val acc % mean(std), last round"), head.index("val acc % mean(std) where stopped")
    for r in result["selection"]:  # a last round's score and a rung's in columns of their own
        cells, score = rows[r["trial"]], f"{r['val_mean']:.2f}({r['val_std']:.2f})"
        assert (cells[last], cells[stopped]) == ((score, "-") if r["state"] == "complete" else ("-", score))
    assert {r["state"] for r in result["selection"]} == {"complete", "pruned"}
    assert png_mark(tmp_path / "report" / "search.png") == REPORT_MARK
    assert (tmp_path / "report" / "report.md").read_text().count("\n| ") == 1 + len(result["selection"])
    one_line_error(run_cli(*args, "--space", "proj_dim=int:16,64"), "proj_dim is structural")
    one_line_error(run_cli(*args[:-2], "--trials", "0"), "--trials 0")
    for flags, says in [
        (["--trials", str(10**12), "--batch", "1"], "a search trains at most 100,000 trials"),
        (["--sampler-seed=-1"], "--sampler-seed -1"),
        (["--sampler-seed", str(2**70)], "give a whole number from 0 to 2^32 - 1"),
    ]:
        one_line_error(run_cli(*args[:-2], "--out", tmp_path / "refused", *flags), says)
    assert not (tmp_path / "refused").exists()
    one_line_error(run_cli("report", result["run_folder"], cache), "report it alone")
    api = featcache.report([result["run_folder"]])  # the API reads the folder as the command does
    assert api["table"] == shown.stdout.removesuffix("\n") and api["search"] == result["run_folder"]
    with pytest.raises(UserError, match="report it alone"):
        featcache.report([cache, result["run_folder"]])


def test_the_search_figure_names_each_line_by_its_settings(monkeypatch):
    from featcache.results import search as S

    drawn: list[str] = []
    monkeypatch.setattr(
        S, "png", lambda fig, mark: drawn.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    )
    row = lambda trial, state, lr, mu, curve: {
        "trial": trial,
        "state": state,
        "config": {"lr": lr, "mu": mu},
        "curve": curve,
    }
    S.search_png(
        {
            "algo": "fedprox",
            "sampler": "tpe",
            "pruner": "asha",
            "rungs": [2],
            "space": {"lr": "loguniform:1e-3,0.3", "mu": "float:0,1"},
            "selection": [
                row(4, "complete", 0.01, 0.5, [[2, 50.0], [4, 61.0]]),
                row(0, "complete", 0.2, 0.0, [[2, 40.0], [4, 44.0]]),
                row(1, "pruned", 0.001, 1.0, [[2, 10.0]]),
            ],
        }
    )
    assert drawn == ["trial 4: lr=0.01, mu=0.5 (best)", "trial 0: lr=0.2, mu=0", "pruned (x: stopped)"]


def test_a_batch_not_given_is_planned_from_memory_and_trains_as_the_same_batch_given(cache, tmp_path, monkeypatch):
    """Memory for two trials x two seeds: a search given no --batch trains waves of two, each trial as the same
    search given --batch 2 trains it."""
    from featcache.runs import select

    monkeypatch.setattr(select, "plan_chunk", lambda n, per_model, budget: min(n, 4))
    given = dict(space={"lr": "loguniform:1e-3,1e-1"}, trials=5, pruner="none", seeds=[0, 1], rounds=2, retrain=False)
    planned = search(cache, "fedavg", out=tmp_path / "a", **given)
    explicit = search(cache, "fedavg", out=tmp_path / "b", batch=2, **given)
    assert planned["batch"] == 2 and sorted(Path(planned["run_folder"]).glob("wave-*.json"))[-1].name == "wave-002.json"
    assert planned["selection"] == explicit["selection"]
