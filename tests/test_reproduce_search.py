"""A reproduce row that asks for a search: validated in the schema in one line, its trial budget from the profile,
searched then trained at its best point, memoised like every job (a re-run trains nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcache.errors import UserError
from featcache.reproduce import parse_pipeline, plan, reproduce, run_job
from featcache.runs.space import REDUCTION
from featcache.training.engine import Engine
from tests.synthetic import write_cache
from tests.test_reproduce import PIPELINE, synthetic_job

pytest.importorskip("optuna")

ROW = '\n[[run]]\nrow = "m Ours"\nalgo = "fedpcl"\nset = { tau = 0.1 }\n'
SEARCH = 'search = { space = { lr = "loguniform:1e-3,0.1", tau = [0.1, 0.5] }, pruner = "halving", rungs = 1 }\n'


def pipeline(search: str = SEARCH, quick: str = "trials = 4\n", full: str = "trials = 16\n", row: str = ROW):
    text = PIPELINE.replace(ROW, '\n[[run]]\nrow = "m Ours"\nalgo = "fedpcl"\n' + search)
    text = text.replace("rounds = 2\nseeds = [0, 1]\n", "rounds = 2\nseeds = [0, 1]\n" + quick)
    return text.replace("rounds = 50\nseeds = [0, 1, 2]\n", "rounds = 50\nseeds = [0, 1, 2]\n" + full)


def test_the_profile_gives_the_trial_budget_and_other_rows_plan_as_before():
    pipe = parse_pipeline(pipeline())
    quick, full = plan(pipe, "quick"), plan(pipe, "full")
    searched = json.loads(quick[("m Ours", "Avg")].search)
    assert searched == {
        "space": {"lr": "loguniform:1e-3,0.1", "tau": [0.1, 0.5]},
        "sampler": "random",
        "pruner": "halving",
        "trials": 4,
        "rungs": 1,
        "reduction": REDUCTION,  # the search's default
    }
    assert json.loads(full[("m Ours", "Avg")].search)["trials"] == 16
    assert all(job.search == "{}" for (row, _), job in quick.items() if row != "m Ours")
    plain = plan(parse_pipeline(PIPELINE), "quick")
    assert {c: j for c, j in quick.items() if c[0] != "m Ours"} == {c: j for c, j in plain.items() if c[0] != "m Ours"}
    own = parse_pipeline(pipeline(SEARCH.replace("rungs = 1", "rungs = 1, trials = 3"), quick="", full=""))
    assert json.loads(plan(own, "quick")[("m Ours", "Avg")].search)["trials"] == 3  # the row's, without a budget


@pytest.mark.parametrize(
    "search, quick, says",
    [
        (SEARCH, "", "row 'm Ours' searches: give trials = N"),
        (SEARCH, "trials = 0\n", "--trials 0"),
        (SEARCH.replace("rungs = 1", "rungs = 2, reduction = 3"), "trials = 4\n", "needs more than 3 rounds"),
        (SEARCH.replace('"loguniform:1e-3,0.1"', '"loguniform:0,0.1"'), "trials = 4\n", "above 0"),
        (SEARCH.replace("tau = [0.1, 0.5]", 'proj_dim = "int:16,64"'), "trials = 4\n", "proj_dim is structural"),
        (SEARCH.replace("[0.1, 0.5]", '["0.1"]'), "trials = 4\n", "not the string '0.1'"),
        (SEARCH.replace('pruner = "halving"', 'pruner = "median"'), "trials = 4\n", "unknown pruner"),
        (SEARCH.replace('pruner = "halving"', 'sampler = "grid"'), "trials = 4\n", "lists only"),
        (SEARCH.replace("rungs = 1", "rungs = 1, budget = 3"), "trials = 4\n", "unknown key 'budget'"),
        (SEARCH + "grid = { lr = [0.1] }\n", "trials = 4\n", "a grid or a search, not both"),
        (SEARCH + "set = { tau = 0.1 }\n", "trials = 4\n", "tau is both searched and set"),
        (SEARCH, "trials = 4\nset = { lr = 0.1 }\n", "lr is searched in row 'm Ours' and set here"),
    ],
)
def test_a_bad_search_row_is_one_line(search, quick, says):
    with pytest.raises(UserError, match=says) as e:
        parse_pipeline(pipeline(search, quick), "toy.toml")
    assert "\n" not in str(e.value) and str(e.value).startswith("toy.toml [")


def test_a_search_job_trains_its_best_point_and_is_memoised(tmp_path, monkeypatch):
    cache = write_cache(tmp_path / "synthetic.h5")
    info = {"cache": cache, "key": "synthetic", "client_domains": ["synth"] * 4, "backbones": ["synth"]}
    info |= {"dims": [16], "classes": 5}
    options = {"space": {"lr": "loguniform:1e-3,0.3"}, "sampler": "random", "pruner": "halving", "trials": 4}
    job = synthetic_job(settings="{}", rounds=4, search=json.dumps(options | {"rungs": 1, "reduction": 2}))
    run = run_job(job, info, tmp_path / "out")
    assert run["config"]["lr"] == run["search"]["best"]["lr"] and len(run["search"]["selection"]) == 4
    assert {r["state"] for r in run["search"]["selection"]} == {"complete", "pruned"}
    (memo,) = (tmp_path / "out" / "jobs").glob("search-fedavg-*.json")
    assert json.loads(memo.read_text())["search_file"].endswith("search.json")
    plain = run_job(synthetic_job(settings="{}", rounds=4), info, tmp_path / "out")  # the same settings, unsearched
    assert len(list((tmp_path / "out" / "jobs").glob("*.json"))) == 2 and "search" not in plain
    monkeypatch.setattr(Engine, "run", lambda *a, **k: pytest.fail("a memoised search job trains nothing"))
    assert run_job(job, info, tmp_path / "out") == run


@pytest.mark.slow
def test_a_tiny_pipeline_with_a_searching_row_end_to_end(tmp_path):
    text = pipeline(quick="trials = 3\n").replace(
        "per_class = 10", "per_class = 3\ntest_per_class = 3\nimage_size = 32"
    )
    text = text.replace('title = "a toy table"', 'title = "a toy table"\nset = { batch_size = 8 }')
    path = tmp_path / "toy.toml"
    path.write_text(text)
    out, cache = tmp_path / "results", tmp_path / "cache"
    first = reproduce(path, "quick", out=out, cache=cache)
    md = Path(first["markdown"]).read_text()
    assert first["jobs"] == 2 and "| m Ours |" in md and '"trials": 3' in md  # the search in the configuration
    assert len(list((out / "jobs").glob("search-fedpcl-*.json"))) == 1
    again = reproduce(path, "quick", out=out, cache=cache)  # memoised: the same markdown, nothing trained
    assert Path(again["markdown"]).read_text() == md
