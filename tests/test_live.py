"""What a researcher sees of a run: live per-round metrics (bar, plain log lines, the library's callback), each
algorithm's result as soon as it finishes, the note on a loss that is no fit measure, and readable run names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import run_cli

from featcache.runs.names import run_name, seeds_word
from featcache.runs.train import train
from tests.synthetic import write_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "synthetic.h5")


def test_the_library_reports_each_evaluation_rounds_numbers(cache, tmp_path):
    calls = []
    r = train(
        cache,
        "fedavg",
        rounds=4,
        seeds=[0, 1],
        set=["eval_every=2", "batch_size=8"],
        out=tmp_path,
        progress=lambda done, total, live: calls.append((done, total, live)),
    )
    assert [(d, t) for d, t, _ in calls] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert calls[0][2] is None and calls[2][2] is None  # not evaluation rounds
    for (done, _, live), acc, loss in zip([calls[1], calls[3]], r["curve"]["mean_acc"], r["curve"]["train_loss"]):
        assert live["seeds"] == [0, 1] and len(live["test_acc"]) == len(live["train_loss"]) == 2
        assert sum(live["test_acc"]) / 2 == pytest.approx(acc, abs=1e-3)  # the result's own curve
        assert sum(live["train_loss"]) / 2 == pytest.approx(loss, abs=1e-3)
    assert r["per_seed"] == pytest.approx(calls[3][2]["test_acc"], abs=1e-3)


def test_a_captured_log_has_per_round_lines_with_numbers_and_results_as_they_finish(cache, tmp_path):
    res = run_cli(
        "train",
        "--cache",
        str(cache),
        "--algo",
        "fedavg",
        "--algo",
        "fedpcl",
        "--rounds",
        "4",
        "--seeds",
        "0,1",
        "--set",
        "eval_every=2",
        "--set",
        "batch_size=8",
        "--out",
        str(tmp_path),
    )
    assert res.code == 0, res.stderr
    number = r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?"
    live = re.compile(
        rf"^progress: (fedavg \(1 of 2\)|fedpcl \(2 of 2\)) ([24])/4 \(\d+ %\) \d+ s · acc ({number})% "
        rf"loss ({number}) \| seed 0 {number}% {number}, seed 1 {number}% {number}$"
    )
    found = [m for m in map(live.match, res.stderr.splitlines()) if m]
    assert [(m.group(1).split()[0], m.group(2)) for m in found] == [
        ("fedavg", "2"),
        ("fedavg", "4"),
        ("fedpcl", "2"),
        ("fedpcl", "4"),
    ]
    result = {a: json.loads(next(tmp_path.glob(f"{a}-*[0-9a-f].json")).read_text()) for a in ("fedavg", "fedpcl")}
    for m in found:
        curve = result[m.group(1).split()[0]]["curve"]
        i = curve["rounds"].index(int(m.group(2)))
        assert float(m.group(3)) == pytest.approx(curve["mean_acc"][i], abs=0.006)
        assert float(m.group(4)) == pytest.approx(curve["train_loss"][i], rel=1e-3, abs=1e-3)
    notes = [line for line in res.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: fedpcl (2 of 2): the training loss is unbounded below: eq. 8")
    out = res.stdout.splitlines()
    done = [i for i, line in enumerate(out) if re.match(r"^(fedavg|fedpcl): final acc ", line)]
    assert len(done) == 2 and done[1] < next(i for i, line in enumerate(out) if "featcache train" in line)


def test_the_objective_note_follows_the_settings(cache, tmp_path):
    from featcache.algorithms import create, objective_note
    from featcache.training.config import resolve

    pcl = create("fedpcl")
    assert objective_note(pcl, resolve(pcl)).startswith("unbounded below")
    assert objective_note(pcl, resolve(pcl, ["normalize=true"])) == ""  # a bounded objective: no note
    official = create("fedpcl-official")
    assert objective_note(official, resolve(official)) == ""
    assert objective_note(create("fedavg"), resolve(create("fedavg"))) == ""
    listed = json.loads(run_cli("algos", "--json").stdout)["algorithms"]
    assert "eq. 8" in listed["fedpcl"]["objective"] and listed["fedavg"]["objective"] == ""


def test_run_names_say_what_differs_and_keep_the_hash():
    from featcache.algorithms import create
    from featcache.training.config import resolve

    prox = create("fedprox")
    cfg = resolve(prox, ["mu=1", "lr=0.01"])
    assert run_name(prox, cfg, [0, 1, 2], None, "c2bce7fc7341") == "fedprox-mu1-lr0.01-seed0-2-c2bce7fc7341"
    assert run_name(prox, resolve(prox), [3], ["b0", "b1"], "0" * 12) == f"fedprox-b0+b1-seed3-{'0' * 12}"
    pcl = create("fedpcl")
    assert (
        run_name(pcl, resolve(pcl, ["terms=global", "rounds=3", "weight_decay=1e-5"]), [0, 2], None, "a" * 12)
        == f"fedpcl-termsglobal-rounds3-weight_decay1e-05-seed0_2-{'a' * 12}"
    )
    label = {"scheme": "label", "clients": 10, "alpha": 0.1, "per_class": 20, "holdout_domain": None}
    assert (
        run_name(prox, cfg, [0], None, "0" * 12, label)
        == f"fedprox-mu1-lr0.01-clients10-alpha0.1-per_class20-seed0-{'0' * 12}"
    )
    feature = {"scheme": "feature", "clients": None, "alpha": 0.1, "holdout_domain": "sketch"}  # α means nothing there
    assert run_name(prox, resolve(prox), [0], None, "0" * 12, feature) == f"fedprox-holdout-sketch-seed0-{'0' * 12}"
    assert (
        run_name(prox, resolve(prox), [0], None, "0" * 12, {"scheme": "label", "alpha": 0.5})
        == f"fedprox-seed0-{'0' * 12}"
    )
    assert seeds_word([0, 1]) == "seed0_1" and seeds_word([5]) == "seed5" and seeds_word([2, 3, 4, 5]) == "seed2-5"
    long = run_name(prox, resolve(prox, ["lr=0.0123456789"]), list(range(0, 40, 3)), ["a" * 60, "b" * 60], "f" * 12)
    assert len(long) == 100 + 13 and long.startswith("fedprox-lr0.0123457-aaa") and long.endswith("-" + "f" * 12)


def test_result_files_and_tensorboard_runs_are_named_by_what_differs(cache, tmp_path):
    r = train(cache, "fedprox", rounds=2, seeds=[0, 1, 2], set=["mu=1", "batch_size=8"], out=tmp_path)
    name = Path(r["result_file"]).name
    assert re.fullmatch(r"fedprox-mu1-rounds2-batch_size8-seed0-2-[0-9a-f]{12}\.json", name)
    again = train(cache, "fedprox", rounds=2, seeds=[0, 1, 2], set=["mu=1", "batch_size=8"], out=tmp_path / "b")
    assert Path(again["result_file"]).name == name  # deterministic
    saved = json.loads(Path(r["result_file"]).read_text())
    assert saved["cache"]["partition"] == {}  # the synthetic cache records no partition spec; extract's caches do
