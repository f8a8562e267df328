"""`featcache report`: runs labelled by the settings that differ, one cache per table, a title, integer round ticks."""

from __future__ import annotations

import json

import pytest

from featcache.errors import UserError
from featcache.report import labels, markdown_table, report


def result(algo="fedpcl", key="a" * 64, seeds=(0, 1, 2), **config) -> dict:
    return {"algo": algo, "config": {"lr": 0.001, "terms": "both", "rounds": 3} | config, "seeds": list(seeds),
            "cache": {"key": key, "dataset": "offline-digits", "backbones": ["b"]},
            "mean_acc": 60.0, "std_acc": 1.0, "best_round_mean_acc": 61.0, "best_round_std_acc": 0.5,
            "fairness": {"worst_20": [40.0, 2.0]}, "params_uploaded_per_round": 2570,
            "curve": {"rounds": [1, 2, 3], "mean_acc": [50.0, 55.0, 60.0]}}


def test_labels_name_the_settings_that_differ():
    assert labels([result("fedpcl"), result("fedavg")]) == ["fedpcl", "fedavg"]
    assert labels([result(terms="global"), result(terms="local")]) == ["terms=global", "terms=local"]
    assert labels([result("fedpcl", lr=0.01), result("fedavg")]) == ["fedpcl lr=0.01", "fedavg lr=0.001"]
    assert labels([result(seeds=(0,)), result(seeds=(0, 1))]) == ["seeds=0", "seeds=0,1"]
    assert labels([result(), result()]) == ["fedpcl #1", "fedpcl #2"]


def test_table_has_a_title_naming_cache_and_seeds_and_rows_by_label():
    table = markdown_table([result(terms="global"), result(terms="local")])
    first = table.splitlines()[0]
    assert "offline-digits cache aaaaaaaaaaaaaaaa" in first and "seeds 0,1,2" in first and "ddof=1" in first
    assert "| terms=global | 60.00(1.00) |" in table and "| terms=local |" in table


def test_results_from_different_caches_are_refused_in_one_line(tmp_path):
    paths = []
    for i, key in enumerate(("a" * 64, "b" * 64)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result(key=key)))
    with pytest.raises(UserError, match="2 different caches") as e:
        report(paths)
    assert "\n" not in str(e.value)


def test_curves_have_integer_round_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "r.json"
    path.write_text(json.dumps(result()))
    shown = []
    real = plt.Figure.savefig

    def spy(fig, *a, **k):
        shown.extend(fig.axes[0].get_xticks())
        return real(fig, *a, **k)

    plt.Figure.savefig = spy
    try:
        report([path], out=tmp_path / "rep")
    finally:
        plt.Figure.savefig = real
    assert shown and all(float(t).is_integer() for t in shown)


def test_algorithm_defaults_do_not_name_runs():
    """fedpcl and fedavg at their defaults differ in bn, tau, ...: only the algorithm names them."""
    from featcache.algorithms import create
    from featcache.config import resolve

    runs = [result(a) | {"config": resolve(create(a))} for a in ("fedpcl", "fedavg", "fedproto")]
    assert labels(runs) == ["fedpcl", "fedavg", "fedproto"]
    runs[0]["config"] = runs[0]["config"] | {"terms": "global"}
    assert labels(runs) == ["fedpcl terms=global", "fedavg terms=—", "fedproto terms=—"]
